"""The plan step of `h5feed convert`: probe every source file, check they agree, lay the samples out.

Probing reads each file's shape only (in the task pool), so a plan is cheap next to the conversion.
Every sample starts on a shard boundary, so that workers never write the same object; the store's
arrays are created here, at the plan's length, and the companion files the trainer needs are kept.
A resumed run reads the plan back instead (`read_plan`), refusing a command other than the one that
started it.  What the plan holds is `h5feed.conversion.plan`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path

from tqdm.auto import tqdm

from h5feed.conversion.bucket_sources import SourceFetcher
from h5feed.conversion.job import Job, Listing
from h5feed.conversion.plan import Plan, PlannedSample
from h5feed.conversion.pool import TaskPool
from h5feed.conversion.samples import check_same_shape, fsync_tree, new_store_info, rows_taken, settings_difference
from h5feed.errors import SourceError, StoreError
from h5feed.formats import FORMATS, SampleShape, SourceFile, SourceFormat, last_state_norm_of
from h5feed.io.local import write_atomically
from h5feed.store.attributes import KeptCompanion, SkippedFile
from h5feed.store.format import COMPANIONS_DIR
from h5feed.store.layout import MAX_DEFAULT_SHARD_TOKENS, crc32c, create_arrays

log = logging.getLogger(__name__)

Probed = tuple[SourceFile, SampleShape, os.stat_result]  # a file, its shape, and its stat as planned


def make_plan(job: Job, pool: TaskPool, listing: Listing) -> Plan:
    """Probe every file, check they agree on H, K and dtype, and lay the samples out."""
    fmt, src_root, dst, options, durable = job.fmt, job.src, job.dst, job.options, job.request.run.durable
    probed, skipped = probe(job, pool, listing.files, None)
    shapes = [(source, shape) for source, shape, _ in probed]
    if not probed:
        raise SourceError(src_root, "no readable sample files (all were skipped)")
    reference = probed[0][1]
    chunk_tokens = options.chunk_tokens
    shard_tokens = options.shard_tokens or _default_shard_tokens([shape for _, shape, _ in probed], chunk_tokens)
    planned, row = lay_out(probed, 0, shard_tokens)
    info = new_store_info(fmt, reference, codec=options.codec, chunk_tokens=chunk_tokens, shard_tokens=shard_tokens,
                          source_root=job.source_root, precision=options.precision,
                          last_state_norm=last_state_norm_of(fmt, src_root, shapes, options.last_state_norm),
                          source_info=fmt.source_info(src_root))
    info = dataclasses.replace(info, companions=_keep_companions(fmt, src_root, dst, durable))
    info = dataclasses.replace(info, format_version=info.format_version_needed)
    create_arrays(dst, info, total_rows=row)
    if durable:
        fsync_tree(dst)
    plan = Plan(options, tuple(planned), tuple(listing.unreadable + skipped), row, unfinished=tuple(listing.unfinished),
                store=info.to_json())
    plan.write(dst, durable)
    return plan


def _keep_companions(fmt: SourceFormat, src_root: Path, dst: Path, durable: bool) -> dict[str, KeptCompanion]:
    """Copy the small files the trainer needs beside the samples into `companions/`, byte for byte, and record
    each one's size and crc32c (a large one, like NeMo's target embeddings, is recorded only)."""
    kept: dict[str, KeptCompanion] = {}
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
        copy = None
        if companion.copy:
            (dst / COMPANIONS_DIR).mkdir(exist_ok=True)
            write_atomically(dst / COMPANIONS_DIR / companion.relpath, data, durable=durable)
            copy = f"{COMPANIONS_DIR}/{companion.relpath}"
        kept[companion.relpath] = KeptCompanion(companion.relpath, size, crc, copy)
    return kept


def _file_crc32c(path: Path) -> tuple[int, int]:
    """(crc32c, size) of a file, read 16 MiB at a time."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            crc, size = crc32c(block, crc), size + len(block)
    return crc, size


def probe(
    job: Job, pool: TaskPool, sources: list[SourceFile], reference: SampleShape | None
) -> tuple[list[Probed], list[SkippedFile]]:
    """Shapes of the sources (each checked against `reference`, or the first one), with their stat
    as planned; and the skipped ones, with skip_bad."""
    probed: list[Probed] = []
    skipped: list[SkippedFile] = []
    results = pool.map(_probe_one, [job.fmt.name] * len(sources), sources, [job.fetcher] * len(sources), chunksize=16)
    progress = job.request.progress
    for source, result in tqdm(zip(sources, results), total=len(sources), desc="probing", disable=not progress):
        try:
            if isinstance(result, SourceError):
                raise result
            shape, stat = result
            reference = reference or shape
            check_same_shape(source.path, shape, reference, "the first sample")
            _check_same_layout(source, shape, reference)
            probed.append((source, shape, stat))
        except SourceError as exc:
            if not job.request.skips.skip_bad:
                raise
            log.warning("skipping %s", exc)
            skipped.append(SkippedFile(source.relpath, exc.problem))
    return probed, skipped


def lay_out(probed: list[Probed], row: int, shard_tokens: int) -> tuple[list[PlannedSample], int]:
    """Plan entries for the probed samples from row `row` on, each on a shard boundary; and the row after them."""
    planned = []
    for source, shape, stat in probed:
        planned.append(PlannedSample(source.relpath, source.sample_index, shape.num_tokens, row, stat.st_size,
                                      stat.st_mtime_ns))
        row += rows_taken(shape.num_tokens, shard_tokens)
    return planned, row


def _default_shard_tokens(shapes: list[SampleShape], chunk_tokens: int) -> int:
    """The longest sample rounded up to whole chunks (one object per sample and array), within bounds."""
    longest = max(s.num_tokens for s in shapes)
    cap = max(chunk_tokens, MAX_DEFAULT_SHARD_TOKENS // chunk_tokens * chunk_tokens)
    return min(math.ceil(longest / chunk_tokens) * chunk_tokens, cap)


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


def _probe_one(
    format_name: str, source: SourceFile, fetcher: SourceFetcher | None = None
) -> tuple[SampleShape, os.stat_result] | SourceError:
    """The file's shape and its stat before reading (a change after it shows at conversion); a bucket's
    file is stat'ed in the shadow (the object's size and mtime as listed) and fetched to be read."""
    try:
        fmt = FORMATS[format_name]  # type: ignore[index]
        stat = fmt.file_of(source.path).stat()
        if fetcher is not None:
            with fetcher.fetched(source) as local:
                return fmt.probe(local), stat
        return fmt.probe(source), stat
    except SourceError as exc:
        return exc
    except OSError as exc:
        return SourceError(source.path, f"cannot be read ({exc.strerror or exc})")


def read_plan(job: Job, sources: list[SourceFile]) -> Plan:
    """The plan of an unfinished conversion, if this command is the same one that started it."""
    dst, options = job.dst, job.options
    try:
        plan = Plan.read(dst)
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        raise StoreError(dst, f"unfinished store without a readable plan ({exc}); pass --overwrite to start again") from exc
    differ = settings_difference(plan.options.to_json(), options.to_json())
    if differ is not None:
        raise StoreError(dst, f"was started with {differ[0]}, not {differ[1]}: repeat that command to resume, "
                         "or pass --overwrite")
    missing = plan.known() - {s.relpath for s in sources}
    if missing and not job.request.skips.skip_bad:
        raise StoreError(
            dst, f"source files of the unfinished conversion are gone: {sorted(missing)[:5]}; pass --skip-bad to skip them"
        )
    return plan
