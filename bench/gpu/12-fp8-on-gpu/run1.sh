#!/bin/bash
# One H200 lease, everything from a bare machine: the GPU tests, then the trainer's path from a cold disk
# (exact store, then its --precision fp8 conversion), next() under the step, and Model-Optimizer's flavor.
# Run from the repository root with .whl and .whl2 carried:  bash bench/gpu/12-fp8-on-gpu/run1.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/bench PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
O=$OUT; D=/root/h5data; mkdir -p $D
echo "cores $(nproc); $(uptime)"; nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; timeout $limit "$@" > $O/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t)) s"; }
TS="python3 bench/train_step.py --hidden-size 7168 --workers 4 --step-ms 65 --convert-workers 16 --cold --data-dir $D"
step gpu_tests 100 python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu_loader.py tests/test_gpu_decode.py \
    tests/test_fp8_store.py tests/test_batching.py tests/test_engine.py -k "gpu or cuda or Cuda or fp8"
tail -4 $O/gpu_tests.log
step cold160 220 $TS --make-data 160 --loaders baseline,h5feed-batch,h5feed-batch-threads,h5feed-gpu --out /tmp/ts; cp /tmp/ts/train_step.json $O/cold160.json
grep -A8 '^loader ' $O/cold160.log | tail -6; grep -i -m3 'error\|terminate\|Traceback' $O/cold160.log
step fp8_160 100 $TS --make-data 160 --precision fp8 --loaders h5feed-batch,h5feed-gpu --out /tmp/tsf; cp /tmp/tsf/train_step.json $O/fp8_160.json
grep -A8 '^loader ' $O/fp8_160.log | tail -3; grep -i -m3 'error\|terminate\|Traceback' $O/fp8_160.log
step next_probe 50 python3 bench/gpu/11-cold-reads/cold_read_probe.py $(ls -d $D/*/store | head -1) --cuda --parts D
tail -3 $O/next_probe.log
step modelopt64 100 $TS --make-data 64 --flavor modelopt --loaders baseline,h5feed-batch,h5feed-gpu --out /tmp/tsm; cp /tmp/tsm/train_step.json $O/modelopt64.json
grep -A8 '^loader ' $O/modelopt64.log | tail -4
du -sh $D/* 2>/dev/null
