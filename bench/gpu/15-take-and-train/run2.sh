#!/bin/bash
# H200 lease, part 2 (issue 16): the GPU tests, the trainer's path from a cold disk (160 Kimi samples, 65 ms step),
# then next() on the training thread under the step, the tree before taking a batch was only a stream comparison
# and an event query (.old: `git archive` of the commit before) and after, alternating.
# Run from the repository root with .whl, .whl2 and .old carried:  bash bench/gpu/15-take-and-train/run2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl2/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
NEW=/tmp/site:$PWD:$PWD/bench OLD=/tmp/site:$PWD/.old:$PWD/bench
export PYTHONPATH=$NEW
D=/root/h5data; mkdir -p $D
echo "cores $(nproc); $(uptime)"; nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; timeout $limit "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t)) s"; }
step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_loader.py tests/test_gpu_decode.py \
    tests/test_fp8_store.py tests/test_batching.py tests/test_engine.py -k "(gpu or cuda or Cuda or fp8) and not bucket"
tail -3 $OUT/gpu_tests.log
step cold160 240 python3 bench/train_step.py --hidden-size 7168 --workers 4 --step-ms 65 --convert-workers 16 --cold \
    --data-dir $D --make-data 160 --loaders baseline,h5feed-batch,h5feed-batch-threads,h5feed-gpu --out /tmp/ts
cp /tmp/ts/train_step.json $OUT/cold160.json; grep -A8 '^loader ' $OUT/cold160.log | tail -6
grep -i -m3 'error\|terminate\|Traceback' $OUT/cold160.log
S=$(ls -d $D/*/store | head -1)
for i in 1 2; do
  step next_old_$i 60 env PYTHONPATH=$OLD python3 bench/gpu/11-cold-reads/cold_read_probe.py $S --cuda --parts D; tail -2 $OUT/next_old_$i.log
  step next_new_$i 60 python3 bench/gpu/11-cold-reads/cold_read_probe.py $S --cuda --parts D; tail -2 $OUT/next_new_$i.log
done
