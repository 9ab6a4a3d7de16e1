"""The typed parts of a store's attributes (`StoreInfo`): its chunk codec, the files it skipped, its companions.

Why typed: these parts are read in several places (the converter, the writer, `h5feed repair`, `h5feed
verify`, the readers), and a dict read there by key is a promise nothing checks.  Each is parsed once, by
`StoreInfo.from_json`, and written back by `StoreInfo.to_json`, as the same JSON every h5feed wrote.  The
optional arrays are `ExtraArray`s, which the input formats also hand the converter to say what they keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

CODEC_KEYS = ("name", "cname", "clevel", "shuffle", "blocksize")  # in the order the attributes hold them


@dataclass(frozen=True)
class ChunkCodec:
    """The codec of every inner chunk, as zarr v3 names Blosc's settings (`chunk_codec` makes one from a
    `--codec` name): "blosc" with its compressor, level, shuffle and block size, or "none" (no compression).
    Every chunk is followed by its crc32c either way."""

    name: Literal["blosc", "none"]
    cname: str | None = None
    clevel: int | None = None
    shuffle: str | None = None
    blocksize: int | None = None

    @property
    def compressed(self) -> bool:
        return self.name != "none"

    def to_json(self) -> dict[str, Any]:
        """As the attributes hold it: the settings a Blosc codec has, in zarr's names."""
        return {key: getattr(self, key) for key in CODEC_KEYS if getattr(self, key) is not None}

    @classmethod
    def from_json(cls, codec: Any) -> ChunkCodec:
        if not isinstance(codec, dict) or not set(codec) <= set(CODEC_KEYS) or "name" not in codec:
            raise TypeError(f"codec is {codec!r}, not a chunk codec's settings")
        return cls(**codec)

    def __str__(self) -> str:
        """As messages have always quoted it: the attributes' dict."""
        return str(self.to_json())


@dataclass(frozen=True)
class SkippedFile:
    """A source file a store does not hold, and why: unreadable, changed since converted, still being written,
    or dropped by `h5feed repair` (`h5feed inspect` lists them)."""

    path: str  # relative to the source root, '/'-separated
    problem: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "problem": self.problem}

    @classmethod
    def from_json(cls, record: Any) -> SkippedFile:
        if not isinstance(record, dict) or set(record) != {"path", "problem"}:
            raise TypeError(f"skipped holds {record!r}, not a file's path and problem")
        return cls(record["path"], record["problem"])


@dataclass(frozen=True)
class KeptCompanion:
    """A file the trainer needs beside the samples (a vocabulary mapping, NeMo's target embeddings), as the
    conversion recorded it: its path in the source folder, its size and crc32c, and where the store keeps its
    copy (None: too large to copy, recorded only)."""

    source: str
    nbytes: int
    crc32c: int
    copy: str | None = None  # relative to the store

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"source": self.source, "bytes": self.nbytes, "crc32c": self.crc32c}
        if self.copy is not None:
            record["copy"] = self.copy
        return record

    @classmethod
    def from_json(cls, record: Any) -> KeptCompanion:
        if not isinstance(record, dict) or not {"source", "bytes", "crc32c"} <= set(record) <= {
                "source", "bytes", "crc32c", "copy"}:
            raise TypeError(f"companions holds {record!r}, not a kept file's record")
        return cls(record["source"], record["bytes"], record["crc32c"], record.get("copy"))


@dataclass(frozen=True)
class ExtraArray:
    """An optional per-token array a format keeps beside the four every store has."""

    name: str
    dtype: str  # torch dtype name
    width: int  # values per token: stored [rows, width], or [rows] when 1

    def record(self) -> dict[str, Any]:
        """As a store's `extra_arrays` attribute keeps it."""
        return {"dtype": self.dtype, "width": self.width}
