"""`h5feed convert`: per-sample source files to one store, in parallel, resumable, verified.

Conversion runs in three steps, each safe to kill:

1. *Plan*: probe every source file (shape only), fix the sample order and each
   sample's first row, and write the plan into the store.  Nothing is decided
   later, so a resumed run writes exactly the bytes an uninterrupted one would.
2. *Convert*: worker processes write samples; each sample owns whole chunks, so
   workers never touch the same file, and zarr writes each chunk atomically.
   The main process appends each finished sample to a journal.
3. *Finalize*: write the sample index and checksums, then flip the store's
   status to "complete" (one atomic write).  Readers refuse a store before that.

Running the same command again skips the samples in the journal.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
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
from h5feed.formats import FORMATS, SampleShape, SourceFile, SourceFormat, detect_format
from h5feed.store import (
    ATTRS_KEY,
    StoreInfo,
    chunk_codec,
    chunk_encoder,
    chunk_key,
    crc32c,
    read_ahead,
    read_info,
    storage_dtype,
)

log = logging.getLogger(__name__)

PLAN_FILE = "h5feed-plan.json"
JOURNAL_FILE = "h5feed-journal.jsonl"
DEFAULT_CHUNK_TOKENS = 256


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
    workers: int = 1,
    codec: str = "zstd",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    skip_bad: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> ConvertReport:
    """Convert every sample file under `src` into the store `dst` (see the module docstring)."""
    try:
        return _convert(src, dst, format, workers, codec, chunk_tokens, skip_bad, overwrite, progress)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StoreError(dst, "disk full: free space and run the same command to resume") from exc
        raise


def _convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    format: str | None,
    workers: int,
    codec: str,
    chunk_tokens: int,
    skip_bad: bool,
    overwrite: bool,
    progress: bool,
) -> ConvertReport:
    src_path, dst_path = Path(src).resolve(), Path(dst)
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be at least 1")
    chunk_codec(codec)  # validates the name before anything is written
    fmt = FORMATS[format] if format else detect_format(src_path)  # type: ignore[index]
    sources = fmt.discover(src_path)
    options = {"format": fmt.name, "codec": codec, "chunk_tokens": chunk_tokens}
    started = time.perf_counter()

    if overwrite and dst_path.exists():
        shutil.rmtree(dst_path)
    if (dst_path / "zarr.json").exists():
        info = read_info(dst_path)
        if info.status == "complete":
            _check_complete_matches(dst_path, info, options)
            _remove_work_files(dst_path)
            log.info("%s is already complete: nothing to do", dst_path)
            return ConvertReport(dst_path, info.num_samples, info.num_tokens, 0, info.num_samples, info.skipped)
        if not (dst_path / PLAN_FILE).exists():  # killed while planning: nothing was converted yet
            shutil.rmtree(dst_path)
    elif dst_path.exists() and any(dst_path.iterdir()):
        raise StoreError(dst_path, "exists and is not an h5feed store; choose another DST or pass --overwrite")

    with _executor(workers) as pool:
        if (dst_path / PLAN_FILE).exists():
            plan = _read_plan(dst_path, sources, options, skip_bad)
            _remove_partial_writes(dst_path)
        else:
            plan = _make_plan(pool, fmt, sources, options, src_path, dst_path, skip_bad, progress)
        samples = [_PlannedSample(**s) for s in plan["samples"]]
        done = _read_journal(dst_path)
        pending = [i for i in range(len(samples)) if i not in done]
        report = ConvertReport(dst_path, 0, 0, 0, sum("checksum" in r for r in done.values()))
        if pending:
            # from the plan, not the listing: a file gone since planning fails to load (and --skip-bad skips it)
            by_relpath = {s.relpath: SourceFile(src_path / s.relpath, s.sample_index, s.relpath) for s in samples}
            _convert_pending(pool, fmt, dst_path, plan, samples, pending, by_relpath, workers, skip_bad, progress, report)
            done = _read_journal(dst_path)
    skipped: list[dict[str, str]] = list(plan["skipped"])
    skipped += [{"path": samples[i].relpath, "problem": r["skipped"]} for i, r in sorted(done.items()) if "skipped" in r]
    _finalize(dst_path, samples, done, skipped)
    info = read_info(dst_path)
    report.num_samples, report.num_tokens, report.skipped = info.num_samples, info.num_tokens, skipped
    report.seconds = time.perf_counter() - started
    return report


# --- plan -------------------------------------------------------------------------------


def _make_plan(
    pool: Executor,
    fmt: SourceFormat,
    sources: list[SourceFile],
    options: dict[str, Any],
    src_root: Path,
    dst: Path,
    skip_bad: bool,
    progress: bool,
) -> dict[str, Any]:
    """Probe every file, check they agree on H, K and dtype, and lay the samples out."""
    shapes: list[tuple[SourceFile, SampleShape]] = []
    skipped: list[dict[str, str]] = []
    reference: SampleShape | None = None
    results = pool.map(_probe_one, [fmt.name] * len(sources), sources, chunksize=16)
    for source, result in tqdm(zip(sources, results), total=len(sources), desc="probing", disable=not progress):
        try:
            if isinstance(result, SourceError):
                raise result
            reference = reference or result
            _check_same_shape(source, result, reference)
            shapes.append((source, result))
        except SourceError as exc:
            if not skip_bad:
                raise
            log.warning("skipping %s", exc)
            skipped.append({"path": source.relpath, "problem": exc.problem})
    if reference is None:
        raise SourceError(src_root, "no readable sample files (all were skipped)")

    chunk_tokens = options["chunk_tokens"]
    planned, row = [], 0
    for source, shape in shapes:
        planned.append(_PlannedSample(source.relpath, source.sample_index, shape.num_tokens, row).__dict__)
        row += math.ceil(shape.num_tokens / chunk_tokens) * chunk_tokens
    info = StoreInfo(
        source_format=fmt.name,
        hidden_size=reference.hidden_size,
        num_aux_layers=reference.num_aux_layers,
        dtype=str(reference.dtype).removeprefix("torch."),
        last_state_norm=fmt.last_state_norm,
        codec=chunk_codec(options["codec"]),
        chunk_tokens=chunk_tokens,
        source_root=str(src_root),
    )
    _create_arrays(dst, info, total_rows=row)
    plan = {"options": options, "samples": planned, "skipped": skipped, "total_rows": row}
    _write_atomically(dst / PLAN_FILE, json.dumps(plan))
    return plan


def _check_same_shape(source: SourceFile, shape: SampleShape, reference: SampleShape) -> None:
    for what, got, want in (
        ("hidden size", shape.hidden_size, reference.hidden_size),
        ("number of aux layers", shape.num_aux_layers, reference.num_aux_layers),
        ("dtype", shape.dtype, reference.dtype),
    ):
        if got != want:
            raise SourceError(source.path, f"{what} {got} differs from {want} of the first sample")


def _probe_one(format_name: str, source: SourceFile) -> SampleShape | SourceError:
    try:
        return FORMATS[format_name].probe(source)  # type: ignore[index]
    except SourceError as exc:
        return exc


def _check_complete_matches(dst: Path, info: StoreInfo, options: dict[str, Any]) -> None:
    """A rerun on a complete store asking for another codec, chunk size or format must not pass as done."""
    have = {"format": info.source_format, "codec": info.codec, "chunk_tokens": info.chunk_tokens}
    if have != {**options, "codec": chunk_codec(options["codec"])}:
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


def _create_arrays(dst: Path, info: StoreInfo, total_rows: int) -> None:
    import zarr

    group = zarr.open_group(dst, mode="w", attributes={ATTRS_KEY: info.to_json()})
    chunk_tokens, h, k = info.chunk_tokens, info.hidden_size, info.num_aux_layers
    bits = storage_dtype(info.torch_dtype)
    config = dict(info.codec)
    blosc = config.pop("name") == "blosc"
    rows = max(total_rows, 1)
    for array, width, dtype in (
        ("aux_hidden_states", k * h, bits),
        ("last_hidden_states", h, bits),
        ("input_ids", None, torch.int64),
        ("loss_mask", None, torch.int64),
    ):
        shape = (rows, width) if width else (rows,)
        chunks = (chunk_tokens, width) if width else (chunk_tokens,)
        compressors = [zarr.codecs.BloscCodec(typesize=dtype.itemsize, **config)] if blosc else None
        group.create_array(array, shape=shape, chunks=chunks, dtype=str(dtype).removeprefix("torch."),
                           compressors=compressors, fill_value=0)


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
    report: ConvertReport,
) -> None:
    """Convert the samples not yet in the journal, a bounded number in flight."""
    chunk_tokens = plan["options"]["chunk_tokens"]
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
                                      chunk_tokens, info.codec)] = i
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
    return ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), initializer=_init_worker)


class _InlineExecutor(Executor):
    """Runs each task at submit time: `workers=0`, for debugging and small jobs."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


def _init_worker() -> None:
    """One core's worth of work per process: the processes are the parallelism."""
    from numcodecs import blosc

    torch.set_num_threads(1)
    blosc.set_nthreads(1)


def _convert_one(
    format_name: str,
    dst: str,
    source: SourceFile,
    start: int,
    expected: SampleShape,
    chunk_tokens: int,
    codec: dict[str, Any],
) -> dict[str, Any]:
    """Load one source file, check it against the plan (it may have changed since), write its chunks; in a worker."""
    sample = FORMATS[format_name].load(source)  # type: ignore[index]
    num_tokens = expected.num_tokens
    if sample.shape.num_tokens != num_tokens:
        raise SourceError(source.path, f"has {sample.shape.num_tokens} tokens now, {num_tokens} when conversion started")
    _check_same_shape(source, sample.shape, expected)
    loss_mask = sample.stored_loss_mask()
    bits = storage_dtype(sample.last_hidden_state.dtype)
    rows = range(0, num_tokens, chunk_tokens)
    blocks: dict[str, Iterable[torch.Tensor]] = {  # one chunk's rows at a time: no copy of a whole sample
        "aux_hidden_states": (sample.aux_rows(r, r + chunk_tokens).view(bits) for r in rows),
        "last_hidden_states": (sample.last_hidden_state[r : r + chunk_tokens].view(bits) for r in rows),
        "input_ids": (sample.input_ids[r : r + chunk_tokens] for r in rows),
        "loss_mask": (loss_mask[r : r + chunk_tokens] for r in rows),
    }
    written = {name: _write_chunks(Path(dst), name, chunks, start // chunk_tokens, chunk_tokens, codec)
               for name, chunks in blocks.items()}
    return {
        "checksum": [crc for _, crc in written.values()],
        "has_loss_mask": sample.loss_mask is not None,
        "bytes_in": source.path.stat().st_size,
        "bytes_out": sum(nbytes for nbytes, _ in written.values()),
    }


def _write_chunks(
    dst: Path, name: str, blocks: Iterable[torch.Tensor], first_chunk: int, chunk_tokens: int, codec: dict[str, Any]
) -> tuple[int, int]:
    """Encode and write one sample's chunks of array `name`, each atomically.

    `blocks` are the sample's rows, one chunk's worth each (the last may be short:
    zeros follow the sample).  The bytes are those zarr's own pipeline writes (tests
    compare them), without its per-chunk copies and fill buffers, which cost as much
    as the encoding itself.  Returns the bytes written and the crc32c of the rows.
    """
    written, crc = 0, 0
    encode: Callable[[np.ndarray], bytes] | None = None
    for j, block in enumerate(blocks):
        array = block.contiguous().numpy()
        crc = crc32c(array, crc)
        if len(array) < chunk_tokens:
            array = np.concatenate((array, np.zeros((chunk_tokens - len(array), *array.shape[1:]), array.dtype)))
        encode = encode or chunk_encoder(codec, array.itemsize)
        data = encode(array)
        path = dst / chunk_key(name, first_chunk + j)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, path)
        written += len(data)
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


def _finalize(dst: Path, samples: list[_PlannedSample], done: dict[int, dict[str, Any]], skipped: list[dict[str, str]]) -> None:
    import zarr

    kept = [i for i in range(len(samples)) if "checksum" in done.get(i, {})]
    group = zarr.open_group(dst, mode="r+")
    index = group.require_group("index")
    n = len(kept)
    columns: dict[str, np.ndarray] = {
        "sample_start": np.array([samples[i].start for i in kept], dtype=np.int64),
        "sample_length": np.array([samples[i].num_tokens for i in kept], dtype=np.int64),
        "source_index": np.array([samples[i].sample_index for i in kept], dtype=np.int64),
        "checksum": np.array([done[i]["checksum"] for i in kept], dtype=np.uint32).reshape(n, 4),
        "has_loss_mask": np.array([done[i]["has_loss_mask"] for i in kept], dtype=bool),
        "source_path": np.array([samples[i].relpath for i in kept], dtype=str),
    }
    for name, values in columns.items():
        array = index.create_array(name, shape=values.shape, chunks=values.shape if n else None,
                                   dtype=values.dtype if name != "source_path" else str, overwrite=True)
        if n:
            array[...] = values
    attrs = dict(group.attrs[ATTRS_KEY])
    attrs.update(status="complete", num_samples=n, num_tokens=int(columns["sample_length"].sum()), skipped=skipped)
    group.attrs[ATTRS_KEY] = attrs
    _remove_work_files(dst)


def _remove_partial_writes(dst: Path) -> None:
    """Chunks (and zarr's own files) are written as NAME.<id>.partial and renamed: a kill can leave one behind."""
    for path in dst.rglob("*.partial"):
        path.unlink()


def _remove_work_files(dst: Path) -> None:
    for name in (PLAN_FILE, JOURNAL_FILE):
        (dst / name).unlink(missing_ok=True)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
