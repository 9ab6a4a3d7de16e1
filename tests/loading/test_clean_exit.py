"""A trainer process that used a loader exits with status 0 and prints nothing of h5feed's at exit.

Why: a daemon thread of the loader still inside a CUDA call when the interpreter exits is ended by
`pthread_exit` through PyTorch's C++ frames, and the process aborts with "terminate called without
an active exception" (status 134) or a fatal "PyEval_SaveThread" error: it did in about half the
runs of `device="cuda"` on an H200 before the loader's finalizer waited for its slot-release
thread.  Each case runs in a process of its own, several times (the failure was a race), with the
trainer leaving the loader to the interpreter's exit, closing it, or breaking out of a pass.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TRAINER = """
import sys, torch, h5feed
store, backend, ending = sys.argv[1:4]
device = "cuda" if torch.cuda.is_available() and sys.argv[4] == "cuda" else None
options = {"workers": {"decode": h5feed.WorkersOptions(num_workers=2, device=device)},
           "threads": {"decode": h5feed.ThreadsOptions(threads=2, device=device)}}[backend]
if sys.argv[4] == "decode-cuda":
    options = {"decode": h5feed.CudaOptions(threads=2)}
loader = h5feed.BatchLoader(store, flavor="speculators-legacy", max_len=128, **options)
for i, batch in enumerate(loader):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if ending == "break" and i == 2:
        break
if ending == "close":
    loader.close()
print("done", flush=True)
"""

PLACES = [pytest.param("host", id="host"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu(nvcomp=False)),
          pytest.param("decode-cuda", id="decode-cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("backend", ["workers", "threads"])
def test_a_trainer_process_that_used_a_loader_exits_silently_with_status_0(synthetic_store, tmp_path: Path,
                                                                             backend: str, place: str) -> None:
    if place == "decode-cuda" and backend == "workers":
        pytest.skip("decode on the GPU reads with threads")
    store = synthetic_store("clean-exit", "speculators-legacy-pt", 8, 32, (64, 128))
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    runs = 3 if place != "host" else 1  # the race showed in about half the runs on the GPU
    for ending in ("leave", "close", "break"):
        for _ in range(runs):
            done = subprocess.run([sys.executable, str(script), str(store.path), backend, ending, place],
                                  capture_output=True, text=True, timeout=300)
            assert (done.returncode, done.stdout.strip(), done.stderr.strip()) == (0, "done", ""), \
                f"{backend} {place} {ending}: status {done.returncode}\n{done.stderr[-2000:]}"
