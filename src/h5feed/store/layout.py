"""How an h5feed store is written, and its attributes read: `StoreInfo`, the codecs, the shards' bytes, the index.

The format these implement is described in `h5feed.store.format` (which also says where it is read: the
CPU reader, `h5feed.store.reader`, and the GPU path's frame parser, `h5feed.gpu.frames`).  Here: the
store's self-description (`StoreInfo`, with its typed parts from `h5feed.store.attributes`), read and
written without zarr (`read_info`, `write_info`); the group and its arrays, created with zarr-python so
that any Zarr v3 reader opens them (`create_arrays`); each inner chunk and shard encoded exactly as zarr's
pipeline encodes them, without its per-chunk copies (`chunk_encoder`, `encode_shard`); a shard's index
decoded and checked (`decode_shard_index`); and the index's digest and a bucket writer's commit.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from h5feed.errors import NotAStoreError, StoreError
from h5feed.io.local import write_atomically
from h5feed.store.attributes import ChunkCodec, ExtraArray, KeptCompanion, SkippedFile
from h5feed.store.format import (
    ATTRS_KEY,
    BLOSC_MAX_OVERHEAD,
    CHECKSUMMED,
    COMMIT_KEY,
    CRC_BYTES,
    DEFAULT_INDEX,
    EMPTY,
    FP8_FORMAT_VERSION,
    HIDDEN_ARRAYS,
    HIDDEN_SCALES,
    INDEX_COLUMNS,
    OPTIONAL_ARRAYS_FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
    STORE_FORMAT_VERSION,
)

if TYPE_CHECKING:
    from h5feed.io import ObjectStore

DEFAULT_CHUNK_TOKENS = 256
MAX_DEFAULT_SHARD_TOKENS = 8192  # a longer sample spans several shards
LastStateNorm = Literal["pre", "post"]
Precision = Literal["exact", "fp8"]  # exact: the source's bits; fp8: float8_e4m3fn and a scale per token

# Bits of a float dtype stored as an unsigned integer of the same width:
# zarr-python 3 has no bfloat16, and uint keeps every bit pattern exact.
_STORAGE_DTYPES: dict[torch.dtype, torch.dtype] = {
    torch.float8_e4m3fn: torch.uint8,  # an FP8 store's hidden states
    torch.bfloat16: torch.uint16,
    torch.float16: torch.uint16,
    torch.float32: torch.uint32,
}
# The per-token arrays' own dtypes are stored as they are; bool as its bytes (uint8).
_INTEGER_STORAGE: dict[torch.dtype, torch.dtype] = {torch.int64: torch.int64, torch.int32: torch.int32,
                                                    torch.bool: torch.uint8}


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The unsigned integer dtype that carries `dtype`'s bits on disk."""
    try:
        return _STORAGE_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"h5feed stores bfloat16, float16 or float32 hidden states, not {dtype}") from None


def array_storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of an optional array of logical `dtype`: float bits as uint, integers as they are."""
    if dtype in _INTEGER_STORAGE:
        return _INTEGER_STORAGE[dtype]
    return storage_dtype(dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class StoreInfo:
    """The self-description kept in the group's attributes."""

    source_format: str
    hidden_size: int
    num_aux_layers: int
    dtype: str  # logical torch dtype name, e.g. "bfloat16"
    last_state_norm: LastStateNorm | None  # None: the store holds no last state (`has_last_state` false)
    codec: ChunkCodec
    chunk_tokens: int
    shard_tokens: int = 0  # 0: format 1, one object per chunk
    status: Literal["converting", "complete"] = "converting"
    source_root: str = ""
    num_samples: int = 0
    num_tokens: int = 0
    skipped: list[SkippedFile] = field(default_factory=list)
    format_version: int = STORE_FORMAT_VERSION
    # Format 3 (see the module docstring); the defaults are a format-2 store's, and are left out of its attributes.
    has_last_state: bool = True  # False: no `last_hidden_states` array (a NeMo cache stores none)
    ids_shifted: bool = False  # True: input_ids and loss_mask are stored shifted left by one (token 0 is gone)
    extra_arrays: dict[str, ExtraArray] = field(default_factory=dict)  # by name, in the order of their arrays
    source_info: dict[str, Any] = field(default_factory=dict)  # what the source format says beyond the arrays
    companions: dict[str, KeptCompanion] = field(default_factory=dict)  # files kept beside the samples, by source
    # Format 4 (see the module docstring); the defaults are an exact store's, and are left out of its attributes.
    precision: Precision = "exact"
    quantized_from: str = ""  # fp8 quantized at conversion: the source's dtype name; "": the source held FP8

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype reads deliver the hidden states in (an FP8 store's: bfloat16, as hs-connectors reads them)."""
        return dtype_from_name(self.dtype)

    @property
    def fp8(self) -> bool:
        return self.precision == "fp8"

    @property
    def lossy(self) -> bool:
        """Whether the conversion rounded the source's hidden states (to FP8): reads give the source's values
        only approximately."""
        return bool(self.quantized_from)

    @property
    def source_dtype(self) -> torch.dtype:
        """The dtype of the source files' hidden states (what each file converted into this store must have)."""
        if not self.fp8:
            return self.torch_dtype
        return dtype_from_name(self.quantized_from) if self.quantized_from else torch.float8_e4m3fn

    @property
    def sharded(self) -> bool:
        return self.shard_tokens > 0

    @property
    def object_tokens(self) -> int:
        """Rows per stored object (a shard, or in format 1 a chunk); every sample starts on a multiple."""
        return self.shard_tokens if self.sharded else self.chunk_tokens

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_tokens // self.chunk_tokens

    @property
    def array_names(self) -> tuple[str, ...]:
        """Every per-token array the store holds, in the order of `index/checksum`'s columns."""
        core = tuple(n for n in CHECKSUMMED if self.has_last_state or n != "last_hidden_states")
        return core + ((HIDDEN_SCALES,) if self.fp8 else ()) + tuple(self.extra_arrays)

    @property
    def needs_format_3(self) -> bool:
        """Whether the store needs format 3 (some attribute differs from a format-2 store's)."""
        return any(getattr(self, name) != default for name, default in _FORMAT_3_DEFAULTS.items())

    @property
    def format_version_needed(self) -> int:
        """The oldest format that holds this store: the one its conversion writes."""
        if self.fp8:
            return FP8_FORMAT_VERSION
        return OPTIONAL_ARRAYS_FORMAT_VERSION if self.needs_format_3 else STORE_FORMAT_VERSION

    def width(self, name: str) -> int:
        """Values per row of array `name` (1 for the per-token arrays)."""
        if name in self.extra_arrays:
            return int(self.extra_arrays[name].width)
        return {"aux_hidden_states": self.num_aux_layers * self.hidden_size, "last_hidden_states": self.hidden_size}.get(
            name, 1
        )

    def is_matrix(self, name: str) -> bool:
        """Whether array `name` is [rows, width] (else [rows]): the hidden arrays, and the extras wider than 1."""
        return name in HIDDEN_ARRAYS or self.width(name) > 1

    def logical_dtype(self, name: str) -> torch.dtype:
        """The dtype array `name` holds as stored (an FP8 store's hidden arrays: float8_e4m3fn)."""
        if name in self.extra_arrays:
            return dtype_from_name(self.extra_arrays[name].dtype)
        if name == HIDDEN_SCALES:
            return torch.float32
        if name in HIDDEN_ARRAYS:
            return torch.float8_e4m3fn if self.fp8 else self.torch_dtype
        return torch.int64

    def storage_dtype(self, name: str) -> torch.dtype:
        if name in HIDDEN_ARRAYS:
            return storage_dtype(self.logical_dtype(name))  # floats only
        if name in self.extra_arrays or name == HIDDEN_SCALES:
            return array_storage_dtype(self.logical_dtype(name))
        return torch.int64

    def row_nbytes(self, name: str) -> int:
        return self.width(name) * self.storage_dtype(name).itemsize

    def problem(self) -> str | None:
        """What makes these attributes impossible (None: nothing): every size is checked before anything is
        sized from it, so a damaged or hostile store is refused instead of dividing by zero or allocating."""
        sizes = {"hidden_size": self.hidden_size, "num_aux_layers": self.num_aux_layers,
                 "chunk_tokens": self.chunk_tokens}
        sizes.update({f"extra_arrays.{name}.width": extra.width for name, extra in self.extra_arrays.items()})
        for name, value in sizes.items():
            if not _is_int(value) or value <= 0:
                return f"{name} is {value!r}, not a positive whole number"
        for name in ("shard_tokens", "num_samples", "num_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                return f"{name} is {value!r}, not a whole number of at least 0"
        if self.format_version >= STORE_FORMAT_VERSION and not self.sharded:
            return f"shard_tokens is 0, but a format-{self.format_version} store is sharded"
        if self.shard_tokens % self.chunk_tokens:
            return f"shard_tokens {self.shard_tokens} is not a multiple of chunk_tokens {self.chunk_tokens}"
        try:
            for name in self.array_names:
                self.storage_dtype(name)
        except (ValueError, TypeError, KeyError) as exc:
            return f"the dtype of {name} is not one h5feed stores ({exc})"
        if self.precision not in ("exact", "fp8"):
            return f"precision is {self.precision!r}, not 'exact' or 'fp8'"
        if self.fp8:  # read as bfloat16, from FP8 sources or quantized from full-precision ones
            fits = (self.format_version == FP8_FORMAT_VERSION and self.dtype == "bfloat16"
                    and self.quantized_from in ("", "bfloat16", "float16", "float32"))
        else:
            fits = (self.format_version < FP8_FORMAT_VERSION and self.dtype != "float8_e4m3fn"
                    and not self.quantized_from)
        if not fits:
            return (f"precision {self.precision!r}, format {self.format_version}, dtype {self.dtype} and "
                    f"quantized_from {self.quantized_from!r} do not go together")
        return None

    def max_chunk_nbytes(self, name: str) -> int:
        """The most bytes one stored inner chunk of array `name` can take: its rows, Blosc's header and copy
        fallback, and the crc32c.  Reads are bounded by it, whatever a shard index or a file's size claims."""
        return self.chunk_tokens * self.row_nbytes(name) + BLOSC_MAX_OVERHEAD + CRC_BYTES

    def max_object_nbytes(self, name: str) -> int:
        """The most bytes one stored object (shard, or in format 1 chunk) of array `name` can take."""
        if not self.sharded:
            return self.max_chunk_nbytes(name)
        return self.chunks_per_shard * self.max_chunk_nbytes(name) + shard_index_nbytes(self.chunks_per_shard)

    def to_json(self) -> dict[str, Any]:
        """The attributes; a format-2 store's are exactly what format 2 wrote (no format-3 or format-4 keys)."""
        attrs = {k: v for k, v in self.__dict__.items() if k not in _LATER_DEFAULTS or v != _LATER_DEFAULTS[k]}
        attrs["codec"] = self.codec.to_json()
        attrs["skipped"] = [skipped.to_json() for skipped in self.skipped]
        if "extra_arrays" in attrs:
            attrs["extra_arrays"] = {name: extra.record() for name, extra in self.extra_arrays.items()}
        if "companions" in attrs:
            attrs["companions"] = {name: kept.to_json() for name, kept in self.companions.items()}
        return attrs

    @classmethod
    def from_json(cls, attrs: dict[str, Any]) -> StoreInfo:
        """The attributes as they are stored, their parts typed; TypeError for attributes that are not a store's
        (`problem` then says what is impossible in those that are)."""
        parts: dict[str, Any] = {}
        if "codec" in attrs:
            parts["codec"] = ChunkCodec.from_json(attrs["codec"])
        if "skipped" in attrs:
            parts["skipped"] = [SkippedFile.from_json(s) for s in _of_type(attrs["skipped"], list, "skipped")]
        if "extra_arrays" in attrs:
            parts["extra_arrays"] = {name: _extra_array(name, spec) for name, spec in
                                     _of_type(attrs["extra_arrays"], dict, "extra_arrays").items()}
        if "companions" in attrs:
            parts["companions"] = {name: KeptCompanion.from_json(record) for name, record in
                                   _of_type(attrs["companions"], dict, "companions").items()}
        return cls(**{**attrs, **parts})


_FORMAT_3_DEFAULTS: dict[str, Any] = {"has_last_state": True, "ids_shifted": False, "extra_arrays": {},
                                      "source_info": {}, "companions": {}}
_LATER_DEFAULTS: dict[str, Any] = {**_FORMAT_3_DEFAULTS, "precision": "exact", "quantized_from": ""}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _of_type(value: Any, kind: type, name: str) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"{name} is {value!r}, not a {kind.__name__}")
    return value


def _extra_array(name: str, spec: Any) -> ExtraArray:
    """An optional array as `extra_arrays` records it ({"dtype", "width"}); its sizes and dtype are checked by
    `StoreInfo.problem`, which says what is wrong with them."""
    if not isinstance(spec, dict):
        raise TypeError(f"extra_arrays.{name} is {spec!r}, not its dtype and width")
    return ExtraArray(name, spec.get("dtype"), spec.get("width"))


def chunk_codec(codec: str) -> ChunkCodec:
    """The Blosc configuration (zarr v3 names) of a `--codec` name."""
    if codec == "zstd":
        return ChunkCodec("blosc", cname="zstd", clevel=1, shuffle="shuffle", blocksize=1 << 20)
    if codec == "lz4":
        return ChunkCodec("blosc", cname="lz4", clevel=5, shuffle="bitshuffle", blocksize=1 << 20)
    if codec == "none":
        return ChunkCodec("none")
    raise ValueError(f"unknown codec {codec!r}: choose zstd, lz4 or none")


def object_key(info: StoreInfo, name: str, block: int) -> str:
    """Where zarr v3's default key encoding puts block `block` of the token axis of array `name`:
    a shard in format 2, a chunk in format 1."""
    return f"{name}/c/{block}/0" if info.is_matrix(name) else f"{name}/c/{block}"


def create_arrays(dst: Path, info: StoreInfo, total_rows: int) -> None:
    """Create the group and its empty token arrays with zarr-python, so any Zarr v3 reader can open them."""
    import zarr

    group = zarr.open_group(dst, mode="a", attributes={ATTRS_KEY: info.to_json()})  # emptied first, but for the lock
    rows = max(total_rows, 1)
    for name in info.array_names:
        width = info.width(name)
        dtype = info.storage_dtype(name)
        matrix = info.is_matrix(name)
        shape = (rows, width) if matrix else (rows,)
        inner = (info.chunk_tokens, width) if matrix else (info.chunk_tokens,)
        outer = (info.shard_tokens, width) if matrix else (info.shard_tokens,)
        group.create_array(name, shape=shape, shards=outer, chunks=inner, dtype=str(dtype).removeprefix("torch."),
                           compressors=_zarr_compressors(info.codec, dtype.itemsize), fill_value=0)


def _zarr_compressors(codec: ChunkCodec, itemsize: int) -> list[Any]:
    from zarr.codecs import BloscCodec, Crc32cCodec

    config = codec.to_json()
    blosc = [BloscCodec(typesize=itemsize, **config)] if config.pop("name") == "blosc" else []
    return [*blosc, Crc32cCodec()]


def frame_encoder(codec: ChunkCodec, itemsize: int) -> Callable[[np.ndarray], bytes]:
    """Encode one inner chunk's rows as zarr's pipeline does before the checksum: little-endian bytes, then Blosc."""
    if codec.name == "none":
        return lambda chunk: chunk.tobytes()
    shuffles = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
    from numcodecs import Blosc

    blosc_codec = Blosc.from_config({"cname": codec.cname, "clevel": codec.clevel, "blocksize": codec.blocksize,
                                     "shuffle": shuffles[codec.shuffle], "typesize": itemsize})
    return lambda chunk: bytes(blosc_codec.encode(chunk))


def chunk_encoder(codec: ChunkCodec, itemsize: int) -> Callable[[np.ndarray], bytes]:
    """Encode one inner chunk exactly as zarr's pipeline does: the frame, then its crc32c."""
    encode = frame_encoder(codec, itemsize)
    return lambda chunk: with_crc32c(encode(chunk))


def with_crc32c(data: bytes) -> bytes:
    """zarr's crc32c codec: the bytes, then their crc32c as 4 little-endian bytes."""
    return data + crc32c(data).to_bytes(CRC_BYTES, "little")


def encode_shard(inner_chunks: list[bytes | None]) -> bytes:
    """A shard as zarr's sharding codec writes it: the inner chunks, then their index (index_location "end")."""
    index = np.full((len(inner_chunks), 2), EMPTY, dtype="<u8")
    offset = 0
    for j, chunk in enumerate(inner_chunks):
        if chunk is not None:
            index[j] = (offset, len(chunk))
            offset += len(chunk)
    return b"".join([c for c in inner_chunks if c is not None] + [with_crc32c(index.tobytes())])


def shard_index_nbytes(chunks_per_shard: int) -> int:
    return chunks_per_shard * 16 + CRC_BYTES


def decode_shard_index(
    tail: bytes | memoryview, chunks_per_shard: int, shard_nbytes: int, max_chunk_nbytes: int | None = None
) -> np.ndarray:
    """The [chunks, 2] (offset, length) table at the end of a shard, checked: ValueError if damaged.

    Every present chunk lies inside the shard's body (checked so that no offset near 2^64 can wrap the
    sum), and, given `max_chunk_nbytes`, is no longer than a chunk can be: a read never takes more."""
    if len(tail) != shard_index_nbytes(chunks_per_shard) or shard_nbytes < len(tail):
        raise ValueError(f"shard of {shard_nbytes} bytes is too short for an index of {chunks_per_shard} chunks")
    body = tail[:-CRC_BYTES]
    check_crc32c(body, tail[-CRC_BYTES:], "shard index")
    index = np.frombuffer(body, dtype="<u8").reshape(chunks_per_shard, 2)
    present = index[:, 0] != EMPTY
    offsets, lengths = index[present, 0], index[present, 1]
    body_nbytes = np.uint64(shard_nbytes - len(tail))
    if np.any(offsets > body_nbytes) or np.any(lengths > body_nbytes - offsets) or np.any(lengths <= CRC_BYTES):
        raise ValueError("shard index points outside the shard")
    if max_chunk_nbytes is not None and np.any(lengths > max_chunk_nbytes):
        k = int(np.flatnonzero(present)[np.argmax(lengths > max_chunk_nbytes)])
        raise ValueError(f"shard index gives inner chunk {k} {int(index[k, 1])} bytes, more than a chunk of this "
                         f"array can take ({max_chunk_nbytes})")
    return index


def check_crc32c(data: bytes | memoryview, stored: bytes | memoryview, what: str) -> None:
    computed = crc32c(data)
    expected = int.from_bytes(stored, "little")
    if computed != expected:
        raise ValueError(f"{what} fails its checksum (crc32c {computed:#010x}, stored {expected:#010x})")


def crc32c(data: Any, crc: int = 0) -> int:
    """crc32c of a buffer's bytes (hardware-accelerated), continuing `crc`: data can be checked in pieces."""
    import crc32c as _crc32c

    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return int(_crc32c.crc32c(data, crc))


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    """crc32c of each tensor's bytes: the per-sample checksums recorded at conversion."""
    return [crc32c(tensor.contiguous().numpy()) for tensor in tensors]


@dataclass(frozen=True)
class Commit:
    """What the root of a store that `open_writer` writers share in a bucket says of its last commit.

    Why: there the root is the single object a commit changes in place (a PUT on the ETag read at the step's
    start), so the index it publishes cannot be rewritten in place, where a writer that lost the race could
    still overwrite it; each publication writes its index under a fresh prefix (`index`), which the root
    names.  `seq` counts commits (each changes the root, so two writers never both commit on one state);
    `token` tells a writer whether a commit whose answer it lost went in.  A root without one (a local store,
    a converter's, a bucket store of an earlier h5feed) has its index at `DEFAULT_INDEX`."""

    seq: int = 0
    index: str = DEFAULT_INDEX  # the index group's path in the store
    by: str | None = None  # the writer id that committed it, for messages
    token: str = ""

    @classmethod
    def of_root(cls, root: Mapping[str, Any]) -> Commit:
        """The commit a root's metadata (its zarr.json, parsed) records; the default when it records none."""
        recorded = root.get("attributes", {}).get(COMMIT_KEY) if isinstance(root, Mapping) else None
        try:
            commit = cls(**recorded)
        except TypeError:
            return cls()
        safe = _is_int(commit.seq) and isinstance(commit.index, str) and commit.index.startswith(DEFAULT_INDEX) and \
            ".." not in commit.index.split("/")
        return commit if safe else cls()

    def to_attributes(self) -> dict[str, Any]:
        return {COMMIT_KEY: {"seq": self.seq, "index": self.index, "by": self.by, "token": self.token}}


# The dtype each index column's rows are checksummed in (`index_digest`); source_path as UTF-8, each ending in NUL.
_INDEX_DIGEST_DTYPES = {"sample_start": "<i8", "sample_length": "<i8", "source_index": "<i8", "checksum": "<u4",
                        "has_loss_mask": "u1"}


def index_digest(columns: Mapping[str, Any]) -> int:
    """crc32c of the index rows (`INDEX_COLUMNS`, in order), recorded in the index group's attributes at
    conversion: a row rewritten through zarr (whose chunk checksums it recomputes) no longer matches.  With
    `index/checksum`, whose per-sample crc32c cover exactly `sample_length` rows, it binds each row to its data."""
    crc = 0
    for name in INDEX_COLUMNS:
        if name == "source_path":
            crc = crc32c(("\0".join(columns[name]) + "\0").encode("utf-8", "surrogatepass"), crc)
        else:
            crc = crc32c(np.asarray(columns[name]).astype(_INDEX_DIGEST_DTYPES[name], copy=False), crc)
    return crc


@dataclass(frozen=True)
class IndexDigest:
    """The `index_digest` of the first `rows` index rows, kept in the index group's attributes (so readers of
    format 2 and 3 read such a store unchanged; a store converted before it has none, and is not checked)."""

    rows: int
    crc32c: int

    @classmethod
    def of(cls, columns: Mapping[str, Any]) -> IndexDigest:
        return cls(len(columns["sample_length"]), index_digest(columns))

    def to_attributes(self) -> dict[str, Any]:
        return {ATTRS_KEY: {"rows": self.rows, "crc32c": self.crc32c}}

    @classmethod
    def from_attributes(cls, attributes: Mapping[str, Any]) -> IndexDigest | None:
        """The recorded digest, or None when there is none (or it is not one: then the index is not checked,
        as a store converted before digests)."""
        recorded = attributes.get(ATTRS_KEY)
        try:
            digest = cls(recorded["rows"], recorded["crc32c"])
        except (TypeError, KeyError):
            return None
        return digest if _is_int(digest.rows) and _is_int(digest.crc32c) else None


def read_info(location: Path | ObjectStore) -> StoreInfo:
    """Read the store's attributes without zarr, with errors that say what is wrong.

    `location` is a local folder, or the store's objects (`h5feed.io.open_url`) wherever they are."""
    from h5feed.io import ObjectNotFound, ObjectStore

    where = location.url if isinstance(location, ObjectStore) else location
    try:
        text = location.get("zarr.json") if isinstance(location, ObjectStore) else (location / "zarr.json").read_bytes()
    except (ObjectNotFound, FileNotFoundError, NotADirectoryError):
        converted = _converted_here(location, "is missing")
        if converted is not None:
            raise StoreError(where, converted) from None
        raise NotAStoreError(where, _not_a_store(location)) from None
    try:
        meta = json.loads(text)
        attrs = meta["attributes"][ATTRS_KEY]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        damaged = _converted_here(location, f"is damaged ({type(exc).__name__})")
        raise StoreError(where, damaged or f"a Zarr group but not an h5feed store ({exc!r})") from exc
    if attrs.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise StoreError(
            where, f"store format version {attrs.get('format_version')} is not one this h5feed reads "
            f"({', '.join(map(str, READABLE_FORMAT_VERSIONS))}); upgrade h5feed or reconvert the store"
        )
    try:
        info = StoreInfo.from_json(attrs)
    except TypeError as exc:
        raise StoreError(where, f"store attributes are damaged ({exc})") from exc
    problem = info.problem()
    if problem is not None:
        raise StoreError(where, f"store attributes are damaged: {problem}; {edited_hint(where)}")
    return info


def _converted_here(location: Path | ObjectStore, what: str) -> str | None:
    """What to say of a local folder whose zarr.json is missing or damaged while the conversion's plan is there
    (None elsewhere): `h5feed repair` writes it again from the plan."""
    from h5feed.store.writer_state import PLAN_FILE

    if not (isinstance(location, Path) and (location / PLAN_FILE).is_file()):
        return None
    return (f"its zarr.json (the store's attributes) {what}: run `h5feed repair {location}` to write it again from "
            f"the conversion's plan ({PLAN_FILE})")


def _not_a_store(location: Path | ObjectStore) -> str:
    """Why a location without zarr.json is no store, in the words that lead to the fix: a path mistyped, or a store
    to create.  A folder of sample files given where their store was meant (a loader pointed at what `h5feed convert`
    reads) is named by the loaders and the CLI, which know the input formats (`h5feed.loading.sample_folder`): the
    store does not."""
    if isinstance(location, Path) and not location.exists():
        return "does not exist: check the path, or create the store with `h5feed convert SRC DST`"
    return "not an h5feed store (no zarr.json); create one with `h5feed convert SRC DST`"


def edited_hint(where: str | Path) -> str:
    """What to say about a store whose own figures disagree."""
    return f"the store is damaged or was edited: run `h5feed verify {where}`, or convert it again"


def write_info(path: Path, info: StoreInfo, *, durable: bool) -> None:
    """Replace the group's attributes in one atomic rename (the status flip readers rely on)."""
    meta_path = path / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"][ATTRS_KEY] = info.to_json()
    write_atomically(meta_path, json.dumps(meta, indent=2).encode(), durable=durable)
