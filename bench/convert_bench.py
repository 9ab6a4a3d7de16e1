"""Converter throughput and compression ratio on the bench's Kimi-shaped set.

For each worker count, converts the embedded `h5feed bench` source set (built
and cached by `h5feed.bench.ensure_default_set`) into a fresh store and reports
MB/s in (source file bytes) and out (chunk bytes written), per worker, the
compression ratio, the CPU seconds it took and the peak memory of one worker.
The page cache is dropped before each run when possible (root), so the source
is read from disk as in a first conversion.

    python bench/convert_bench.py --workers 1 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil
import torch

from h5feed.bench import DEFAULT_CACHE_DIR, SyntheticSpec, drop_page_cache, ensure_default_set
from h5feed.convert import convert
from h5feed.store import Store

if TYPE_CHECKING:  # typing.Self is 3.11+
    from typing_extensions import Self


@dataclass
class ConvertRun:
    workers: int
    cold: bool
    samples: int
    tokens: int
    seconds: float
    bytes_in: int  # source file bytes
    bytes_out: int  # chunk bytes written (the store's hidden, id and mask chunks)
    raw_bytes: int  # tensor bytes the samples hold (hidden states + input_ids + loss_mask)
    mb_in_per_s: float
    mb_out_per_s: float
    mb_in_per_s_per_worker: float
    mb_out_per_s_per_worker: float
    ratio_file: float  # bytes_in / bytes_out
    ratio_raw: float  # raw_bytes / bytes_out
    cpu_seconds: float  # this process and its workers
    peak_worker_memory_bytes: int  # the largest PSS (RSS if no PSS) any one worker reached
    memory_metric: str
    other_cpu_share: float  # share of the CPUs other processes used meanwhile


class _PerProcessPeak:
    """Largest memory any single child process reached, sampled every 100 ms."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        try:
            self.metric = "pss" if hasattr(self.process.memory_full_info(), "pss") else "rss"
        except (psutil.Error, OSError):
            self.metric = "rss"
        self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for child in self.process.children(recursive=True):
                try:
                    info = child.memory_full_info() if self.metric == "pss" else child.memory_info()
                    self.peak = max(self.peak, getattr(info, self.metric))
                except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                    continue

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _tree_cpu() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def _busy() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def run(src: Path, dst: Path, workers: int, cold: bool) -> ConvertRun:
    if dst.exists():
        shutil.rmtree(dst)
    if cold:
        problem = drop_page_cache()
        if problem:
            raise RuntimeError(problem)
    cpu0, busy0, t0 = _tree_cpu(), _busy(), time.perf_counter()
    with _PerProcessPeak() as peak:
        report = convert(src, dst, workers=workers, progress=False)
    wall = time.perf_counter() - t0
    cpu = _tree_cpu() - cpu0
    other = max(0.0, _busy() - busy0 - cpu) / (wall * (psutil.cpu_count() or 1))
    store = Store(dst)
    per_token = (store.num_aux_layers + 1) * store.hidden_size * store.info.torch_dtype.itemsize + 2 * 8
    raw = int(store.sample_lengths.sum()) * per_token
    seconds = report.seconds
    return ConvertRun(
        workers=workers, cold=cold, samples=report.num_samples, tokens=report.num_tokens, seconds=seconds,
        bytes_in=report.bytes_in, bytes_out=report.bytes_out, raw_bytes=raw,
        mb_in_per_s=report.bytes_in / seconds / 1e6, mb_out_per_s=report.bytes_out / seconds / 1e6,
        mb_in_per_s_per_worker=report.bytes_in / seconds / 1e6 / workers,
        mb_out_per_s_per_worker=report.bytes_out / seconds / 1e6 / workers,
        ratio_file=report.bytes_in / report.bytes_out, ratio_raw=raw / report.bytes_out,
        cpu_seconds=cpu, peak_worker_memory_bytes=peak.peak, memory_metric=peak.metric, other_cpu_share=other,
    )


def codec_rates(store_path: Path) -> dict[str, float]:
    """The store codec's encode and decode rates on one core, on the hidden chunks of sample 0 (MB/s of raw bytes)."""
    from numcodecs import Blosc, blosc

    store = Store(store_path)
    config = dict(store.info.codec)
    if config.pop("name") != "blosc":
        return {}
    codec = Blosc(cname=config["cname"], clevel=config["clevel"],
                  shuffle={"shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}.get(config["shuffle"], 0),
                  blocksize=config["blocksize"])
    blosc.use_threads = False
    raw = store.read_sample(0)
    c = store.info.chunk_tokens
    chunks = [t[i : i + c].view(torch.uint16).numpy().copy() for t in (raw.aux_hidden_states, raw.last_hidden_state)
              for i in range(0, len(t) - c + 1, c)]
    nbytes = sum(a.nbytes for a in chunks)
    t0 = time.process_time()
    encoded = [codec.encode(a) for a in chunks]
    enc = time.process_time() - t0
    outs = [np.empty_like(a) for a in chunks]
    for e, o in zip(encoded, outs):
        codec.decode(e, o)  # touch the outputs once: decode is timed into warm buffers
    t0 = time.process_time()
    for e, o in zip(encoded, outs):
        codec.decode(e, o)
    dec = time.process_time() - t0
    return {"encode_mb_per_s_per_core": nbytes / enc / 1e6, "decode_mb_per_s_per_core": nbytes / dec / 1e6,
            "ratio": nbytes / sum(len(e) for e in encoded)}


def table(runs: list[ConvertRun]) -> str:
    header = ["workers", "cache", "samples", "seconds", "MB/s in", "MB/s out", "in/worker", "out/worker",
              "ratio (file)", "ratio (raw)", "CPU s", "peak/worker", "other CPU"]
    rows = [header] + [[
        str(r.workers), "cold" if r.cold else "warm", str(r.samples), f"{r.seconds:.1f}", f"{r.mb_in_per_s:.0f}",
        f"{r.mb_out_per_s:.0f}", f"{r.mb_in_per_s_per_worker:.0f}", f"{r.mb_out_per_s_per_worker:.0f}",
        f"{r.ratio_file:.3f}", f"{r.ratio_raw:.3f}", f"{r.cpu_seconds:.1f}",
        f"{r.peak_worker_memory_bytes / 1e9:.2f} GB {r.memory_metric.upper()}", f"{100 * r.other_cpu_share:.0f}%",
    ] for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to run (default: 1 2)")
    p.add_argument("--num-samples", type=int, default=SyntheticSpec.num_samples)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--dst", type=Path, help="scratch store (default: CACHE_DIR/convert-bench-store, removed after)")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=None,
                   help="drop the page cache before each run (default: when possible)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    spec = SyntheticSpec(num_samples=a.num_samples)
    say = lambda m: print(f"[convert_bench] {m}", file=sys.stderr, flush=True)
    store = ensure_default_set(a.cache_dir, spec, log=say)
    src = store.parent / "src"
    dst = a.dst or Path(a.cache_dir).expanduser() / "convert-bench-store"
    cold = a.cold is not False and drop_page_cache() is None
    if a.cold and not cold:
        say("cannot drop the page cache (needs root): warm runs only")
    runs = []
    for workers in a.workers:
        r = run(src, dst, workers, cold)
        say(f"workers={workers}: {r.mb_in_per_s:.0f} MB/s in, {r.mb_out_per_s:.0f} MB/s out, ratio {r.ratio_raw:.3f}, "
            f"{r.seconds:.1f} s")
        runs.append(r)
    shutil.rmtree(dst, ignore_errors=True)
    rates = codec_rates(store)
    info: dict[str, Any] = {"source": str(src), "cpus": psutil.cpu_count(), "codec": Store(store).info.codec,
                            "codec_one_core": rates, "runs": [asdict(r) for r in runs]}
    if a.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"source {src}\n" + table(runs))
        if rates:
            print(f"codec {info['codec']} on one core, hidden chunks of sample 0: encode "
                  f"{rates['encode_mb_per_s_per_core']:.0f} MB/s, decode {rates['decode_mb_per_s_per_core']:.0f} MB/s "
                  f"(raw bytes), ratio {rates['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
