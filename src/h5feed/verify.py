"""`h5feed verify` and `h5feed inspect`: trust a store without trusting the converter.

Verify opens every array with zarr-python (so a store it passes opens in any Zarr v3
reader), reads every sample through the checked reader (every inner chunk's crc32c),
compares each sample's decoded bytes with the checksums recorded at conversion and,
with `against`, with the source files bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from h5feed.errors import H5feedError, SourceError
from h5feed.formats import FORMATS, SourceFile, SourceFormat
from h5feed.io import cache_state
from h5feed.io.paths import UnsafeName, contained_path, regular_file
from h5feed.store import Store, StoreInfo, checksums
from h5feed.store.format import HIDDEN_SCALES, INDEX_COLUMNS
from h5feed.store.fp8 import quantize, token_scales
from h5feed.store.layout import Commit, crc32c


@dataclass
class Mismatch:
    sample: int
    source_path: str
    problem: str

    def __str__(self) -> str:
        if self.sample < 0:  # not a sample's problem: the store's (source_path names the array)
            return f"{self.source_path}: {self.problem}"
        return f"sample {self.sample} ({self.source_path}): {self.problem}"


@dataclass
class VerifyReport:
    store: Path | str  # a path, or a URL
    samples_checked: int = 0
    compared_with_source: bool = False
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def verify_store(
    path: str | os.PathLike[str], against: str | os.PathLike[str] | None = None, *, progress: bool = True,
    storage_options: Mapping[str, Any] | None = None, cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | None = None,
) -> VerifyReport:
    """Check every sample's checksums; with `against`, compare every tensor bit for bit with its source file.

    `path` is a local path or an fsspec URL (`storage_options`, `cache_dir` and `cache_limit` as `Store`'s)."""
    store = Store(path, storage_options=storage_options, cache_dir=cache_dir, cache_limit=cache_limit)
    report = VerifyReport(store.path, compared_with_source=against is not None)
    report.mismatches += _unreadable_arrays(store)
    if not store.remote:
        report.mismatches += _damaged_companions(Path(path), store.info)
    source_format = FORMATS[store.info.source_format] if against is not None else None
    if against is not None:
        _check_source_folder(Path(against), store)
    for i in tqdm(range(len(store)), desc="verifying", unit="sample", disable=not progress):
        report.samples_checked += 1
        report.mismatches += check_sample(store, i, None if against is None else Path(against), source_format)
    return report


def check_sample(store: Store, i: int, against: Path | None = None,
                 source_format: SourceFormat | None = None) -> list[Mismatch]:
    """Sample `i`'s problems: chunks that fail their crc32c, arrays whose checksum differs from the one recorded at
    conversion and, with `against` (and the store's `source_format`), tensors that differ from the source file's."""
    relpath = store.source_paths[i]
    try:
        sample = store.read_sample(i)
    except H5feedError as exc:
        return [Mismatch(i, relpath, str(exc))]
    mismatches = []
    stored = _stored_bits(store.info, sample.aux_hidden_states, sample.last_hidden_state, sample.input_ids,
                          sample.loss_mask, sample.extras, sample.hidden_scales)
    for name, want, got in zip(store.info.array_names, store.checksums[i], checksums(list(stored.values()))):
        if int(want) != got:
            mismatches.append(Mismatch(i, relpath, f"{name} checksum {got:#010x} != recorded {int(want):#010x}"))
    if source_format is None or against is None:
        return mismatches
    try:
        original = source_format.load(_source_file(against, relpath, int(store.source_indices[i])))
    except H5feedError as exc:
        return [*mismatches, Mismatch(i, relpath, f"source cannot be read: {exc}")]
    aux, last, scales = original.aux_hidden_states, original.last_hidden_state, original.hidden_scales
    if store.info.lossy:  # the store must hold exactly what the conversion's quantization gives
        scales = token_scales([aux, *([last] if last is not None else [])])
        aux, last = quantize(aux, scales), None if last is None else quantize(last, scales)
    expected = _stored_bits(store.info, aux, last, original.input_ids, original.stored_loss_mask(),
                            original.extras, scales)
    for name in store.info.array_names:
        if name not in expected or expected[name].shape != stored[name].shape or not torch.equal(
                expected[name], stored[name]):
            mismatches.append(Mismatch(i, relpath, f"{name} differs from the source file"))
    return mismatches


def _unreadable_arrays(store: Store) -> list[Mismatch]:
    """Every array of the group must open in zarr-python, as any Zarr v3 reader would open it."""
    import zarr

    problems = []
    group = store.zarr_group()
    index = Commit.of_root({"attributes": group.attrs.asdict()}).index  # a bucket writer's: under its own prefix
    for name in (*store.info.array_names, *(f"{index}/{c}" for c in INDEX_COLUMNS)):
        try:
            array = group[name]
            if not isinstance(array, zarr.Array):
                raise TypeError("is a group, not an array")
        except Exception as exc:  # whatever zarr raises on damaged metadata (its text may quote the whole document)
            problems.append(Mismatch(-1, name, f"zarr-python cannot open the array: {name}/zarr.json is damaged or "
                                     f"missing ({type(exc).__name__})"))
    return problems


def _check_source_folder(against: Path, store: Store, probe: int = 8) -> None:
    """One clear error, not a mismatch per sample, when `against` is not the folder the store came from:
    it is no folder, or none of the first `probe` source files the index names is in it."""
    hint = f"pass the folder the store was converted from (it recorded {store.info.source_root})"
    if not against.is_dir():
        raise SourceError(against, f"is not a folder: {hint}")
    names = [SourceFormat.file_of(Path(store.source_paths[i])).as_posix() for i in range(min(probe, len(store)))]
    if names and not any(_is_file_inside(against, name) for name in names):
        raise SourceError(against, f"holds none of the store's first source files ({names[0]}, ...): {hint}")


def _is_file_inside(folder: Path, name: str) -> bool:
    try:
        return contained_path(folder, name).is_file()
    except UnsafeName:  # the per-sample comparison reports it
        return False


def _source_file(against: Path, relpath: str, source_index: int) -> SourceFile:
    """The source file an index row names, if it is a regular file inside `against`: the index is the store's word,
    and a store may come from anyone.  (A NeMo row names a sample of its shard: `shard-000000.safetensors#3`.)"""
    path = contained_path(against, relpath)
    regular_file(contained_path(against, SourceFormat.file_of(Path(relpath)).as_posix()))
    return SourceFile(path, source_index, relpath)


def _damaged_companions(path: Path, info: StoreInfo) -> list[Mismatch]:
    """The files kept beside the samples must hold the bytes recorded at conversion (and be files of the store:
    the record is the store's word)."""
    problems = []
    for name, record in info.companions.items():
        if record.copy is None:
            continue
        try:
            data = regular_file(contained_path(path, record.copy)).read_bytes()
        except UnsafeName as exc:
            problems.append(Mismatch(-1, record.copy, f"{exc.problem}: not a file of the store, not read"))
            continue
        except SourceError as exc:  # a FIFO, socket or device
            problems.append(Mismatch(-1, record.copy, exc.problem))
            continue
        except OSError as exc:
            problems.append(Mismatch(-1, record.copy, f"cannot be read ({exc.strerror or exc})"))
            continue
        if (len(data), crc32c(data)) != (record.nbytes, record.crc32c):
            problems.append(Mismatch(-1, record.copy, f"differs from the {name} recorded at conversion"))
    return problems


def _stored_bits(
    info: StoreInfo,
    aux: torch.Tensor,
    last: torch.Tensor | None,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    extras: dict[str, torch.Tensor],
    hidden_scales: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The store's arrays as their on-disk bits, in `info.array_names` order, so that comparisons are
    bit-exact (NaN == NaN, -0 != +0); an array the sample lacks is left out (and reported as differing)."""
    tensors = {"aux_hidden_states": aux, "last_hidden_states": last, "input_ids": input_ids, "loss_mask": loss_mask,
               HIDDEN_SCALES: hidden_scales, **extras}
    return {name: tensors[name].view(info.storage_dtype(name)) for name in info.array_names
            if tensors.get(name) is not None}


def describe_store(
    path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None, cache_limit: int | None = None,
) -> dict[str, Any]:
    """The figures `h5feed inspect` prints: what is stored, how big, how well compressed; with
    `cache_dir`, the state of the node cache there (objects, bytes, hits and misses of every process)."""
    store = Store(path, storage_options=storage_options, cache_dir=cache_dir, cache_limit=cache_limit)
    info = store.info
    tokens = int(store.sample_lengths.sum())
    raw = tokens * store.token_nbytes
    stored = store.stored_nbytes()
    cache = {} if cache_dir is None or not store.remote else {"cache": cache_state(cache_dir).summary()}
    precision = {} if not info.fp8 else {  # an exact store's, the source's bits, go without saying
        "precision": "fp8 (float8_e4m3fn, one float32 scale per token), read as bfloat16",
        "lossy": f"yes: quantized from {info.quantized_from} by `h5feed convert --precision fp8`" if info.lossy
        else "no: the source files' FP8 bytes and scales, kept as they were",
    }
    summary = {
        "store": str(store.path),
        "samples": len(store),
        "tokens": tokens,
        "tokens_per_sample": {
            "min": int(store.sample_lengths.min()) if len(store) else 0,
            "mean": round(tokens / max(len(store), 1), 1),
            "max": int(store.sample_lengths.max()) if len(store) else 0,
        },
        "hidden_size": info.hidden_size,
        "num_aux_layers": info.num_aux_layers,
        "dtype": info.dtype,
        **precision,
        "last_state_norm": info.last_state_norm,
        "source_format": info.source_format,
        "source_root": info.source_root,
        "codec": info.codec.to_json(),
        "format_version": info.format_version,
        "chunk_tokens": info.chunk_tokens,
        "shard_tokens": info.shard_tokens or None,
        "raw_bytes": raw,
        "stored_bytes": stored,
        "compression_ratio": round(raw / stored, 3) if stored else None,
        "skipped": [skipped.to_json() for skipped in info.skipped],
        **cache,
    }
    if info.needs_format_3:  # format 3: what a format-2 store does not have
        summary.update(has_last_state=info.has_last_state, ids_shifted=info.ids_shifted,
                       extra_arrays={name: extra.record() for name, extra in info.extra_arrays.items()},
                       source_info=info.source_info,
                       companions={name: kept.to_json() for name, kept in info.companions.items()})
    return summary
