"""`h5feed convert`: per-sample source files to one store, in parallel, resumable, verified.

Conversion runs in three steps, each safe to kill:

1. *Plan*: probe every source file (shape only), fix the sample order and each
   sample's first row, and write the plan into the store.  Nothing is decided
   later, so a resumed run writes exactly the bytes an uninterrupted one would.
2. *Convert*: worker processes write samples; each sample owns whole shards, so
   workers never touch the same file, and each shard is written atomically
   (temporary name, fsync, rename).  The main process appends each finished
   sample to a journal (fsynced after the sample's shards are).
3. *Finalize*: write the sample index, then flip the store's status to
   "complete" (one atomic, fsynced write).  Readers refuse a store before that.

Running the same command again skips the samples in the journal.  The plan and
the journal stay in the store: a damaged index is rebuilt from them.  One writer
at a time: the converter holds the store's `WriterLock` from start to end.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import logging
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from h5feed.errors import H5feedError, SourceError, StoreError
from h5feed.formats import FORMATS, SampleShape, SourceFile, SourceFormat, detect_format, last_state_norm_of
from h5feed.lock import LOCK_FILE, WriterLock
from h5feed.store import Store, read_ahead
from h5feed.store.layout import (
    COMPANIONS_DIR,
    DEFAULT_CHUNK_TOKENS,
    MAX_DEFAULT_SHARD_TOKENS,
    OPTIONAL_ARRAYS_FORMAT_VERSION,
    LastStateNorm,
    StoreInfo,
    chunk_codec,
    chunk_encoder,
    crc32c,
    create_arrays,
    encode_shard,
    fsync_dir,
    object_key,
    read_info,
    storage_dtype,
    write_atomically,
    write_info,
)

log = logging.getLogger(__name__)

PLAN_FILE = "h5feed-plan.json"
JOURNAL_FILE = "h5feed-journal.jsonl"


@dataclass
class ConvertReport:
    """What a conversion did, for the CLI and for tests."""

    store: Path
    num_samples: int
    num_tokens: int
    converted_now: int
    resumed: int
    skipped: list[dict[str, str]] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class _PlannedSample:
    relpath: str
    sample_index: int
    num_tokens: int
    start: int


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str | None = None,
    workers: int | None = None,
    codec: str = "zstd",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    shard_tokens: int | None = None,
    skip_bad: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    durable: bool = True,
    last_state_norm: LastStateNorm | None = None,
) -> ConvertReport:
    """Convert every sample file under `src` into the store `dst` (see the module docstring).

    Args:
        workers: worker processes (default: the machine's cores); 0 converts in this process.
        last_state_norm: "pre" or "post": whether the files' last hidden state is taken before or after the
            verifier's final norm, for formats whose files may not say it (Model-Optimizer, AngelSlim's vLLM
            backend); required there, refused where it contradicts the files or the format.
        shard_tokens: rows per shard, a multiple of `chunk_tokens` (default: the longest sample,
            rounded up, at most 8192), so that a sample is one object per array.
        durable: fsync each shard before its journal line, and the index before the status flip,
            so that a power loss loses no journaled sample (`--no-fsync` turns it off).
    """
    src_path, dst_path = Path(src).resolve(), Path(dst)
    workers = os.cpu_count() or 1 if workers is None else workers
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be at least 1")
    if shard_tokens is not None and (shard_tokens < chunk_tokens or shard_tokens % chunk_tokens):
        raise ValueError(f"shard_tokens must be a multiple of chunk_tokens ({chunk_tokens}), not {shard_tokens}")
    chunk_codec(codec)  # validates the name before anything is written
    if last_state_norm not in (None, "pre", "post"):
        raise ValueError(f"last_state_norm must be 'pre' or 'post', not {last_state_norm!r}")
    format = format or (None if overwrite else _planned_format(dst_path))  # a resume reads what the plan read
    fmt = FORMATS[format] if format else detect_format(src_path, skip_bad)  # type: ignore[index]
    found = fmt.scan(src_path, skip_bad)  # with skip_bad, unreadable entries come back as skips, never in silence
    for entry in found.skipped:
        log.warning("skipping %s: %s", entry.path, entry.problem)
    sources = found.files
    options = {"format": fmt.name, "codec": codec, "chunk_tokens": chunk_tokens, "shard_tokens": shard_tokens}
    if last_state_norm is not None:  # stated by the user: a resume must state the same
        options["last_state_norm"] = last_state_norm
    if dst_path.exists() and not overwrite and not (dst_path / "zarr.json").exists():
        if any(p.name != LOCK_FILE for p in dst_path.iterdir()):
            raise StoreError(dst_path, "exists and is not an h5feed store; choose another DST or pass --overwrite")
    created = not dst_path.exists()
    try:
        with WriterLock.acquire(dst_path) as lock:
            return _convert(src_path, dst_path, fmt, sources, [e.record() for e in found.skipped], options, workers,
                            skip_bad, overwrite, progress, durable, lock)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StoreError(dst, "disk full: free space and run the same command to resume") from exc
        raise
    finally:
        if created:  # a run that failed before writing anything leaves no folder behind
            with contextlib.suppress(OSError):
                dst_path.rmdir()


def _convert(
    src_path: Path,
    dst_path: Path,
    fmt: SourceFormat,
    sources: list[SourceFile],
    unreadable: list[dict[str, str]],
    options: dict[str, Any],
    workers: int,
    skip_bad: bool,
    overwrite: bool,
    progress: bool,
    durable: bool,
    lock: WriterLock,
) -> ConvertReport:
    started = time.perf_counter()
    if overwrite:
        _clear(dst_path)
    if (dst_path / "zarr.json").exists():
        info = read_info(dst_path)
        if info.status == "complete":
            _check_complete_matches(dst_path, info, options)
            return _check_or_rebuild_index(dst_path, info, durable)
        if not (dst_path / PLAN_FILE).exists():  # killed while planning: nothing was converted yet
            _clear(dst_path)

    with _executor(workers) as pool:
        lock.record_semaphores()  # the pool's, for the next writer to clean up after a SIGKILL
        if (dst_path / PLAN_FILE).exists():
            plan = _read_plan(dst_path, sources, options, skip_bad)
            _remove_partial_writes(dst_path)
        else:
            plan = _make_plan(pool, fmt, sources, unreadable, options, src_path, dst_path, skip_bad, progress, durable)
        samples = [_PlannedSample(**s) for s in plan["samples"]]
        done = _read_journal(dst_path)
        pending = [i for i in range(len(samples)) if i not in done]
        report = ConvertReport(dst_path, 0, 0, 0, sum("checksum" in r for r in done.values()))
        if pending:
            # from the plan, not the listing: a file gone since planning fails to load (and --skip-bad skips it)
            by_relpath = {s.relpath: SourceFile(src_path / s.relpath, s.sample_index, s.relpath) for s in samples}
            _convert_pending(pool, fmt, dst_path, plan, samples, pending, by_relpath, workers, skip_bad, progress,
                             durable, report)
            done = _read_journal(dst_path)
    skipped: list[dict[str, str]] = list(plan["skipped"])
    skipped += [{"path": samples[i].relpath, "problem": r["skipped"]} for i, r in sorted(done.items()) if "skipped" in r]
    if not any("checksum" in r for r in done.values()):
        raise SourceError(src_path, f"no sample could be converted: all {len(skipped)} were skipped "
                          f"(first: {'; '.join(s['path'] + ': ' + s['problem'] for s in skipped[:3])})")
    _finalize(dst_path, samples, done, skipped, durable)
    info = read_info(dst_path)
    report.num_samples, report.num_tokens, report.skipped = info.num_samples, info.num_tokens, skipped
    report.seconds = time.perf_counter() - started
    return report


def _planned_format(dst: Path) -> str | None:
    try:
        return json.loads((dst / PLAN_FILE).read_text())["options"]["format"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _clear(dst: Path) -> None:
    """Remove everything in the store but the writer's lock."""
    for path in dst.iterdir():
        if path.name != LOCK_FILE:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _check_or_rebuild_index(dst: Path, info: StoreInfo, durable: bool) -> ConvertReport:
    """A complete store: nothing to do if its index is sound; a damaged one is rebuilt from the plan and
    journal the conversion left in the store, or reported with what to run."""
    try:
        Store(dst)
        log.info("%s is already complete: nothing to do", dst)
    except StoreError as exc:
        if not ((dst / PLAN_FILE).exists() and (dst / JOURNAL_FILE).exists()):
            raise StoreError(dst, f"is complete but damaged ({exc.problem}), and has no plan and journal to rebuild "
                             "its index from: pass --overwrite to convert again") from exc
        log.warning("%s: rebuilding the damaged sample index from the plan and journal (%s)", dst, exc.problem)
        plan = json.loads((dst / PLAN_FILE).read_text())
        samples = [_PlannedSample(**s) for s in plan["samples"]]
        _finalize(dst, samples, _read_journal(dst), info.skipped, durable)
        Store(dst)  # the rebuilt index must open
        info = read_info(dst)
    return ConvertReport(dst, info.num_samples, info.num_tokens, 0, info.num_samples, info.skipped)


# --- plan -------------------------------------------------------------------------------


def _make_plan(
    pool: Executor,
    fmt: SourceFormat,
    sources: list[SourceFile],
    unreadable: list[dict[str, str]],
    options: dict[str, Any],
    src_root: Path,
    dst: Path,
    skip_bad: bool,
    progress: bool,
    durable: bool,
) -> dict[str, Any]:
    """Probe every file, check they agree on H, K and dtype, and lay the samples out."""
    shapes: list[tuple[SourceFile, SampleShape]] = []
    skipped: list[dict[str, str]] = list(unreadable)
    reference: SampleShape | None = None
    results = pool.map(_probe_one, [fmt.name] * len(sources), sources, chunksize=16)
    for source, result in tqdm(zip(sources, results), total=len(sources), desc="probing", disable=not progress):
        try:
            if isinstance(result, SourceError):
                raise result
            reference = reference or result
            _check_same_shape(source, result, reference)
            _check_same_layout(source, result, reference)
            shapes.append((source, result))
        except SourceError as exc:
            if not skip_bad:
                raise
            log.warning("skipping %s", exc)
            skipped.append({"path": source.relpath, "problem": exc.problem})
    if reference is None:
        raise SourceError(src_root, "no readable sample files (all were skipped)")

    chunk_tokens = options["chunk_tokens"]
    shard_tokens = options["shard_tokens"] or _default_shard_tokens([shape for _, shape in shapes], chunk_tokens)
    planned, row = [], 0
    for source, shape in shapes:
        planned.append(_PlannedSample(source.relpath, source.sample_index, shape.num_tokens, row).__dict__)
        row += math.ceil(shape.num_tokens / shard_tokens) * shard_tokens
    info = StoreInfo(
        source_format=fmt.name,
        hidden_size=reference.hidden_size,
        num_aux_layers=reference.num_aux_layers,
        dtype=str(reference.dtype).removeprefix("torch."),
        last_state_norm=last_state_norm_of(fmt, src_root, shapes, options.get("last_state_norm")),  # type: ignore[arg-type]
        codec=chunk_codec(options["codec"]),
        chunk_tokens=chunk_tokens,
        shard_tokens=shard_tokens,
        source_root=str(src_root),
        has_last_state=fmt.has_last_state,
        ids_shifted=fmt.ids_shifted,
        extra_arrays={extra.name: extra.record() for extra in reference.extras},
        source_info={**fmt.source_info(src_root), **({"layout": reference.layout} if reference.layout else {})},
    )
    info = dataclasses.replace(info, companions=_keep_companions(fmt, src_root, dst, durable))
    if info.needs_format_3:
        info = dataclasses.replace(info, format_version=OPTIONAL_ARRAYS_FORMAT_VERSION)
    create_arrays(dst, info, total_rows=row)
    if durable:
        _fsync_tree(dst)
    plan = {"options": options, "samples": planned, "skipped": skipped, "total_rows": row}
    write_atomically(dst / PLAN_FILE, json.dumps(plan).encode(), durable=durable)
    return plan


def _keep_companions(fmt: SourceFormat, src_root: Path, dst: Path, durable: bool) -> dict[str, dict[str, Any]]:
    """Copy the small files the trainer needs beside the samples into `companions/`, byte for byte, and record
    each one's size and crc32c (a large one, like NeMo's target embeddings, is recorded only)."""
    kept: dict[str, dict[str, Any]] = {}
    for companion in fmt.companions(src_root):
        data = b""
        try:
            if companion.copy:
                data = companion.path.read_bytes()
                crc, size = crc32c(data), len(data)
            else:
                crc, size = _file_crc32c(companion.path)
        except OSError as exc:
            raise SourceError(companion.path, f"cannot be read ({exc.strerror or exc})") from exc
        kept[companion.relpath] = {"source": companion.relpath, "bytes": size, "crc32c": crc}
        if companion.copy:
            (dst / COMPANIONS_DIR).mkdir(exist_ok=True)
            write_atomically(dst / COMPANIONS_DIR / companion.relpath, data, durable=durable)
            kept[companion.relpath]["copy"] = f"{COMPANIONS_DIR}/{companion.relpath}"
    return kept


def _file_crc32c(path: Path) -> tuple[int, int]:
    """(crc32c, size) of a file, read 16 MiB at a time."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            crc, size = crc32c(block, crc), size + len(block)
    return crc, size


def _default_shard_tokens(shapes: list[SampleShape], chunk_tokens: int) -> int:
    """The longest sample rounded up to whole chunks (one object per sample and array), within bounds."""
    longest = max(s.num_tokens for s in shapes)
    cap = max(chunk_tokens, MAX_DEFAULT_SHARD_TOKENS // chunk_tokens * chunk_tokens)
    return min(math.ceil(longest / chunk_tokens) * chunk_tokens, cap)


def _check_same_shape(source: SourceFile, shape: SampleShape, reference: SampleShape) -> None:
    for what, got, want in (
        ("hidden size", shape.hidden_size, reference.hidden_size),
        ("number of aux layers", shape.num_aux_layers, reference.num_aux_layers),
        ("dtype", shape.dtype, reference.dtype),
    ):
        if got != want:
            raise SourceError(source.path, f"{what} {got} differs from {want} of the first sample")


def _check_same_layout(source: SourceFile, shape: SampleShape, reference: SampleShape) -> None:
    """One store holds one set of optional arrays and one item layout: every sample must agree with the first."""
    if shape.extras != reference.extras:
        def names(s: SampleShape) -> str:
            return ", ".join(f"{e.name} ({e.dtype}, width {e.width})" for e in s.extras) or "none"
        raise SourceError(source.path, f"holds the optional arrays {names(shape)}, but the first sample holds "
                          f"{names(reference)}: convert each set into its own store")
    if shape.layout != reference.layout:
        raise SourceError(source.path, f"is laid out as {shape.layout}, the first sample as {reference.layout}: "
                          "convert each set into its own store")


def _probe_one(format_name: str, source: SourceFile) -> SampleShape | SourceError:
    try:
        return FORMATS[format_name].probe(source)  # type: ignore[index]
    except SourceError as exc:
        return exc


def _check_complete_matches(dst: Path, info: StoreInfo, options: dict[str, Any]) -> None:
    """A rerun on a complete store asking for another codec, chunk size or format must not pass as done."""
    have = {"format": info.source_format, "codec": info.codec, "chunk_tokens": info.chunk_tokens,
            "shard_tokens": info.shard_tokens}
    if "last_state_norm" in options:
        have["last_state_norm"] = info.last_state_norm
    asked = {**options, "codec": chunk_codec(options["codec"]), "shard_tokens": options["shard_tokens"] or info.shard_tokens}
    if have != asked:
        raise StoreError(
            dst, f"is complete but was converted with {have}, not {options}: choose another DST or pass --overwrite"
        )


def _read_plan(dst: Path, sources: list[SourceFile], options: dict[str, Any], skip_bad: bool) -> dict[str, Any]:
    """The plan of an unfinished conversion, if this command is the same one that started it."""
    try:
        plan = json.loads((dst / PLAN_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        raise StoreError(dst, f"unfinished store without a readable plan ({exc}); pass --overwrite to start again") from exc
    if plan["options"] != options:
        raise StoreError(
            dst, f"was started with {plan['options']}, not {options}: repeat that command to resume, or pass --overwrite"
        )
    planned = {s["relpath"] for s in plan["samples"]} | {s["path"] for s in plan["skipped"]}
    missing = planned - {s.relpath for s in sources}
    if missing and not skip_bad:
        raise StoreError(
            dst, f"source files of the unfinished conversion are gone: {sorted(missing)[:5]}; pass --skip-bad to skip them"
        )
    return plan


# --- convert ------------------------------------------------------------------------------


def _convert_pending(
    pool: Executor,
    fmt: SourceFormat,
    dst: Path,
    plan: dict[str, Any],
    samples: list[_PlannedSample],
    pending: list[int],
    by_relpath: dict[str, SourceFile],
    workers: int,
    skip_bad: bool,
    progress: bool,
    durable: bool,
    report: ConvertReport,
) -> None:
    """Convert the samples not yet in the journal, a bounded number in flight."""
    info = read_info(dst)
    bar = tqdm(total=len(samples), initial=len(samples) - len(pending), desc="converting", unit="sample",
               disable=not progress, smoothing=0.1)
    failure: BaseException | None = None
    todo = iter(pending)
    in_flight: dict[Future[dict[str, Any]], int] = {}
    with open(dst / JOURNAL_FILE, "a") as journal:
        if journal.tell() and not (dst / JOURNAL_FILE).read_text().endswith("\n"):
            journal.write("\n")  # end a line cut short by a kill, or the next record would be lost with it

        def submit_next() -> None:
            for i in todo:
                s = samples[i]
                expected = SampleShape(s.num_tokens, info.hidden_size, info.num_aux_layers, info.torch_dtype)
                read_ahead(by_relpath[s.relpath].path)  # the disk reads queued files while workers encode
                in_flight[pool.submit(_convert_one, fmt.name, str(dst), by_relpath[s.relpath], s.start, expected,
                                      info, durable)] = i
                return

        for _ in range(2 * max(1, workers)):
            submit_next()
        while in_flight:
            finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in finished:
                i = in_flight.pop(future)
                try:
                    record = future.result()
                except SourceError as exc:
                    if not skip_bad:
                        failure = failure or exc
                        continue
                    log.warning("skipping %s", exc)
                    record = {"skipped": exc.problem}
                except OSError as exc:
                    failure = failure or _disk_error(dst, samples[i], exc)
                    continue
                except Exception as exc:  # a crashed worker: BrokenProcessPool and the like
                    failure = failure or H5feedError(f"converting {samples[i].relpath} failed: {exc!r}")
                    continue
                journal.write(json.dumps({"i": i, **record}) + "\n")
                journal.flush()
                if durable:  # after the worker's fsync of the shards: a journaled sample survives power loss
                    os.fsync(journal.fileno())
                report.converted_now += "checksum" in record  # a skipped file is counted in skipped only
                report.bytes_in += record.get("bytes_in", 0)
                report.bytes_out += record.get("bytes_out", 0)
                bar.update(1)
                elapsed = max(bar.format_dict["elapsed"], 1e-9)
                bar.set_postfix_str(f"in {report.bytes_in / elapsed / 1e6:.0f} MB/s, out {report.bytes_out / elapsed / 1e6:.0f} MB/s")
                if failure is None:
                    submit_next()
    bar.close()
    if failure is not None:
        raise failure


def _disk_error(dst: Path, sample: _PlannedSample, exc: OSError) -> H5feedError:
    if exc.errno == errno.ENOSPC:
        return StoreError(dst, f"disk full while writing {sample.relpath}: free space and run the same command to resume")
    return StoreError(dst, f"writing {sample.relpath} failed: {exc}")


def _executor(workers: int) -> Executor:
    """Spawned worker processes (safe whatever threads torch or zarr started here); 0 runs in this process."""
    if workers == 0:
        return _InlineExecutor()
    return ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), initializer=_init_worker,
                               initargs=(os.getpid(),))


class _InlineExecutor(Executor):
    """Runs each task at submit time: `workers=0`, for debugging and small jobs."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


def _init_worker(parent: int) -> None:
    """One core's worth of work per process (the processes are the parallelism), and no orphans:
    a worker dies with the converter, even when that is SIGKILLed."""
    from numcodecs import blosc

    torch.set_num_threads(1)
    blosc.set_nthreads(1)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (AttributeError, OSError):
        pass
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()  # other systems, and races


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _convert_one(
    format_name: str,
    dst: str,
    source: SourceFile,
    start: int,
    expected: SampleShape,
    info: StoreInfo,
    durable: bool,
) -> dict[str, Any]:
    """Load one source file, check it against the plan (it may have changed since), write its shards; in a worker."""
    fmt = FORMATS[format_name]  # type: ignore[index]
    sample = fmt.load(source)
    num_tokens = expected.num_tokens
    if sample.shape.num_tokens != num_tokens:
        raise SourceError(source.path, f"has {sample.shape.num_tokens} tokens now, {num_tokens} when conversion started")
    _check_same_shape(source, sample.shape, expected)
    if {e.name: e.record() for e in sample.shape.extras} != info.extra_arrays:
        raise SourceError(source.path, f"holds the optional arrays {[e.name for e in sample.shape.extras]} now, "
                          f"{list(info.extra_arrays)} when conversion started")
    loss_mask = sample.stored_loss_mask()
    bits = storage_dtype(sample.aux_parts[0].dtype)
    c = info.chunk_tokens
    rows = range(0, num_tokens, c)

    def chunks(tensor: torch.Tensor, name: str) -> Iterable[torch.Tensor]:  # one chunk's rows at a time
        return (tensor[r : r + c].view(info.storage_dtype(name)) for r in rows)

    blocks: dict[str, Iterable[torch.Tensor]] = {  # no copy of a whole sample
        "aux_hidden_states": (sample.aux_rows(r, r + c).view(bits) for r in rows),
        "input_ids": chunks(sample.input_ids, "input_ids"),
        "loss_mask": chunks(loss_mask, "loss_mask"),
        **{name: chunks(extra, name) for name, extra in sample.extras.items()},
    }
    if sample.last_hidden_state is not None:
        blocks["last_hidden_states"] = chunks(sample.last_hidden_state, "last_hidden_states")
    written = {name: _write_shards(Path(dst), info, name, blocks[name], start, durable) for name in info.array_names}
    return {
        "checksum": [crc for _, crc in written.values()],
        "has_loss_mask": sample.loss_mask is not None,
        "bytes_in": fmt.source_nbytes(source),
        "bytes_out": sum(nbytes for nbytes, _ in written.values()),
    }


def _write_shards(
    dst: Path, info: StoreInfo, name: str, blocks: Iterable[torch.Tensor], start: int, durable: bool
) -> tuple[int, int]:
    """Encode and write one sample's shards of array `name`, each atomically.

    `blocks` are the sample's rows, one chunk's worth each (the last may be short:
    zeros follow the sample).  The inner chunks are the bytes zarr's own pipeline
    writes (tests compare them), without its per-chunk copies and fill buffers,
    which cost as much as the encoding itself.  Returns the bytes written and the
    crc32c of the sample's rows.
    """
    written, crc = 0, 0
    encode: Callable[[np.ndarray], bytes] | None = None
    per_shard = info.chunks_per_shard
    shard: list[bytes | None] = []
    first_shard = start // info.shard_tokens

    def flush() -> None:
        nonlocal written
        data = encode_shard(shard + [None] * (per_shard - len(shard)))
        path = dst / object_key(info, name, first_shard + (j // per_shard))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, data, durable=durable)
        written += len(data)
        shard.clear()

    j = -1
    for j, block in enumerate(blocks):
        array = block.contiguous().numpy()
        crc = crc32c(array, crc)
        if len(array) < info.chunk_tokens:
            array = np.concatenate((array, np.zeros((info.chunk_tokens - len(array), *array.shape[1:]), array.dtype)))
        encode = encode or chunk_encoder(info.codec, array.itemsize)
        shard.append(encode(array))
        if len(shard) == per_shard:
            flush()
    if shard:
        flush()
    return written, crc


# --- journal and finalize ----------------------------------------------------------------


def _read_journal(dst: Path) -> dict[int, dict[str, Any]]:
    """Finished samples by plan position; a line cut short by a kill is ignored (its sample is redone)."""
    done: dict[int, dict[str, Any]] = {}
    try:
        lines = (dst / JOURNAL_FILE).read_text().splitlines()
    except FileNotFoundError:
        return done
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        done[record.pop("i")] = record
    return done


def _finalize(
    dst: Path, samples: list[_PlannedSample], done: dict[int, dict[str, Any]], skipped: list[dict[str, str]],
    durable: bool,
) -> None:
    """Write the index (checksummed by zarr's crc32c codec) and the journal in plan order, then flip the status."""
    import zarr
    from zarr.codecs import Crc32cCodec

    kept = [i for i in range(len(samples)) if "checksum" in done.get(i, {})]
    info = read_info(dst)
    group = zarr.open_group(dst, mode="r+")
    index = group.require_group("index")
    n = len(kept)
    columns: dict[str, np.ndarray] = {
        "sample_start": np.array([samples[i].start for i in kept], dtype=np.int64),
        "sample_length": np.array([samples[i].num_tokens for i in kept], dtype=np.int64),
        "source_index": np.array([samples[i].sample_index for i in kept], dtype=np.int64),
        "checksum": np.array([done[i]["checksum"] for i in kept], dtype=np.uint32).reshape(n, len(info.array_names)),
        "has_loss_mask": np.array([done[i]["has_loss_mask"] for i in kept], dtype=bool),
        "source_path": np.array([samples[i].relpath for i in kept], dtype=str),
    }
    for name, values in columns.items():
        array = index.create_array(name, shape=values.shape, chunks=(max(n, 1), *values.shape[1:]),
                                   dtype=values.dtype if name != "source_path" else str,
                                   compressors=[Crc32cCodec()], overwrite=True)
        if n:
            array[...] = values
    journal = "".join(json.dumps({"i": i, **done[i]}) + "\n" for i in sorted(done))
    write_atomically(dst / JOURNAL_FILE, journal.encode(), durable=durable)  # the same bytes however the run went
    if durable:
        _fsync_tree(dst / "index")
    complete = {**info.to_json(), "status": "complete", "num_samples": n,
                "num_tokens": int(columns["sample_length"].sum()), "skipped": skipped}
    write_info(dst, StoreInfo.from_json(complete), durable=durable)


def _fsync_tree(top: Path) -> None:
    """Flush every file and folder under `top` (metadata and index: small) to the disk."""
    for dirpath, _, filenames in os.walk(top):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _remove_partial_writes(dst: Path) -> None:
    """Shards (and zarr's own files) are written as NAME.<id>.partial and renamed: a kill can leave one behind."""
    for path in dst.rglob("*.partial"):
        path.unlink()
