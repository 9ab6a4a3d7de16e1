#!/bin/bash
# H200 lease, part 1 (issue 17): speculators 0.9's own `train` with its file backend, h5feed's backend and
# BatchLoader (eager: TORCHDYNAMO_DISABLE=1, its torch.compile of the fused loss fails on this image's torch 2.11),
# 2048 tokens a step, page cache dropped before each arm; then the test that runs its `train` a few steps.
# Run from the repository root with .whl and .whl2 carried:  bash bench/gpu/15-take-and-train/run1.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
echo "cores $(nproc); $(uptime)"; nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; timeout $limit "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t)) s"; }
step speculators_train 400 python3 bench/speculators_train.py --make-data 240 --hidden-size 2048 --tokens 256:1024 \
    --total-seq-len 2048 --workers 8 --steps 20 --warmup 5 --cold --work /tmp/spec --out /tmp/spec_out
cp /tmp/spec_out/speculators_train.json $OUT/ 2>/dev/null
grep -E '^\{' $OUT/speculators_train.log; grep -m3 -E '^[A-Za-z.]*Error|Traceback' $OUT/speculators_train.log
step few_steps 150 python3 -m pytest -q -p no:cacheprovider tests/test_speculators_backend.py -k few_steps
tail -3 $OUT/few_steps.log
