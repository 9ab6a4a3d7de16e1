#!/bin/bash
# One short H200 lease: speculators 0.9's own `train`, eager (TORCHDYNAMO_DISABLE=1: its torch.compile of the fused
# loss fails on this image's torch 2.11) at 2048 tokens a batch, with its file backend, h5feed's backend and
# BatchLoader, page cache dropped before each arm.  bash bench/gpu/14-speculators-train/run4.sh (.whl, .whl2 carried)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
t=$SECONDS
timeout 230 python3 bench/speculators_train.py --make-data 48 --hidden-size 2048 --tokens 256:1024 --total-seq-len 2048 \
    --workers 8 --steps 25 --warmup 5 --cold --work /tmp/spec --out /tmp/spec_out > $OUT/speculators_train_small.log 2>&1
echo "rc=$? $((SECONDS-t)) s"; cp /tmp/spec_out/speculators_train*.json $OUT/ 2>/dev/null
grep -E '^\{' $OUT/speculators_train_small.log | tail -3; grep -m3 -E '^[A-Za-z.]*Error' $OUT/speculators_train_small.log
