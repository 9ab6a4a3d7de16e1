#!/bin/bash
# One H200 lease from a bare machine: the GPU tests on the merged tree, then speculators 0.9's own `train`
# (eager: TORCHDYNAMO_DISABLE=1, since its torch.compile of the fused loss fails on this image's torch 2.11)
# with its file backend, h5feed's backend and BatchLoader, page cache dropped before each arm.
# Run from the repository root with .whl and .whl2 carried:  bash bench/gpu/14-speculators-train/run3.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
O=$OUT
echo "cores $(nproc); $(uptime)"; nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; timeout $limit "$@" >> $O/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t)) s"; }
step gpu_tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_loader.py tests/test_gpu_decode.py \
    tests/test_fp8_store.py tests/test_batching.py tests/test_engine.py -k "(gpu or cuda or Cuda or fp8) and not bucket"
tail -3 $O/gpu_tests.log
TORCHDYNAMO_DISABLE=1 step speculators_train 380 python3 bench/speculators_train.py --make-data 96 --hidden-size 4096 \
    --tokens 512:2048 --total-seq-len 8192 --workers 8 --steps 30 --cold --work /tmp/spec --out /tmp/spec_out
cp /tmp/spec_out/speculators_train*.json $O/ 2>/dev/null
grep -E '^\{' $O/speculators_train.log | tail -3; grep -m3 -E '^[A-Za-z.]*Error' $O/speculators_train.log
