"""Writing samples into a local store: the one copy that `h5feed convert` and `h5feed.open_writer` share.

A sample in the standard layout (`SourceSample`) is encoded chunk by chunk into its shards, each
written atomically; the token arrays grow as samples are added; the index is published so that a
reader opening the store meanwhile sees a consistent set of samples.  The same sample gives the
same bytes whichever of the two writes it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from h5feed.errors import SourceError
from h5feed.formats import SampleShape, SourceFormat, SourceSample
from h5feed.io.local import fsync_dir, write_atomically
from h5feed.store.attributes import SkippedFile
from h5feed.store.format import HIDDEN_SCALES
from h5feed.store.fp8 import DEQUANTIZED_DTYPE, FP8_DTYPE, quantize, token_scales
from h5feed.store.journal import JournalRecord
from h5feed.store.layout import (
    IndexDigest,
    LastStateNorm,
    Precision,
    StoreInfo,
    chunk_codec,
    chunk_encoder,
    crc32c,
    dtype_name,
    encode_shard,
    object_key,
    read_info,
    write_info,
)

INDEX_CHUNK_ROWS = 16384  # samples per chunk of an index column: an append rewrites the last chunk only


def new_store_info(fmt: SourceFormat, reference: SampleShape, *, codec: str, chunk_tokens: int, shard_tokens: int,
                   source_root: str, last_state_norm: LastStateNorm | None, precision: Precision,
                   source_info: dict[str, Any]) -> StoreInfo:
    """The description of a new store of `fmt`'s samples shaped like `reference` (its first sample): an FP8 source
    stays FP8 whatever `precision` says, and `precision="fp8"` quantizes the others."""
    source_dtype = dtype_name(reference.dtype)
    fp8_source = reference.dtype == FP8_DTYPE  # kept as it is, whatever precision was asked
    fp8 = quantizes(precision, reference.dtype) or fp8_source
    info = StoreInfo(
        source_format=fmt.name,
        hidden_size=reference.hidden_size,
        num_aux_layers=reference.num_aux_layers,
        dtype=dtype_name(DEQUANTIZED_DTYPE) if fp8 else source_dtype,
        last_state_norm=last_state_norm,
        codec=chunk_codec(codec),
        chunk_tokens=chunk_tokens,
        shard_tokens=shard_tokens,
        source_root=source_root,
        has_last_state=fmt.has_last_state,
        ids_shifted=fmt.ids_shifted,
        extra_arrays={extra.name: extra for extra in reference.extras},
        source_info={**source_info, **({"layout": reference.layout} if reference.layout else {})},
        precision="fp8" if fp8 else "exact",
        quantized_from=source_dtype if fp8 and not fp8_source else "",
    )
    return dataclasses.replace(info, format_version=info.format_version_needed)


def quantizes(precision: Precision, dtype: torch.dtype) -> bool:
    """Whether a store of `precision` quantizes hidden states of `dtype` (an FP8 source's are kept as they are)."""
    return precision == "fp8" and dtype != FP8_DTYPE


def with_fp8_scales(where: Path, sample: SourceSample) -> SourceSample:
    """The sample with the per-token scales a store that quantizes it divides its hidden states by
    (`hidden_scales`, as `token_scales` computes them), for `write_sample`: a token holding NaN or Inf is refused
    here, naming `where`, the token and the layer.  Its scale, the amax of its values, would be NaN or Inf and
    every one of its values NaN once quantized (hs-connectors' arithmetic, which says nothing).  The check costs
    a pass over the T scales: the amax over the token's values is taken to quantize anyway."""
    last = sample.last_hidden_state
    scales = token_scales([*sample.aux_parts, *([last] if last is not None else [])])
    bad = (~torch.isfinite(scales)).nonzero()
    if len(bad):
        raise SourceError(where, _non_finite_token(sample, int(bad[0]), len(bad)))
    return dataclasses.replace(sample, hidden_scales=scales)


def _non_finite_token(sample: SourceSample, token: int, count: int) -> str:
    """Where in `token` (of non-finite scale) the first NaN or Inf lies, and what to do about it."""
    h = sample.shape.hidden_size
    layers = [*sample.aux_parts, *([sample.last_hidden_state] if sample.last_hidden_state is not None else [])]
    column = 0
    for part in layers:
        found = (~torch.isfinite(part[token])).nonzero()
        if len(found):
            column += int(found[0])
            value = part[token, int(found[0])].item()
            break
        column += int(part.shape[1])
    layer, k = column // h, sample.shape.num_aux_layers
    place = f"aux layer {layer} of {k}" if layer < k else "the last hidden state"
    return (f"token {token} holds {value} in {place} (value {column % h} of {h}), and quantized to FP8 every value "
            f"of that token would be NaN (its scale is its largest absolute value; {count} of the sample's "
            f"{len(sample.input_ids)} tokens hold NaN or Inf): fix the extraction that made it, leave the sample out "
            "(convert's --skip-bad), or store exactly (precision exact keeps NaN and Inf as they are); "
            "`(~torch.isfinite(t)).nonzero()` finds such values in a tensor t")


def check_same_shape(where: Path, shape: SampleShape, reference: SampleShape, whose: str) -> None:
    """One store holds one H, K and dtype: a sample that differs from `reference` (`whose`: "the first sample")
    raises SourceError naming it."""
    for what, got, want in (
        ("hidden size", shape.hidden_size, reference.hidden_size),
        ("number of aux layers", shape.num_aux_layers, reference.num_aux_layers),
        ("dtype", shape.dtype, reference.dtype),
    ):
        if got != want:
            raise SourceError(where, f"{what} {got} differs from {want} of {whose}")


def write_sample(dst: Path, info: StoreInfo, sample: SourceSample, start: int, durable: bool) -> JournalRecord:
    """Write one sample's shards from row `start` (a shard boundary); its journal record: the crc32c of each
    array's rows, whether it had a loss mask, the bytes written (the caller adds where it is).  FP8 stores
    quantize here."""
    loss_mask = sample.stored_loss_mask()
    c = info.chunk_tokens
    rows = range(0, len(sample.input_ids), c)

    def chunks(tensor: torch.Tensor, name: str) -> Iterable[torch.Tensor]:  # one chunk's rows at a time
        return (tensor[r : r + c].view(info.storage_dtype(name)) for r in rows)

    # An FP8 source's scales, kept as they are, or those `with_fp8_scales` checked, which the states are quantized
    # with here, as hs-connectors' fp8 backend does (the aux states one chunk at a time).
    last, scales = sample.last_hidden_state, sample.hidden_scales
    quantizing = info.lossy
    if quantizing:
        assert scales is not None, "a sample to quantize comes from with_fp8_scales"
        last = None if last is None else quantize(last, scales)
    blocks: dict[str, Iterable[torch.Tensor]] = {}
    if scales is not None:
        blocks[HIDDEN_SCALES] = chunks(scales, HIDDEN_SCALES)

    def aux_rows(r: int) -> torch.Tensor:
        aux = sample.aux_rows(r, r + c)
        return quantize(aux, scales[r : r + c]) if quantizing else aux

    blocks.update({  # no copy of a whole sample
        "aux_hidden_states": (aux_rows(r).view(info.storage_dtype("aux_hidden_states")) for r in rows),
        "input_ids": chunks(sample.input_ids, "input_ids"),
        "loss_mask": chunks(loss_mask, "loss_mask"),
        **{name: chunks(extra, name) for name, extra in sample.extras.items()},
    })
    if last is not None:
        blocks["last_hidden_states"] = chunks(last, "last_hidden_states")
    written = {name: write_shards(dst, info, name, blocks[name], start, durable) for name in info.array_names}
    return JournalRecord(checksum=tuple(crc for _, crc in written.values()), has_loss_mask=sample.loss_mask is not None,
                         bytes_out=sum(nbytes for nbytes, _ in written.values()))


def write_shards(
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


def rows_taken(num_tokens: int, shard_tokens: int) -> int:
    """The rows a sample of `num_tokens` takes: it starts on a shard boundary, and the next one after its last shard."""
    return math.ceil(num_tokens / shard_tokens) * shard_tokens


def _token_array_metadata(dst: Path) -> list[Path]:
    """The zarr.json of each token array (the group's and the index's are not)."""
    return [meta for meta in sorted(dst.glob("*/zarr.json")) if json.loads(meta.read_text())["node_type"] == "array"]


def array_rows(dst: Path) -> int:
    """The rows every token array holds: a kill while `grow_arrays` runs may leave some grown, some not."""
    return min(int(json.loads(meta.read_text())["shape"][0]) for meta in _token_array_metadata(dst))


def grow_arrays(dst: Path, rows: int, durable: bool) -> None:
    """Resize the token arrays to `rows` (an append's).  zarr rewrites each array's metadata atomically
    (temporary file, rename); readers that opened the store earlier never read it again."""
    import zarr

    for meta in _token_array_metadata(dst):
        name = meta.parent.name
        array = zarr.open_array(dst / name, mode="r+")
        if array.shape[0] < rows:
            array.resize((rows, *array.shape[1:]))
            if durable:
                fsync_file(dst / name / "zarr.json")
                fsync_dir(dst / name)


def publish_index(dst: Path, columns: dict[str, np.ndarray], rebuild: bool) -> None:
    """Write the index columns so that a reader opening the store meanwhile sees a consistent index.

    The index only grows (an append adds rows after the last; no row changes), and a
    reader takes the number of samples from the group attributes, read first, and
    reads that many rows of each column (`Store`).  Each column is resized and
    written through zarr, whose every file write is atomic (temporary file,
    rename): a column's metadata and chunks hold, at any moment, the old rows or
    the old and the new, never a part of a file.  So a reader that read the
    attributes before `_finalize` flips them reads exactly the old samples, and one
    that read them after reads all.  Readers that opened the store earlier hold
    their index in memory and never read it again.  `rebuild` recreates columns
    from scratch (a damaged index: no reader can open that store anyway).
    """
    import zarr
    from zarr.codecs import Crc32cCodec, ZstdCodec

    index = zarr.open_group(dst, mode="r+").require_group("index")
    for name, values in columns.items():
        array = None if rebuild else open_column(index, name)
        if array is None:
            array = index.create_array(name, shape=values.shape, chunks=(INDEX_CHUNK_ROWS, *values.shape[1:]),
                                       dtype=values.dtype if name != "source_path" else str,
                                       compressors=[ZstdCodec(level=3), Crc32cCodec()], overwrite=True)
        elif array.shape != values.shape:
            array.resize(values.shape)
        if len(values):
            array[...] = values
    index.update_attributes(IndexDigest.of(columns).to_attributes())  # after the rows it covers


def open_column(index: Any, name: str) -> Any:
    """An index column, or None before the first finalize wrote it."""
    try:
        return index[name]
    except KeyError:
        return None


def fsync_tree(top: Path) -> None:
    """Flush every file and folder under `top` (metadata and index: small) to the disk."""
    for dirpath, _, filenames in os.walk(top):
        for name in filenames:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class IndexRow:
    """One published sample: where its rows start, how many, where it came from, its journal record."""

    start: int
    num_tokens: int
    source_index: int
    source_path: str
    checksum: tuple[int, ...]
    has_loss_mask: bool


def publish_samples(dst: Path, rows: Sequence[IndexRow], skipped: list[SkippedFile], durable: bool,
                    rebuild: bool = False) -> None:
    """Publish `rows` as the store's samples: the index (checksummed by zarr's crc32c codec), then the
    status "complete" and the sample count in one atomic write, which readers take as the truth."""
    publish_columns(dst, index_columns(rows, len(read_info(dst).array_names)), skipped, durable, rebuild)


def index_columns(rows: Sequence[IndexRow], arrays: int) -> dict[str, np.ndarray]:
    """The index columns of `rows` (`arrays`: the store's arrays, one checksum each)."""
    return {
        "sample_start": np.array([r.start for r in rows], dtype=np.int64),
        "sample_length": np.array([r.num_tokens for r in rows], dtype=np.int64),
        "source_index": np.array([r.source_index for r in rows], dtype=np.int64),
        "checksum": np.array([r.checksum for r in rows], dtype=np.uint32).reshape(len(rows), arrays),
        "has_loss_mask": np.array([r.has_loss_mask for r in rows], dtype=bool),
        "source_path": np.array([r.source_path for r in rows], dtype=str),
    }


def publish_columns(dst: Path, columns: dict[str, np.ndarray], skipped: list[SkippedFile], durable: bool,
                    rebuild: bool = False) -> None:
    """`publish_samples` of rows given as index columns."""
    info = read_info(dst)
    publish_index(dst, columns, rebuild)
    if durable:
        fsync_tree(dst / "index")
    complete = dataclasses.replace(info, status="complete", num_samples=len(columns["sample_start"]),
                                   num_tokens=int(columns["sample_length"].sum()), skipped=list(skipped))
    write_info(dst, complete, durable=durable)


def published_columns(dst: Path) -> dict[str, np.ndarray]:
    """The index columns of the samples published now (the rows the attributes count: a publication killed
    midway may have written more): what a writer publishing beside others adds its own samples to."""
    import zarr

    info = read_info(dst)
    n = info.num_samples if info.status == "complete" else 0
    if n == 0:
        return index_columns([], len(info.array_names))
    index = zarr.open_group(dst, mode="r")["index"]
    return {name: np.asarray(index[name][:n]) for name in ("sample_start", "sample_length", "source_index",
                                                          "checksum", "has_loss_mask", "source_path")}


def differing_settings(info: StoreInfo, asked: Mapping[str, Any]) -> tuple[str, str] | None:
    """The settings a store was written with that differ from `asked` (format, codec by its option name,
    chunk_tokens, shard_tokens; last_state_norm and precision where stated), as options name them: ("codec zstd",
    "codec lz4"); None when they agree.  An FP8 source's store is FP8 whatever precision was asked."""
    have = {"format": info.source_format, "codec": info.codec, "chunk_tokens": info.chunk_tokens,
            "shard_tokens": info.shard_tokens}
    if asked.get("last_state_norm") is not None:
        have["last_state_norm"] = info.last_state_norm
    if info.lossy or (info.fp8 and asked.get("precision") == "fp8"):
        have["precision"] = "fp8"
    wanted = {**asked, "codec": chunk_codec(asked["codec"])}
    wanted = {key: value for key, value in wanted.items()
              if value is not None and (key, value) != ("precision", "exact")}  # unstated, as the store leaves them
    return settings_difference(have, wanted)


def settings_difference(have: Mapping[str, Any], wanted: Mapping[str, Any]) -> tuple[str, str] | None:
    """The settings of `have` and `wanted` (option names and values, the codec by its option name or its
    numcodecs configuration) that differ, each side as options name them ("chunk tokens 16", "chunk tokens 32");
    None when they agree."""
    if have == wanted:
        return None

    def shown(key: str, value: Any) -> str:
        if key == "codec":  # by its option name where it is one
            value = next((name for name in ("zstd", "lz4", "none") if chunk_codec(name) == value), value)
        if key == "precision" and value is None:  # left out of the options when exact
            value = "exact"
        return f"{key.replace('_', ' ')} {'(the default)' if value is None else value}"

    differ = [key for key in {**wanted, **have} if have.get(key) != wanted.get(key)]
    return ", ".join(shown(k, have.get(k)) for k in differ), ", ".join(shown(k, wanted.get(k)) for k in differ)
