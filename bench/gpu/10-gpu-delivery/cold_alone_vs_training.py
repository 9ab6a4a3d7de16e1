"""How fast each backend reads from a cold disk, alone and under the 65 ms step (RESULTS: the GPU backend off
the training thread). Run on the GPU box from the repository root: python3 bench/gpu/10-gpu-delivery/cold_alone_vs_training.py
(the 64-sample Kimi set of bench/train_step.py --make-data 64 must exist)."""
import statistics
import sys
import time

import torch

sys.path.insert(0, "bench"); sys.path.insert(0, "src")
import train_step as ts

import h5feed
from h5feed.bench import drop_page_cache
from h5feed import CudaBatchLoader
from h5feed.loading.backends.cuda import CudaBackend
from h5feed.store import Store

store = Store("/root/.cache/h5feed/bench/speculators-legacy-pt-H7168-K3-T1500-1900-n64-s0/store")
args = dict(flavor="speculators-legacy", max_len=2048, hidden_states_dtype=torch.bfloat16, seed=0)
times = {}
f = CudaBackend._stage
def w(*a, **k):
    t = time.perf_counter(); r = f(*a, **k); times.setdefault("_stage", []).append(time.perf_counter() - t); return r
CudaBackend._stage = w
device = torch.device("cuda")
shape = ts.Shape.for_hidden(store.hidden_size, store.num_aux_layers)
warm = ts.warm_batch(shape, 2048)
trainer, shape, ms = ts.calibrate(shape, device, warm, 65)
print("step alone ms", round(ms, 1))
def run(label, make, train):
    loader = make()
    drop_page_cache(); times.clear()
    waits, iters = [], []; t0 = time.perf_counter(); cpu0 = time.process_time()
    it = iter(loader)
    for step in range(64):
        t = time.perf_counter()
        try: batch = next(it)
        except StopIteration: break
        t1 = time.perf_counter()
        if train: trainer.step(batch).item()
        else: torch.cuda.current_stream().synchronize()
        del batch
        waits.append(t1 - t); iters.append(time.perf_counter() - t)
    el = time.perf_counter() - t0; cpu = time.process_time() - cpu0
    st = times.get("_stage", [0])
    print(f"{label:40s} train={train}: {len(waits)/el:5.1f} samples/s  wait {100*sum(waits[1:])/sum(iters[1:]):5.1f}%  iter median {statistics.median(iters[1:])*1e3:5.1f} ms  stage median {statistics.median(st)*1e3:6.1f} ms  proc cpu {cpu/el:4.2f} cores", flush=True)
for train in (False, True):
    run("cpu BatchLoader threads=4", lambda: h5feed.BatchLoader(store, **args, threads=4), train)
    run("cuda threads=4", lambda: CudaBatchLoader(store, **args, threads=4), train)
    run("cuda threads=8 prefetch=16", lambda: CudaBatchLoader(store, **args, threads=8, prefetch=16), train)
