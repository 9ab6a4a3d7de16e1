"""The GPU backend, warm: samples/s alone, per-call CPU times of its stages, and a torch.profiler trace under the
65 ms step (RESULTS: the GPU backend off the training thread). Run on the GPU box from the repository root with OUT set:
python3 bench/gpu/10-gpu-delivery/profile_gpu_loader.py (the 64-sample Kimi set of bench/train_step.py --make-data 64 must exist)."""
import gzip
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, "bench"); sys.path.insert(0, "src")
import train_step as ts

from h5feed.gpu import CudaBloscDecoder
from h5feed import CudaBatchLoader
from h5feed.loading.backends.cuda import CudaBackend
from h5feed.store import Store

OUT = os.environ["OUT"]
store = Store("/root/.cache/h5feed/bench/speculators-legacy-pt-H7168-K3-T1500-1900-n64-s0/store")
args = dict(flavor="speculators-legacy", max_len=2048, hidden_states_dtype=torch.bfloat16, seed=0)
times = {}
def wrap(cls, name):
    f = getattr(cls, name)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); times.setdefault(name, []).append(time.perf_counter() - t); return r
    setattr(cls, name, w)
for n in ("_decode", "_stage", "_placed"): wrap(CudaBackend, n)
for n in ("decode_placed", "_launch", "_decode_streams", "_unshuffle_kernel", "_plan"): wrap(CudaBloscDecoder, n)
def report(label):
    print(label)
    for k, v in times.items(): print(f"   {k:18s} calls {len(v):4d} median {statistics.median(v)*1e3:7.2f} ms  total {sum(v):6.2f} s")
    times.clear()
for threads in (4, 8):
    loader = CudaBatchLoader(store, **args, threads=threads)
    t = time.perf_counter(); n = 0
    for b in loader:
        torch.cuda.current_stream().synchronize(); n += 1
    el = time.perf_counter() - t
    report(f"alone warm threads={threads}: {n/el:.1f} samples/s, gpu_decode_ms/sample {loader.gpu_decode_ms/n:.2f}")
device = torch.device("cuda")
shape = ts.Shape.for_hidden(store.hidden_size, store.num_aux_layers)
warm = ts.warm_batch(shape, 2048)
trainer, shape, ms = ts.calibrate(shape, device, warm, 65)
print("step alone ms", ms)
loader = CudaBatchLoader(store, **args, threads=4)
it = iter(loader); waits = []; steps = []
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
for step in range(60):
    if step == 30: prof.start()
    t = time.perf_counter(); batch = next(it); t1 = time.perf_counter()
    trainer.step(batch).item(); t2 = time.perf_counter()
    waits.append(t1 - t); steps.append(t2 - t)
    if step == 40: prof.stop()
print(f"with training: next() median {statistics.median(waits[5:])*1e3:.2f} ms, mean {statistics.mean(waits[5:])*1e3:.2f}; iteration median {statistics.median(steps[5:])*1e3:.1f} ms")
report("with training")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
prof.export_chrome_trace("/tmp/trace.json")
with open("/tmp/trace.json", "rb") as f, gzip.open(f"{OUT}/trace.json.gz", "wb") as g: shutil.copyfileobj(f, g)
