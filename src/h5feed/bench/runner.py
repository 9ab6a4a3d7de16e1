"""`h5feed bench`: the trainer's path, h5feed against speculators 0.4's `.pt` loader, on the same samples.

Every loader (h5feed.bench.loaders) delivers the batches a trainer takes: batch_size 1,
the trainer's collate (speculators 0.4 `create_collate_fn(max_len)`), in store order:
the baseline in a DataLoader with `pin_memory=True` as its trainer runs it; h5feed's
`BatchLoader` (worker processes, or reader threads), which decodes straight into
recycled batch slots; and the drop-in, a `HiddenStatesStream` in a `StreamLoader` with
the same collate and `pin_memory=True`.  The old item path (`batch_size=None`, no
collate) can run as an extra row, labelled as such, with no ratio.

Each loader is built once and iterated once per pass, as a trainer iterates its loader
once per epoch (so what it builds once, such as BatchLoader's ring of batch slots, is
built once): first an untimed checking pass, then a cold pass (page cache dropped
first; root only), then a warm pass (the cold pass left its files in the cache).  The
checking pass takes a digest of every batch (shape, dtype and crc32c of each tensor;
the item path's items are collated by the trainer's collate first) and compares it
with the baseline's, batch for batch: nothing is kept, so memory stays that of the loader.
A timed pass reads one element of each hidden tensor of every batch (the data must have
arrived) and drops it; its time runs from the creation of the loader's iterator (worker
start included) to the last batch.  CPU seconds are those of the bench's process and its
workers (`os.times`, children included once they are reaped at the end of the pass),
less the memory sampler's own.  Memory is the peak, sampled every 50 ms, of the sum over
the main process and all its children of PSS (RSS where PSS is not available): RSS would
count shared-memory pages once per process that maps them.

On a GPU, a training step (`h5feed.bench.step`: a representative EAGLE-3 drafter step at the
store's shape, or the user's own) runs on every batch of every timed pass, as a trainer's loop
runs it, and is timed alone first, its batch already on the GPU.  A loader is then judged by what
the trainer gets: its samples/s as a share of the step alone's, beside the share of the pass
spent waiting in `next()` (every batch, the first too) and the loader's cores (the CPU of the
process and its workers less the step's own).  That, not the loader's own speed, is what the
advice ranks by: a loader can wait for nothing and still slow the step (its GPU kernels beside
the step's, its threads in the trainer's interpreter).

With no STORE, the embedded default is used: a Kimi-shaped synthetic set
(speculators-legacy-pt, H=7168, K=3, 1500..1900 tokens per sample, 48 samples,
~4.7 GB) written under the cache folder, converted once with all cores, and
reused by later runs.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch

from h5feed.bench.loaders import (
    BASELINE,
    DEFAULT_LOADERS,
    GPU_DECODE,
    ITEMS,
    LOADER_LABELS,
    LOADERS,
    BuiltLoader,
    Setup,
    compare_digests,
    digest,
    hidden_tensors,
    make_loader,
)
from h5feed.bench.report import BenchResult, PassResult
from h5feed.bench.step import REPRESENTATIVE, StepOptions, StepRunner, on_device, training_step
from h5feed.bench.synthetic_set import BASELINE_FORMAT, DefaultSet, drop_page_cache, ensure_default_set
from h5feed.errors import H5feedError
from h5feed.loading.backends.cuda import gpu_decode_refusal
from h5feed.loading.options import StoreOptions
from h5feed.store import Store

if TYPE_CHECKING:  # typing.Self is 3.11+
    from typing_extensions import Self

MEMORY_INTERVAL_S = 0.05
DISTURBED_SHARE = 0.05  # other processes' share of the CPUs above which a pass is flagged
STEP_ALONE_STEPS = 20  # steps the training step is timed alone


@dataclass(frozen=True)
class Passes:
    """The passes `run_bench` times: each loader's, cold (the page cache dropped first) and warm.

    loaders: a subset of `LOADERS` (default `DEFAULT_LOADERS`); the baseline, when asked for, runs first.
    cold: None = cold passes when the page cache can be dropped; True = asked for (said so when impossible);
        False = warm only.
    warm: measure warm passes.
    """

    loaders: Sequence[str] = DEFAULT_LOADERS
    cold: bool | None = None
    warm: bool = True

    def __post_init__(self) -> None:
        unknown = [name for name in self.loaders if name not in LOADERS]
        if unknown:
            raise ValueError(f"unknown loader(s) {unknown}: choose from {', '.join(LOADERS)}")


def _pss_available() -> bool:
    try:
        return hasattr(psutil.Process().memory_full_info(), "pss")
    except (psutil.Error, OSError, AttributeError):
        return False


class MemorySampler:
    """Peak summed memory of this process and all its children, sampled by a thread; also CPU time.

    It also counts the CPU seconds (user + system) of the process tree over the block, so a pass
    can say how much CPU it cost and how much of the machine other processes took meanwhile.  The
    sampling thread's own CPU (reading every process's smaps) is left out of `cpu_seconds`.
    """

    def __init__(self, interval: float = MEMORY_INTERVAL_S) -> None:
        self.interval = interval
        self.metric = "pss" if _pss_available() else "rss"
        self.peak = 0  # of the sum over the process tree
        self.peak_child = 0  # of the largest single child process (a worker)
        self.cpu_seconds = 0.0  # of this process tree, during the last `with` block, less the sampling
        self.other_cpu_share = 0.0  # share of all CPUs used by other processes meanwhile
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampling_cpu = 0.0

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
        """CPU seconds of this process and its reaped children (`os.times`: the kernel adds a child's on
        wait), plus its live children's so far."""
        t = os.times()
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
                self._sampling_cpu = time.thread_time()
                return

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def __enter__(self) -> Self:
        self.peak = self.peak_child = 0
        self._sampling_cpu = 0.0
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
        wall = time.perf_counter() - self._wall_start
        tree = self._tree_cpu() - self._cpu_start
        other = self._busy() - self._busy_start - tree
        self.cpu_seconds = tree - self._sampling_cpu
        self.peak = max(self.peak, self.measure())
        self.other_cpu_share = max(0.0, other) / max(wall * (psutil.cpu_count() or 1), 1e-9)



def _timed_pass(built: BuiltLoader, name: str, cache: str, sampler: MemorySampler,
                step: StepRunner | None) -> PassResult:
    """One timed pass over every batch: with a training `step`, the step runs on each batch as a trainer's loop
    does, and every wait in `next()` is timed (the first batch's too); without, one element of each hidden tensor
    is read (the data must have arrived) and the batch is dropped."""
    samples = hidden_bytes = 0
    waits: list[float] = []
    steps: list[float] = []  # each training step's own time (its wait for data excluded)
    built.start_pass()
    with sampler:
        t0 = asked = time.perf_counter()
        batches = iter(built.batches)  # the first wait includes starting the loader (its workers, its threads)
        while True:
            batch = next(batches, None)  # batch_size 1: a batch (or an item) per sample
            waits.append(time.perf_counter() - asked)
            if batch is None:
                break
            tensors = hidden_tensors(batch)
            hidden_bytes += sum(t.numel() * t.element_size() for t in tensors)
            if step is not None:
                began = time.perf_counter()
                step(batch)
                steps.append(time.perf_counter() - began)
            else:
                for tensor in tensors:
                    if tensor.numel():
                        float(tensor[(-1,) * tensor.dim()])
            samples += 1
            del batch, tensors
            asked = time.perf_counter()
        seconds = time.perf_counter() - t0
        del batches  # the loader's iterator ran out: its workers are joined (reaped), so their CPU is in os.times
    workers = built.pass_stats(seconds)
    return PassResult(
        loader=name, cache=cache, samples=samples, seconds=seconds, samples_per_s=samples / seconds,
        hidden_bytes=hidden_bytes, gb_per_s=hidden_bytes / seconds / 1e9,
        bytes_read=sum(w.bytes_read for w in workers), peak_memory_bytes=sampler.peak,
        memory_metric=sampler.metric, workers=workers, cpu_seconds=sampler.cpu_seconds,
        other_cpu_share=sampler.other_cpu_share, data_wait=sum(waits) / seconds,
        next_median_ms=statistics.median(waits[:-1] or waits) * 1e3, first_batch_s=waits[0],
        gpu_decode_ms_per_sample=built.pass_gpu_decode_ms() / max(samples, 1),
        step_mean_ms=statistics.fmean(steps) * 1e3 if steps else None,
    )


def _checking_pass(built: BuiltLoader, name: str, s: Setup, keep_first: bool) -> tuple[list[dict[str, Any]], Any]:
    """An untimed first pass: the digest of every batch, in order, and with `keep_first` a copy of the first batch
    (the training step is timed alone on it).  The item path's items are first collated by the trainer's
    collate, as a trainer would."""
    collate = s.trainer_collate() if name == ITEMS else None
    digests, first = [], None
    for batch in built.batches:
        if collate is not None:
            batch = collate([batch])
        digests.append(digest(batch))
        if keep_first and first is None:
            first = on_device(batch, torch.device("cpu"), copy=True)
        del batch
    return digests, first


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "cuda": torch.cuda.is_available(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average": {"start": os.getloadavg()[0]},
    }


def run_bench(
    store: str | os.PathLike[str] | StoreOptions | None = None,
    *,
    workers: int = 4,
    max_len: int = 2048,
    flavor: str | None = None,
    hidden_states_dtype: torch.dtype = torch.bfloat16,
    passes: Passes = Passes(),
    step: StepOptions | None = StepOptions(),
    default_set: DefaultSet = DefaultSet(),
    progress: bool = True,
    verbose: bool = False,
) -> BenchResult:
    """Time the loaders on the same samples, check their batches equal, and return the figures (module docstring).

    Args:
        store: an h5feed store, or for a store in a bucket its `StoreOptions` (storage options, node cache); None
            builds (or reuses) the embedded default set (`default_set`).
        workers: DataLoader `num_workers` of every loader (reader threads for BatchLoader-threads).
        max_len: the trainer's max_len (its collate pads and cuts to it).
        flavor: the trainer's flavor (default speculators-legacy, or specforge for a post-norm store).
        passes: the loaders timed, cold and warm (`Passes`).
        step: the training step run beside every loader on a GPU (`StepOptions`: the representative drafter step
            by default); None: the loaders alone.
        default_set: the embedded default set, where it is kept and the workers converting it (`DefaultSet`).
        progress: one line per pass on stderr.
        verbose: also a line for each loader's untimed checking pass.
    """
    def say(message: str) -> None:
        if progress:
            print(f"[h5feed bench] {message}", file=sys.stderr, flush=True)

    loaders = passes.loaders
    if workers < 0:
        raise ValueError("workers must be >= 0")
    if max_len < 1:
        raise ValueError("max_len must be >= 1: the trainer's collate pads and cuts to it")
    notes: list[str] = []
    if store is None:
        store = ensure_default_set(default_set.cache_dir, default_set.spec, convert_workers=default_set.convert_workers,
                                   progress=progress, log=say)
    where = store if isinstance(store, StoreOptions) else StoreOptions(store)
    opened = where.open()
    store_path = opened.path if isinstance(where.location, Store) else where.location
    info = opened.info
    source_root = Path(info.source_root)
    if flavor is None:
        flavor = "speculators-legacy" if info.last_state_norm == "pre" else "specforge"
        if flavor != "speculators-legacy":
            notes.append(f"the store holds post-norm last states ({info.source_format}): the bench runs the "
                         "specforge flavor and SpecForge's collate")
    missing_loss_mask = "error"
    if not opened.has_loss_mask.all():
        missing_loss_mask = "ones"
        notes.append(f"{int((~opened.has_loss_mask).sum())} sample(s) had no loss mask: h5feed reads them with "
                     "missing_loss_mask='ones'")

    baseline_files: list[Path] | None = None
    source_bytes: int | None = None
    if BASELINE in loaders:
        files = [source_root / p for p in opened.source_paths]
        if info.source_format != BASELINE_FORMAT:
            notes.append(f"no baseline: the speculators 0.4 .pt loader reads {BASELINE_FORMAT} files only, and this "
                         f"store was converted from {info.source_format}; h5feed benched alone")
        elif info.lossy:
            notes.append("no baseline: this store's hidden states were quantized to FP8 (lossy), so its batches are "
                         "not the source files'; h5feed benched alone")
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
    gpu_refusal = gpu_decode_refusal(opened) if GPU_DECODE in loaders else None
    if gpu_refusal is not None:
        notes.append(f"BatchLoader(decode=\"cuda\") not measured: {gpu_refusal}")
    active = sorted((name for name in loaders if (name != BASELINE or baseline_files is not None)
                     and (name != GPU_DECODE or gpu_refusal is None)),
                    key=lambda name: name != BASELINE)  # the baseline first: its batches are the reference

    caches: list[str] = []
    if passes.cold is not False:
        problem = drop_page_cache()
        if problem is None:
            caches.append("cold")
        else:
            notes.append(f"{problem}: cold figures not measured, warm only")
            say(notes[-1])
    if passes.warm:
        caches.append("warm")
    if not caches:
        raise H5feedError("nothing to measure: cold passes are off or impossible, and warm passes are off")

    store_bytes = opened.stored_nbytes() if opened.remote else _dir_bytes(Path(store_path))
    sampler = MemorySampler()
    if sampler.metric == "rss":
        notes.append("PSS is not available here: memory is the sum of RSS, which counts shared pages in every "
                     "process that maps them (an overestimate)")
    machine = _machine()
    trainer: StepRunner | None = None
    step_device = torch.device(step.device) if step is not None and step.device is not None else (
        torch.device("cuda") if machine["cuda"] else None)
    if step is not None and step_device is None:
        notes.append("no GPU here: no training step ran, so the loaders are ranked by their own samples/s; on a GPU "
                     "box the bench runs a drafter step beside each loader and ranks them by the trainer's speed")
    elif step is not None:
        trainer = StepRunner(step.name, training_step(step.name, opened, step_device), step_device)
    # a GPU trainer's BatchLoader delivers its batches on the GPU, copied one batch ahead on a stream of its own
    setup = Setup(opened, flavor, max_len, hidden_states_dtype, workers, baseline_files, missing_loss_mask,
                  step_device if trainer is not None and step_device is not None and step_device.type == "cuda"
                  else None)
    if not machine["cuda"]:
        notes.append("no CUDA here: pin_memory=True copies nothing (the baseline and the StreamLoader skip the "
                     "pinned copy a GPU trainer pays, ~1 batch of copying each) and BatchLoader's slots are not "
                     "page-locked")
    collate = ("speculators 0.4 create_collate_fn" if flavor == "speculators-legacy"
               else f"h5feed.trainer_collate({flavor!r})")
    result = BenchResult(
        store=str(store_path), source_root=str(source_root), source_format=info.source_format,
        num_samples=len(opened), num_tokens=int(opened.sample_lengths.sum()), hidden_size=info.hidden_size,
        num_aux_layers=info.num_aux_layers, store_bytes=store_bytes, source_bytes=source_bytes,
        workers=workers, max_len=max_len, flavor=flavor, collate=f"{collate}({max_len})",
        hidden_states_dtype=str(hidden_states_dtype).removeprefix("torch."), memory_metric=sampler.metric,
        cold="cold" in caches, machine=machine, notes=notes,
    )
    say(f"{len(opened)} samples, {workers} worker(s), max_len={max_len}, load average {machine['load_average']['start']:.2f}; "
        f"passes: {', '.join(caches)} x {', '.join(active)}")

    def report(p: PassResult) -> None:
        say(f"{LOADER_LABELS[p.loader]}, {p.cache}: {p.samples} samples in {p.seconds:.2f} s, "
            f"{p.samples_per_s:.2f} samples/s, {p.cpu_per_sample:.3f} CPU s/sample, peak "
            f"{p.peak_memory_bytes / 1e9:.2f} GB {p.memory_metric.upper()}, other processes "
            f"{100 * p.other_cpu_share:.0f}% of the CPUs")

    reference: list[dict[str, Any]] | None = None
    alone_batch: Any = None  # the first batch, on the step's device, which the step is timed alone on before the
    # loaders and after (on the GPU it adds nothing to the passes' host memory)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")  # said once, in the notes
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")  # more workers than cores: asked for
        for name in active:
            built = make_loader(name, setup)
            t0 = time.perf_counter()
            digests, first = _checking_pass(built, name, setup, keep_first=trainer is not None and reference is None)
            if reference is None:
                reference, result.checks[name] = digests, "reference"
            else:
                result.checks[name] = compare_digests(digests, reference)
            del digests
            if verbose or result.checks[name] not in ("reference", "equal"):
                say(f"{LOADER_LABELS[name]}: checking pass (untimed) in {time.perf_counter() - t0:.2f} s: "
                    f"batches {result.checks[name]}")
            if first is not None and trainer is not None:
                trainer = _time_step_alone(trainer, first, result, say)
                alone_batch = on_device(first, trainer.device) if trainer is not None else None
                del first
            for cache in caches:
                if cache == "cold":
                    problem = drop_page_cache()
                    if problem is not None:
                        raise H5feedError(problem)
                # warm: the pass before (cold, or the checking pass) left every file it read in the page cache
                beside = trainer if name != ITEMS else None  # items are not a batch: no trainer steps on them
                result.passes.append(_timed_pass(built, name, cache, sampler, beside))
                report(result.passes[-1])
            del built
    if trainer is not None and result.step is not None:  # the GPU's own drift over the run, beside the shares
        result.step_after = trainer.alone(alone_batch, STEP_ALONE_STEPS)
        say(f"the training step alone again, after the loaders: {1e3 * result.step_after.seconds:.1f} ms")
    machine["load_average"]["end"] = os.getloadavg()[0]
    _judge(result, len(opened))
    return result


def _time_step_alone(trainer: StepRunner, batch: Any, result: BenchResult,
                     say: Callable[[str], None]) -> StepRunner | None:
    """The step timed alone on the first batch (on the device already), kept in `result`; None (no step beside
    the loaders) when the representative step cannot take this flavor's batches."""
    try:
        result.step = trainer.alone(batch, STEP_ALONE_STEPS)
    except ValueError as e:
        if trainer.name != REPRESENTATIVE:
            raise
        result.notes.append(f"no training step ran: {e}")
        return None
    say(f"the training step ({trainer.name}) alone, its batch on the GPU: {1e3 * result.step.seconds:.1f} ms, "
        f"{result.step.samples_per_s:.2f} samples/s")
    return trainer


def _judge(result: BenchResult, num_samples: int) -> None:
    """Ratios to the baseline and to the step alone, the loader's cores, and notes on anything that makes figures
    doubtful."""
    notes = result.notes
    for p in result.passes:
        base = result.get(BASELINE, p.cache)
        if p.loader != ITEMS and base is not None and base.samples_per_s > 0:
            p.ratio = p.samples_per_s / base.samples_per_s
        if result.step is not None and p.loader != ITEMS:
            p.step_share = p.samples_per_s / result.step.samples_per_s
            p.running_share = p.samples * result.step.seconds / max(p.seconds - p.first_batch_s, 1e-9)
            if p.step_mean_ms is not None:
                p.step_slowdown = p.step_mean_ms / (1e3 * result.step.seconds)
        step_cpu = result.step.cpu_seconds if p.step_share is not None else 0.0
        p.loader_cores = max(0.0, p.cpu_seconds - step_cpu * p.samples) / p.seconds
        if p.samples != num_samples:
            notes.append(f"{p.loader} {p.cache} delivered {p.samples} batches, not {num_samples}")
    differ = [f"{name}: {check}" for name, check in result.checks.items() if check not in ("reference", "equal")]
    if differ:
        notes.append("BATCHES DIFFER from the reference's: " + "; ".join(differ))
    disturbed = [p for p in result.passes if p.other_cpu_share > DISTURBED_SHARE]
    if disturbed:
        notes.append("other processes used more than {:.0f}% of the CPUs during: {}; those figures are low".format(
            100 * DISTURBED_SHARE, ", ".join(f"{p.loader}/{p.cache} ({100 * p.other_cpu_share:.0f}%)" for p in disturbed)))
