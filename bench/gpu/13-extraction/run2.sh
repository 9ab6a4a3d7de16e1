#!/bin/bash
# One H200 lease from a bare machine: the writer beside CUDA tensors, speculators 0.9's own `train` on its
# file backend / h5feed's backend / BatchLoader, and FP8 against lossless on a small LM trained here.
# Run from the repository root with .whl and .whl2 carried:  bash bench/gpu/13-extraction/run2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
O=$OUT; mkdir -p $O/realacts
echo "cores $(nproc); $(uptime)"; nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; timeout $limit "$@" >> $O/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t)) s"; }
for device in cuda cpu; do
  step writer 45 python3 bench/writer_bench.py --samples 12 --out /tmp/wb-$device --device $device
done
grep -E '"device"|ms_per_sample|disk_ratio|cpu_s_per' $O/writer.log
step speculators_train 200 python3 bench/speculators_train.py --make-data 96 --hidden-size 4096 --tokens 512:2048 \
    --total-seq-len 8192 --workers 8 --steps 40 --cold --work /tmp/spec --out /tmp/spec_out
cp /tmp/spec_out/speculators_train.json $O/ 2>/dev/null; tail -5 $O/speculators_train.log
step realacts 290 python3 bench/real_activations.py --out $O/realacts --stores /tmp/realacts-stores --train-seconds 90
tail -25 $O/realacts.log
df -h /tmp | tail -1
