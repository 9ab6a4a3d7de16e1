"""`h5feed bench`: loader throughput against speculators 0.4's `.pt` loader, on the same samples, in one run.

Three loaders read the same samples with the same DataLoader settings
(`num_workers`, `batch_size=None`: items as the Dataset yields them, bfloat16
hidden states, the same `max_len` and flavor):

- ``pt-baseline``: `h5feed.baseline.Eagle3SampleFileDataset` (speculators 0.4) over the
  store's source files, in a DataLoader;
- ``HiddenStatesDataset``: the map-style drop-in, in a DataLoader;
- ``HiddenStatesStream``: the prefetching IterableDataset, in a `StreamLoader`.
- ``HiddenStatesStream-threads``: the same with `num_workers=0` and one reader thread per
  core in the trainer's own process: nothing crosses a process boundary.

Each pass consumes every item (one element of each hidden tensor is read, so the
data must have arrived) and is timed from the creation of the DataLoader
iterator (worker start included) to the last item.  A cold pass drops the page
cache first (root only); a warm pass is the second of two passes in a row.
Memory is the peak, sampled every 50 ms, of the sum over the main process and
all its children of PSS (RSS where PSS is not available): RSS would count the
shared-memory pages a worker hands to the trainer twice.

With no STORE, the embedded default is used: a Kimi-shaped synthetic set
(speculators-legacy-pt, H=7168, K=3, 1500..1900 tokens per sample, 48 samples,
~4.8 GB) written under the cache folder, converted once with all cores, and
reused by later runs.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch

from h5feed.bench.loaders import (
    LOADER_LABELS,
    LOADERS,
    _CountedBaseline,
    _h5feed_worker_stats,
    _hidden_tensors,
    _item_tokens,
    _make_loader,
    _Setup,
)
from h5feed.bench.report import BenchResult, PassResult
from h5feed.bench.synthetic_set import (
    BASELINE_FORMAT,
    DEFAULT_CACHE_DIR,
    DEFAULT_SPEC,
    SyntheticSpec,
    drop_page_cache,
    ensure_default_set,
)
from h5feed.errors import H5feedError
from h5feed.store import Store

if TYPE_CHECKING:  # typing.Self is 3.11+
    from typing_extensions import Self

# DESIGN.md "Targets": dev box, Kimi shape, 4 workers, max_len 2048
TARGETS = {"cold": 3.5, "warm": 5.0}
MEMORY_INTERVAL_S = 0.05
DISTURBED_SHARE = 0.05  # other processes' share of the CPUs above which a pass is flagged


def _pss_available() -> bool:
    try:
        return hasattr(psutil.Process().memory_full_info(), "pss")
    except (psutil.Error, OSError, AttributeError):
        return False


class MemorySampler:
    """Peak summed memory of this process and all its children, sampled by a thread; also CPU time.

    It also counts the CPU seconds (user + system) of the process tree over the block, so a pass
    can say how much CPU it cost and how much of the machine other processes took meanwhile.
    """

    def __init__(self, interval: float = MEMORY_INTERVAL_S) -> None:
        self.interval = interval
        self.metric = "pss" if _pss_available() else "rss"
        self.peak = 0  # of the sum over the process tree
        self.peak_child = 0  # of the largest single child process (a worker)
        self.cpu_seconds = 0.0  # of this process tree, during the last `with` block
        self.other_cpu_share = 0.0  # share of all CPUs used by other processes meanwhile
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def measure(self) -> int:
        """The tree's summed memory now (and the largest child's, kept in `peak_child`)."""
        total = 0
        for proc in [self._process, *self._process.children(recursive=True)]:
            try:
                used = proc.memory_full_info().pss if self.metric == "pss" else proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
            total += used
            if proc is not self._process:
                self.peak_child = max(self.peak_child, used)
        return total

    def _tree_cpu(self) -> float:
        """CPU seconds of this process, its reaped children (the kernel adds them on wait) and its live ones."""
        t = self._process.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        for proc in self._process.children(recursive=True):
            try:
                c = proc.cpu_times()
                total += c.user + c.system
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
        return total

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.measure())
            if self._stop.wait(self.interval):
                return

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def __enter__(self) -> Self:
        self.peak = self.peak_child = 0
        self._cpu_start = self._tree_cpu()
        self._busy_start, self._wall_start = self._busy(), time.perf_counter()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="h5feed-bench-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.measure())
        wall = time.perf_counter() - self._wall_start
        self.cpu_seconds = self._tree_cpu() - self._cpu_start
        other = self._busy() - self._busy_start - self.cpu_seconds
        self.other_cpu_share = max(0.0, other) / max(wall * (psutil.cpu_count() or 1), 1e-9)


def _run_pass(name: str, cache: str, s: _Setup, sampler: MemorySampler) -> PassResult:
    dataset, loader = _make_loader(name, s)
    samples = tokens = hidden_bytes = 0
    check = 0.0
    t0 = time.perf_counter()
    iterator = iter(loader)  # workers start here (before the sampler thread: no fork with a live thread)
    with sampler:
        for item in iterator:
            for tensor in _hidden_tensors(item):
                if tensor.numel():
                    check += float(tensor[(-1,) * tensor.dim()])  # one element: the data has arrived
                hidden_bytes += tensor.numel() * tensor.element_size()
            tokens += _item_tokens(item)
            samples += 1
            del item
        seconds = time.perf_counter() - t0
    del iterator
    if isinstance(dataset, _CountedBaseline):
        workers = dataset.worker_stats(seconds)
        bytes_read = sum(w.bytes_read for w in workers)
    else:
        workers = _h5feed_worker_stats(dataset, seconds)
        bytes_read = sum(w.bytes_read for w in workers)
    return PassResult(
        loader=name, cache=cache, samples=samples, tokens=tokens, seconds=seconds,
        samples_per_s=samples / seconds, hidden_bytes=hidden_bytes, gb_per_s=hidden_bytes / seconds / 1e9,
        bytes_read=bytes_read, peak_memory_bytes=sampler.peak, memory_metric=sampler.metric, workers=workers,
        cpu_seconds=sampler.cpu_seconds, other_cpu_share=sampler.other_cpu_share, check=check,
    )


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def run_bench(
    store: str | os.PathLike[str] | None = None,
    *,
    workers: int = 4,
    max_len: int | None = 2048,
    cold: bool | None = None,
    warm: bool = True,
    loaders: Sequence[str] = LOADERS,
    flavor: str | None = None,
    hidden_states_dtype: torch.dtype = torch.bfloat16,
    cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR,
    spec: SyntheticSpec = DEFAULT_SPEC,
    convert_workers: int | None = None,
    progress: bool = True,
) -> BenchResult:
    """Time the loaders on the same samples and return the figures (see the module docstring).

    Args:
        store: an h5feed store; None builds (or reuses) the embedded default set in `cache_dir`.
        workers: DataLoader `num_workers` for every loader.
        max_len: the trainer's max_len, given to the h5feed loaders (the baseline, like 0.4, ignores it).
        cold: None = cold passes when the page cache can be dropped; True = asked for (said so when
            impossible); False = warm only.
        warm: measure warm passes (each after a warming pass).
        loaders: a subset of `LOADERS`.
        flavor: the item flavor (default speculators-legacy, or specforge for a post-norm store).
        spec, convert_workers: the embedded default set and the workers converting it (default all cores).
        progress: one line per pass on stderr.
    """
    def say(message: str) -> None:
        if progress:
            print(f"[h5feed bench] {message}", file=sys.stderr, flush=True)

    unknown = [name for name in loaders if name not in LOADERS]
    if unknown:
        raise ValueError(f"unknown loader(s) {unknown}: choose from {', '.join(LOADERS)}")
    if workers < 0:
        raise ValueError("workers must be >= 0")
    notes: list[str] = []
    if store is None:
        store_path = ensure_default_set(cache_dir, spec, convert_workers=convert_workers, progress=progress, log=say)
    else:
        store_path = Path(store)
    opened = Store(store_path)
    info = opened.info
    source_root = Path(info.source_root)
    if flavor is None:
        flavor = "speculators-legacy" if info.last_state_norm == "pre" else "specforge"
        if flavor != "speculators-legacy":
            notes.append(f"the store holds post-norm last states ({info.source_format}): h5feed yields the "
                         "specforge flavor")
    missing_loss_mask = "error"
    if not opened.has_loss_mask.all():
        missing_loss_mask = "ones"
        notes.append(f"{int((~opened.has_loss_mask).sum())} sample(s) had no loss mask: h5feed reads them with "
                     "missing_loss_mask='ones'")

    baseline_files: list[Path] | None = None
    source_bytes: int | None = None
    if "pt-baseline" in loaders:
        files = [source_root / p for p in opened.source_paths]
        if info.source_format != BASELINE_FORMAT:
            notes.append(f"no baseline: the speculators 0.4 .pt loader reads {BASELINE_FORMAT} files only, and this "
                         f"store was converted from {info.source_format}; h5feed benched alone")
        elif flavor != "speculators-legacy":
            notes.append(f"no baseline: it yields speculators-legacy items, not {flavor}; h5feed benched alone")
        elif missing_loss_mask != "error":
            notes.append("no baseline: speculators 0.4 fails on samples without a loss mask; h5feed benched alone")
        elif not all(f.exists() for f in files):
            missing = [str(f) for f in files if not f.exists()]
            notes.append(f"no baseline: {len(missing)} source file(s) of the store are gone (e.g. {missing[0]}); "
                         "h5feed benched alone")
        else:
            baseline_files = files
            source_bytes = sum(f.stat().st_size for f in files)
    active = [name for name in loaders if name != "pt-baseline" or baseline_files is not None]

    caches: list[str] = []
    want_cold = cold is not False
    if want_cold:
        problem = drop_page_cache()
        if problem is None:
            caches.append("cold")
        else:
            notes.append(f"{problem}: cold figures not measured, warm only")
            say(notes[-1])
    if warm:
        caches.append("warm")
    if not caches:
        raise H5feedError("nothing to measure: cold passes are off or impossible, and warm passes are off")

    setup = _Setup(opened, flavor, max_len, hidden_states_dtype, workers, baseline_files, missing_loss_mask)
    sampler = MemorySampler()
    if sampler.metric == "rss":
        notes.append("PSS is not available here: memory is the sum of RSS, which counts shared pages in every "
                     "process that maps them (an overestimate)")
    result = BenchResult(
        store=str(store_path), source_root=str(source_root), source_format=info.source_format,
        num_samples=len(opened), num_tokens=int(opened.sample_lengths.sum()), hidden_size=info.hidden_size,
        num_aux_layers=info.num_aux_layers, store_bytes=_dir_bytes(store_path), source_bytes=source_bytes,
        workers=workers, max_len=max_len, flavor=flavor,
        hidden_states_dtype=str(hidden_states_dtype).removeprefix("torch."), memory_metric=sampler.metric,
        cold="cold" in caches, machine=_machine(), notes=notes,
    )
    say(f"{len(opened)} samples, {workers} worker(s), max_len={max_len}, passes: "
        f"{', '.join(caches)} x {', '.join(active)}")

    def report(p: PassResult, what: str) -> None:
        say(f"{LOADER_LABELS[p.loader]:<30} {what:<7} {p.samples} samples in {p.seconds:6.2f} s: "
            f"{p.samples_per_s:7.2f} samples/s, {p.gb_per_s:5.2f} GB/s, peak {p.peak_memory_bytes / 1e9:.2f} GB "
            f"{p.memory_metric.upper()}, {p.cpu_seconds / max(p.samples, 1):.3f} CPU s/sample, other processes "
            f"{100 * p.other_cpu_share:.0f}% of the CPUs")

    for name in active:
        for cache in caches:
            if cache == "cold":
                problem = drop_page_cache()
                if problem is not None:
                    raise H5feedError(problem)
            else:
                report(_run_pass(name, "warm-up", setup, sampler), "warm-up")
            p = _run_pass(name, cache, setup, sampler)
            report(p, cache)
            result.passes.append(p)

    for p in result.passes:
        base = result.get("pt-baseline", p.cache)
        if base is not None and base.samples_per_s > 0:
            p.ratio = p.samples_per_s / base.samples_per_s
        if p.samples != len(opened):
            notes.append(f"{p.loader} {p.cache} delivered {p.samples} items, not {len(opened)}")
    disturbed = [p for p in result.passes if p.other_cpu_share > DISTURBED_SHARE]
    if disturbed:
        notes.append("other processes used more than {:.0f}% of the CPUs during: {}; those figures are low".format(
            100 * DISTURBED_SHARE, ", ".join(f"{p.loader}/{p.cache} ({100 * p.other_cpu_share:.0f}%)" for p in disturbed)))
    checks = {p.check for p in result.passes}
    if len(checks) > 1:
        notes.append("the loaders' items differ (sums of the touched elements disagree): "
                     + ", ".join(f"{p.loader}/{p.cache}={p.check!r}" for p in result.passes))
    # DESIGN.md states the targets for the Kimi shape, 4 workers and max_len 2048 (on the 2-core dev box)
    applies = info.hidden_size == 7168 and workers == 4 and max_len == 2048
    for p in result.passes:
        if p.loader != "pt-baseline" and p.ratio is not None and p.cache in TARGETS:
            target = TARGETS[p.cache]
            result.targets.append({"loader": p.loader, "cache": p.cache, "target": target, "ratio": p.ratio,
                                   "met": p.ratio >= target, "applies": applies})
    return result
