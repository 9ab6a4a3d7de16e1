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

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from h5feed.baseline import Eagle3SampleFileDataset
from h5feed.datasets import HiddenStatesDataset, HiddenStatesStream, StreamLoader
from h5feed.errors import H5feedError
from h5feed.metrics import MAX_WORKERS
from h5feed.store import Store
from h5feed.synthetic import write_synthetic

if TYPE_CHECKING:  # typing.Self is 3.11+
    from typing_extensions import Self

LOADERS = ("pt-baseline", "HiddenStatesDataset", "HiddenStatesStream", "HiddenStatesStream-threads")
LOADER_LABELS = {
    "pt-baseline": "speculators 0.4 .pt (baseline)",
    "HiddenStatesDataset": "h5feed HiddenStatesDataset",
    "HiddenStatesStream": "h5feed HiddenStatesStream",
    "HiddenStatesStream-threads": "h5feed HiddenStatesStream, reader threads in the trainer (num_workers=0)",
}
BASELINE_FORMAT = "speculators-legacy-pt"
# DESIGN.md "Targets": dev box, Kimi shape, 4 workers, max_len 2048
TARGETS = {"cold": 3.5, "warm": 5.0}
DEFAULT_CACHE_DIR = Path("~/.cache/h5feed/bench")
MEMORY_INTERVAL_S = 0.05
DISTURBED_SHARE = 0.05  # other processes' share of the CPUs above which a pass is flagged
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


# --- results -------------------------------------------------------------------------------------


@dataclass
class WorkerStats:
    """One DataLoader worker's share of a pass.

    For h5feed loaders it comes from the dataset's `counters.snapshot()` (bytes read from the
    store, compressed); the baseline has no counters, so the bench counts its items and the
    sizes of the files they came from.
    """

    worker: int
    samples: int
    samples_per_s: float  # over the pass's wall time
    bytes_read: int
    read_gb_per_s: float
    busy_seconds: float  # baseline: time in __getitem__; h5feed: read + decode seconds
    read_seconds: float | None = None
    decode_seconds: float | None = None


@dataclass
class PassResult:
    loader: str
    cache: str  # "cold" or "warm"
    samples: int
    tokens: int  # tokens of the items delivered (after the shift)
    seconds: float
    samples_per_s: float
    hidden_bytes: int  # bytes of hidden-state tensors delivered
    gb_per_s: float
    bytes_read: int  # from storage: store chunks (h5feed) or whole files (baseline)
    peak_memory_bytes: int
    memory_metric: str  # "pss" or "rss"
    workers: list[WorkerStats] = field(default_factory=list)
    cpu_seconds: float = 0.0  # CPU (user + system) of the main process and its workers during the pass
    other_cpu_share: float = 0.0  # share of the machine's CPUs other processes used meanwhile (disturbance)
    ratio: float | None = None  # samples/s over the baseline's, same cache state
    check: float = 0.0  # sum of the touched elements: equal for every loader when the items agree


@dataclass
class BenchResult:
    store: str
    source_root: str
    source_format: str
    num_samples: int
    num_tokens: int
    hidden_size: int
    num_aux_layers: int
    store_bytes: int
    source_bytes: int | None
    workers: int
    max_len: int | None
    flavor: str
    hidden_states_dtype: str
    memory_metric: str
    cold: bool  # cold passes were measured
    machine: dict[str, Any]
    passes: list[PassResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    targets: list[dict[str, Any]] = field(default_factory=list)

    def get(self, loader: str, cache: str) -> PassResult | None:
        for p in self.passes:
            if p.loader == loader and p.cache == cache:
                return p
        return None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def table(self) -> str:
        """The plain-text report: one row per loader x cache state, then targets and notes."""
        metric = self.memory_metric.upper()
        header = ["loader", "cache", "samples", "samples/s", "GB/s", "x baseline", f"peak mem ({metric})",
                  "per-worker samples/s", "CPU s/sample", "other CPU"]
        rows = [header]
        for p in self.passes:
            rows.append([
                LOADER_LABELS.get(p.loader, p.loader),
                p.cache,
                str(p.samples),
                f"{p.samples_per_s:.2f}",
                f"{p.gb_per_s:.2f}",
                "-" if p.ratio is None else f"{p.ratio:.2f}x",
                f"{p.peak_memory_bytes / 1e9:.2f} GB",
                " ".join(f"{w.samples_per_s:.2f}" for w in p.workers) or "-",
                f"{p.cpu_seconds / max(p.samples, 1):.3f}",
                f"{100 * p.other_cpu_share:.0f}%",
            ])
        out = [
            (f"store  {self.store} ({self.num_samples} samples, {self.num_tokens} tokens, H={self.hidden_size}, "
             f"K={self.num_aux_layers}, {self.store_bytes / 1e9:.2f} GB)"),
            f"source {self.source_root} ({self.source_format}"
            + (f", {self.source_bytes / 1e9:.2f} GB)" if self.source_bytes else ")"),
            (f"DataLoader num_workers={self.workers}, batch_size=None, max_len={self.max_len}, flavor={self.flavor}, "
             f"hidden_states_dtype={self.hidden_states_dtype}; machine: {self.machine.get('cpus')} cores, "
             f"{self.machine.get('memory_bytes', 0) / 2**30:.0f} GiB"),
            "",
            *format_table(rows, right={2, 3, 4, 5, 6, 8, 9}),
        ]
        if self.targets:
            out.append("")
            for t in self.targets:
                verdict = "met" if t["met"] else "NOT met"
                scope = "" if t["applies"] else " (targets are for H=7168, 4 workers, max_len 2048: indicative only)"
                out.append(f"DESIGN.md target {t['cache']} >= {t['target']:.1f}x baseline: {LOADER_LABELS[t['loader']]} "
                           f"{t['ratio']:.2f}x -> {verdict}{scope}")
        for note in self.notes:
            out.append(f"note: {note}")
        return "\n".join(out)


def format_table(rows: list[list[str]], right: set[int]) -> list[str]:
    """Plain-text columns: the first row is the header, a rule under it; columns in `right` align right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return [line(rows[0]), line(["-" * w for w in widths]), *(line(r) for r in rows[1:])]


# --- the embedded default data set ----------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticSpec:
    """The synthetic source set `h5feed bench` builds when given no store (Kimi-K2 shape by default)."""

    num_samples: int = 48
    hidden_size: int = 7168
    num_aux_layers: int = 3
    tokens: tuple[int, int] = (1500, 1900)
    seed: int = 0
    format: str = BASELINE_FORMAT

    @property
    def name(self) -> str:
        lo, hi = self.tokens
        return f"{self.format}-H{self.hidden_size}-K{self.num_aux_layers}-T{lo}-{hi}-n{self.num_samples}-s{self.seed}"

    def approx_bytes(self) -> int:
        return self.num_samples * (self.tokens[0] + self.tokens[1]) // 2 * (self.num_aux_layers + 1) * self.hidden_size * 2


def _source_complete(src: Path, marker: Path, spec: SyntheticSpec) -> bool:
    try:
        record = json.loads(marker.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    if record.get("spec") != dataclasses.asdict(spec) | {"tokens": list(spec.tokens)}:
        return False
    files = record.get("files", {})
    if len(files) != spec.num_samples:
        return False
    for rel, size in files.items():
        try:
            if (src / rel).stat().st_size != size:
                return False
        except FileNotFoundError:
            return False
    return True


def _store_complete(store_path: Path, src: Path, spec: SyntheticSpec) -> bool:
    try:
        store = Store(store_path)
    except (H5feedError, OSError, ValueError, KeyError):
        return False
    return (
        len(store) == spec.num_samples
        and Path(store.info.source_root) == src.resolve()
        and store.info.hidden_size == spec.hidden_size
        and not store.info.skipped
    )


def ensure_default_set(
    cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR,
    spec: SyntheticSpec = SyntheticSpec(),
    *,
    convert_workers: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The store of the embedded default set, writing and converting it first unless a complete one is cached."""
    from h5feed.convert import convert

    say = log or (lambda message: None)
    folder = Path(cache_dir).expanduser() / spec.name
    src, store_path, marker = folder / "src", folder / "store", folder / "src-complete.json"
    if not _source_complete(src, marker, spec):
        for stale in (marker, src, store_path):
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink(missing_ok=True)
        say(f"writing {spec.num_samples} synthetic {spec.format} samples (~{spec.approx_bytes() / 1e9:.1f} GB, "
            f"H={spec.hidden_size}, K={spec.num_aux_layers}, {spec.tokens[0]}..{spec.tokens[1]} tokens) to {src}")
        t0 = time.perf_counter()
        files = write_synthetic(src, spec.format, spec.num_samples, spec.hidden_size, spec.num_aux_layers,
                                        spec.tokens, spec.seed)
        record = {
            "spec": dataclasses.asdict(spec) | {"tokens": list(spec.tokens)},
            "files": {Path(f).relative_to(src).as_posix(): Path(f).stat().st_size for f in files},
        }
        marker.write_text(json.dumps(record))
        say(f"wrote {sum(record['files'].values()) / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    else:
        say(f"reusing the synthetic set in {src}")
    if _store_complete(store_path, src, spec):
        say(f"reusing the store {store_path}")
        return store_path
    workers = convert_workers if convert_workers is not None else (os.cpu_count() or 1)
    say(f"converting {src} -> {store_path} with {workers} worker(s)")
    try:
        convert(src, store_path, workers=workers, progress=progress)  # resumes an unfinished one
    except H5feedError:
        convert(src, store_path, workers=workers, progress=progress, overwrite=True)
    if not _store_complete(store_path, src, spec):
        raise H5feedError(f"converting the bench set into {store_path} did not give a complete store")
    return store_path


# --- measuring -----------------------------------------------------------------------------------


def drop_page_cache() -> str | None:
    """Drop the page cache; None on success, else why it could not be done."""
    try:
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
    except OSError as exc:
        who = "root" if os.geteuid() != 0 else "write access to it"
        return f"cannot drop the page cache (writing {DROP_CACHES}: {exc.strerror or exc}; needs {who})"
    return None


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


class _CountedBaseline(Dataset[dict[str, Any]]):
    """Bench-side bookkeeping around the baseline (which has no counters): items and file bytes per worker.

    It only counts; the item is the baseline's, untouched.
    """

    def __init__(self, inner: Eagle3SampleFileDataset) -> None:
        self.inner = inner
        self.table = torch.zeros(MAX_WORKERS, 3, dtype=torch.float64).share_memory_()  # samples, bytes, seconds

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        item = self.inner[index]
        elapsed = time.perf_counter() - t0
        info = get_worker_info()
        row = self.table[info.id if info is not None else 0]
        row[0] += 1
        row[1] += os.stat(self.inner.data[index]).st_size
        row[2] += elapsed
        return item

    def worker_stats(self, seconds: float) -> list[WorkerStats]:
        stats = []
        for w, (samples, nbytes, busy) in enumerate(self.table.tolist()):
            if samples:
                stats.append(WorkerStats(w, int(samples), samples / seconds, int(nbytes), nbytes / seconds / 1e9, busy))
        return stats


def _h5feed_worker_stats(dataset: HiddenStatesDataset | HiddenStatesStream, seconds: float) -> list[WorkerStats]:
    snap = dataset.counters.snapshot()
    return [
        WorkerStats(
            worker=w.worker,
            samples=w.samples,
            samples_per_s=w.samples / seconds,
            bytes_read=w.bytes_read,
            read_gb_per_s=w.bytes_read / seconds / 1e9,
            busy_seconds=w.read_seconds + w.decode_seconds,
            read_seconds=w.read_seconds,
            decode_seconds=w.decode_seconds,
        )
        for w in snap.workers
    ]


def _hidden_tensors(item: dict[str, Any]) -> list[torch.Tensor]:
    """The hidden-state tensors of an item, whatever the flavor calls them."""
    return [v for k, v in item.items() if isinstance(v, torch.Tensor) and ("hidden_state" in k or k == "target")]


def _item_tokens(item: dict[str, Any]) -> int:
    if "lengths" in item:
        return int(item["lengths"][0])
    return int(item["input_ids"].shape[-1])


@dataclass
class _Setup:
    store: Store
    flavor: str
    max_len: int | None
    dtype: torch.dtype
    workers: int
    baseline_files: list[Path] | None
    missing_loss_mask: str


def _make_loader(name: str, s: _Setup) -> tuple[Any, DataLoader[Any]]:
    """A fresh dataset and its loader for one pass (fresh counters, fresh workers)."""
    common: dict[str, Any] = {"num_workers": s.workers}
    if name == "pt-baseline":
        assert s.baseline_files is not None
        dataset: Any = _CountedBaseline(
            Eagle3SampleFileDataset(s.max_len or 0, file_list=s.baseline_files, hidden_states_dtype=s.dtype)
        )
        return dataset, DataLoader(dataset, batch_size=None, shuffle=False, **common)
    if name == "HiddenStatesDataset":
        dataset = HiddenStatesDataset(s.store, s.flavor, s.max_len, hidden_states_dtype=s.dtype,
                                      missing_loss_mask=s.missing_loss_mask)  # type: ignore[arg-type]
        return dataset, DataLoader(dataset, batch_size=None, shuffle=False, **common)
    if name == "HiddenStatesStream":
        dataset = HiddenStatesStream(s.store, s.flavor, s.max_len, hidden_states_dtype=s.dtype, shuffle=False,
                                     missing_loss_mask=s.missing_loss_mask)  # type: ignore[arg-type]
        return dataset, StreamLoader(dataset, batch_size=None, **common)
    if name == "HiddenStatesStream-threads":
        threads = os.cpu_count() or 1
        dataset = HiddenStatesStream(s.store, s.flavor, s.max_len, hidden_states_dtype=s.dtype, shuffle=False,
                                     missing_loss_mask=s.missing_loss_mask,  # type: ignore[arg-type]
                                     threads=threads, prefetch=2 * threads)
        return dataset, StreamLoader(dataset, batch_size=None, num_workers=0)
    raise ValueError(f"unknown loader {name!r}: one of {', '.join(LOADERS)}")


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
    spec: SyntheticSpec = SyntheticSpec(),
    convert_workers: int | None = None,
    progress: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    read_cache_dir: str | os.PathLike[str] | None = None,
    read_cache_limit: int | None = None,
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
        storage_options, read_cache_dir, read_cache_limit: for a STORE URL, `Store`'s `storage_options`,
            `cache_dir` and `cache_limit`.
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
        store_path = store
    opened = Store(store_path, storage_options=storage_options, cache_dir=read_cache_dir, cache_limit=read_cache_limit)
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

    store_bytes = opened.stored_nbytes() if opened.remote else _dir_bytes(Path(store_path))
    setup = _Setup(opened, flavor, max_len, hidden_states_dtype, workers, baseline_files, missing_loss_mask)
    sampler = MemorySampler()
    if sampler.metric == "rss":
        notes.append("PSS is not available here: memory is the sum of RSS, which counts shared pages in every "
                     "process that maps them (an overestimate)")
    result = BenchResult(
        store=str(store_path), source_root=str(source_root), source_format=info.source_format,
        num_samples=len(opened), num_tokens=int(opened.sample_lengths.sum()), hidden_size=info.hidden_size,
        num_aux_layers=info.num_aux_layers, store_bytes=store_bytes, source_bytes=source_bytes,
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


# --- command line ---------------------------------------------------------------------------------


def _cmd_bench(args: argparse.Namespace) -> int:
    from h5feed.cli import location_options

    where = location_options(args)
    spec = SyntheticSpec(num_samples=args.num_samples)
    result = run_bench(
        args.store,
        workers=args.workers,
        max_len=args.max_len if args.max_len > 0 else None,
        cold=args.cold,
        warm=args.warm,
        loaders=args.loaders,
        flavor=args.flavor,
        cache_dir=args.cache_dir,
        spec=spec,
        progress=not args.quiet,
        storage_options=where["storage_options"],
        read_cache_dir=where["cache_dir"],
        read_cache_limit=where["cache_limit"],
    )
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.table())
    return 0


def _loader_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in LOADERS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown loader(s) {bad}: choose from {', '.join(LOADERS)}")
    return names


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `h5feed bench` on the CLI's subparsers."""
    from h5feed.cli import add_location_options
    p = subparsers.add_parser(
        "bench",
        help="loader throughput against the speculators 0.4 .pt loader, on the same samples",
        description="Time speculators 0.4's .pt loader, HiddenStatesDataset and HiddenStatesStream on the same "
        "samples with the same DataLoader settings, cold and warm. With no STORE, a Kimi-shaped synthetic set "
        "(H=7168, K=3, 1500..1900 tokens) is written and converted once under --cache-dir.",
    )
    p.add_argument("store", nargs="?", help="an h5feed store (its source files are the baseline's input); "
                   "default: the embedded synthetic set")
    p.add_argument("--workers", type=int, default=4, help="DataLoader num_workers (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=2048, help="the trainer's max_len; 0 = none (default: %(default)s)")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=None,
                   help="measure with a cold page cache (needs root; default: when possible)")
    p.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                   help="measure with a warm page cache (default: on)")
    p.add_argument("--loaders", type=_loader_list, default=list(LOADERS),
                   help=f"comma-separated subset of {','.join(LOADERS)}")
    p.add_argument("--flavor", help="item flavor (default: speculators-legacy, specforge for post-norm stores)")
    p.add_argument("--num-samples", type=int, default=SyntheticSpec.num_samples,
                   help="samples of the embedded default set (default: %(default)s, ~100 MB each)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                   help="where the embedded default set is kept (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_location_options(p, cache_flag="--read-cache-dir")  # --cache-dir is where the default set is kept
    p.set_defaults(func=_cmd_bench)
    return p

