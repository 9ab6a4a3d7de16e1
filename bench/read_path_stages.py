"""CPU cost of each stage of h5feed's read path, and of alternatives, in one process (no DataLoader).

CPU time (time.process_time), so the figures hold up when other processes share the
machine; wall time beside it.  Uses the embedded bench store (built by `h5feed bench`).

    python bench/read_path_stages.py [STORE]
"""
import math
import mmap
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numcodecs import blosc

from h5feed.bench import DEFAULT_CACHE_DIR, SyntheticSpec
from h5feed.store import Store

S = sys.argv[1] if len(sys.argv) > 1 else str(DEFAULT_CACHE_DIR.expanduser() / SyntheticSpec().name / "store")
store = Store(S)
N = 12
def shm_alloc(shape, dtype):
    st = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(st, 0, shape)
pool = {}
def reuse_alloc(shape, dtype):
    k = (shape, dtype)
    if k not in pool:
        pool[k] = torch.empty(shape, dtype=dtype); pool[k].view(torch.uint8).fill_(0)
    return pool[k]
anon_alloc = lambda shape, dtype: torch.empty(shape, dtype=dtype)
def run(name, f, reps=N):
    f(0)
    c, w = time.process_time(), time.perf_counter()
    for i in range(reps): f(i + 1)
    c, w = (time.process_time() - c) / reps, (time.perf_counter() - w) / reps
    print(f"{name:62s} CPU {c*1e3:6.1f} ms/sample  wall {w*1e3:6.1f} ms", flush=True)
run("read_sample -> fresh shm (what a worker does)", lambda i: store.read_sample(i, 2049, allocate=shm_alloc))
run("read_sample -> fresh anon (torch.empty)", lambda i: store.read_sample(i, 2049, allocate=anon_alloc))
run("read_sample -> reused, pre-faulted buffers", lambda i: store.read_sample(i, 2049, allocate=reuse_alloc))
# the chunk reads alone: mmap+populate (store.py now) vs read() vs readinto a reused buffer
paths = [store.chunk_path(n, c) for n in ("aux_hidden_states", "last_hidden_states", "input_ids", "loss_mask") for c in range(int(store.sample_starts[1]) // 256)]
buf = bytearray(16 << 20)
def via_mmap(i):
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ); m.close()
def via_read(i):
    for p in paths:
        with open(p, "rb", buffering=0) as f: f.read()
def via_readinto(i):
    for p in paths:
        with open(p, "rb", buffering=0) as f: f.readinto(buf)
run("chunk files of sample 0: open + mmap(MAP_POPULATE) + munmap", via_mmap)
run("chunk files of sample 0: open + read() (new bytes)", via_read)
run("chunk files of sample 0: open + readinto(reused buffer)", via_readinto)
# decode alone: store chunks of sample 0 into a pre-faulted buffer
datas = [store.chunk_path(n, c).read_bytes() for n in ("aux_hidden_states", "last_hidden_states") for c in range(7)]
out = np.zeros(256 * 21504 * 2, np.uint8)
def decode(i):
    for d in datas: blosc.decompress(d, out[: 256 * (21504 if len(d) > 4_000_000 else 7168) * 2])
run("blosc zstd decode of sample 0's hidden chunks (pre-faulted out)", decode)
def shm_touch(i):
    t = shm_alloc((100_000_000,), torch.uint8); t.fill_(0)
run("shm alloc + first touch of 100 MB (no decode)", shm_touch)
# main-process threaded reader: does blosc release the GIL?
with ThreadPoolExecutor(2) as ex:
    w = time.perf_counter(); c = time.process_time()
    list(ex.map(lambda i: store.read_sample(i % 48, 2049, allocate=anon_alloc), range(24)))
    w = time.perf_counter() - w; c = time.process_time() - c
print(f"2 threads in one process, fresh anon: {24 / w:.2f} samples/s, CPU {c / 24 * 1e3:.1f} ms/sample")
