"""What a damaged store's metadata looks like, in words that name the array and the fix.

Why apart from the reader: the reader refuses a store whose arrays' metadata disagrees with its attributes, and
`h5feed convert` and `h5feed repair` find the same damage to say what they will write again; one wording, from
one place, for all three.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from h5feed.store.layout import StoreInfo

REBUILD_HINT = "run the `h5feed convert` command that made the store again to rebuild the index"


def metadata_disagreement(info: StoreInfo, name: str, array: Any) -> str | None:
    """Where the zarr array `name` (opened) disagrees with the store's attributes (row width, dtype, chunk and
    shard shape), or None: the reader refuses such a store, and `h5feed repair` writes the metadata again."""
    width = (info.width(name),) if info.is_matrix(name) else ()
    claimed = {"row width": width, "dtype": str(info.storage_dtype(name)).removeprefix("torch."),
               "chunk shape": (info.chunk_tokens, *width),
               "shard shape": (info.shard_tokens, *width) if info.sharded else None}
    stored = {"row width": tuple(array.shape)[1:], "dtype": str(array.dtype), "chunk shape": tuple(array.chunks),
              "shard shape": tuple(array.shards) if array.shards else None}
    for what, value in claimed.items():
        if value != stored[what]:
            return (f"the store's attributes ({sizes_claimed(info)}) give {name} {what} {plain_figure(value)}, but "
                    f"{name}/zarr.json says {plain_figure(stored[what])}")
    return None


def sizes_claimed(info: StoreInfo) -> str:
    """The sizes the store's attributes claim, as a disagreement with them quotes them."""
    return (f"hidden_size {info.hidden_size}, num_aux_layers {info.num_aux_layers}, chunk_tokens "
            f"{info.chunk_tokens}, shard_tokens {info.shard_tokens}")


def damaged_metadata(name: str, exc: BaseException) -> str:
    """What is wrong with an array whose metadata zarr cannot open, in one short line: the exception's own text
    may quote the whole damaged document."""
    return f"{name}/zarr.json is damaged or missing (zarr cannot open it: {type(exc).__name__})"


def repair_hint(path: Path | str) -> str:
    """What to run on a store whose arrays are damaged."""
    return f"run `h5feed repair {path}` to rebuild it and re-encode damaged samples from their source files"


def plain_figure(value: Any) -> str:
    """A shape or figure as a user reads it: (96,) as 96, (16, 96) as 16 x 96."""
    if isinstance(value, tuple):
        return " x ".join(map(plain_figure, value)) if value else "none"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


def damaged_arrays(path: Path, info: StoreInfo) -> dict[str, str]:
    """The token arrays of the local store `path` whose metadata (`<array>/zarr.json`) zarr cannot open, or which
    disagrees with the store's attributes, each with what is wrong: what `h5feed repair` writes again."""
    import zarr

    problems = {}
    for name in info.array_names:
        try:
            array = zarr.open_array(path / name, mode="r", zarr_format=3)
        except Exception as exc:  # whatever zarr raises on damaged or missing metadata
            problems[name] = damaged_metadata(name, exc)
            continue
        problem = metadata_disagreement(info, name, array)
        if problem is not None:
            problems[name] = problem
    return problems
