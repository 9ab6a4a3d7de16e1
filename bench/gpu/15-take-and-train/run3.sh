#!/bin/bash
# H200 lease, part 3 (issue 16): the GPU tests on the tree whose TrainerStream resolves the device index once, then
# next_probe.py on that tree and on the tree before TrainerStream (.old), alternating.
# Run from the repository root with .whl, .whl2 and .old carried:  bash bench/gpu/15-take-and-train/run3.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl2/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
NEW=/tmp/site:$PWD OLD=/tmp/site:$PWD/.old
export PYTHONPATH=$NEW
echo "cores $(nproc); $(uptime)"
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; timeout $limit "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t)) s"; }
step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_loader.py tests/test_gpu_decode.py \
    tests/test_fp8_store.py tests/test_batching.py tests/test_engine.py tests/test_loader_trust.py \
    -k "(gpu or cuda or Cuda or fp8) and not bucket"
tail -1 $OUT/gpu_tests.log
for i in 1 2; do
  step probe_new_$i 150 python3 bench/gpu/15-take-and-train/next_probe.py --work /tmp/np --samples 32 --passes 1
  grep -v Warn $OUT/probe_new_$i.log | grep -v '^  *warn'
  step probe_old_$i 150 env PYTHONPATH=$OLD python3 bench/gpu/15-take-and-train/next_probe.py --work /tmp/np --samples 32 --passes 1
  grep -v Warn $OUT/probe_old_$i.log | grep -v '^  *warn'
done
