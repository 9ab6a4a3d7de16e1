"""Readers of every input format of FORMATS.md, behind one interface.

Each trainer wrote its hidden states its own way (see FORMATS.md): a list of
per-layer tensors in a ``.pt`` (speculators legacy), pre-concatenated tensors
(speculators v0), tensors with a leading batch dim in a possibly gzipped
``.ckpt`` (SpecForge), or ``[T, K+1, H]`` safetensors beside an Arrow dataset
(speculators 0.5+).  The converter should not care: every format here finds its
sample files (``discover``), tells their shape cheaply (``probe``) and reads
them into one standard :class:`SourceSample` (``load``), with errors that name
the file and say what is wrong with it.

Safety: pickles are only ever read with ``torch.load(weights_only=True)``; a
file that needs code to unpickle is refused, never executed.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import threading
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from h5feed.errors import SourceError

__all__ = [
    "FORMATS",
    "FormatName",
    "SampleShape",
    "SourceFile",
    "SourceFormat",
    "SourceSample",
    "detect_format",
]

FormatName = Literal[
    "speculators-legacy-pt", "speculators-v0-pt", "specforge-ckpt", "speculators-safetensors"
]


@dataclass(frozen=True)
class SourceFile:
    """One sample file found under a source root."""

    path: Path  # absolute path of the sample file
    sample_index: int  # the i of data_{i}.pt / data_{i}.ckpt / hs_{i}.safetensors
    relpath: str  # path relative to the source root, '/'-separated (provenance)


@dataclass(frozen=True)
class SampleShape:
    """What a store must allocate for one sample, known before reading its data."""

    num_tokens: int
    hidden_size: int
    num_aux_layers: int
    dtype: torch.dtype


@dataclass
class SourceSample:
    """One sample in the standard layout every format is converted to."""

    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor | None  # int64 [T], None when the file had none
    aux_hidden_states: torch.Tensor  # [T, K*H] model dtype, aux layers in layer order
    last_hidden_state: torch.Tensor  # [T, H] (pre-norm: legacy/safetensors; post-norm: v0/specforge)

    @property
    def shape(self) -> SampleShape:
        """The sample's shape, as ``probe`` would report it."""
        t, h = self.last_hidden_state.shape
        return SampleShape(
            num_tokens=int(t),
            hidden_size=int(h),
            num_aux_layers=int(self.aux_hidden_states.shape[1]) // int(h),
            dtype=self.aux_hidden_states.dtype,
        )


# --------------------------------------------------------------------------- helpers

_MAX_INT64 = 2**63 - 1


def _fmt_shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _walk_files(top: Path):
    """Yield (dirpath, filename) under top, following directory links once (no cycles)."""
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        try:
            st = os.stat(dirpath)
        except OSError:
            dirnames[:] = []
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:  # a link back to a folder already walked
            dirnames[:] = []
            continue
        seen.add(key)
        dirnames.sort()
        for name in filenames:
            yield dirpath, name


def _discover(root: Path, pattern: re.Pattern[str], under: Path | None = None) -> list[SourceFile]:
    """Every file under ``under`` (default root) whose name matches ``pattern`` (group 1 = index)."""
    root = Path(os.path.abspath(root))
    top = root if under is None else under
    found: list[SourceFile] = []
    if top.is_dir():
        for dirpath, name in _walk_files(top):
            m = pattern.fullmatch(name)
            if m is None:
                continue
            path = Path(dirpath) / name
            if not path.is_file():
                continue
            found.append(SourceFile(path, int(m.group(1)), path.relative_to(root).as_posix()))
    found.sort(key=lambda s: (s.sample_index, s.relpath))
    return found


def _check_root(root: Path) -> Path:
    root = Path(root)
    if not root.exists():
        raise SourceError(root, "does not exist")
    if not root.is_dir():
        raise SourceError(root, "is not a directory (a source is the folder that holds the sample files)")
    return root


_WEIGHTS_UNPICKLER_LINE = re.compile(r"WeightsUnpickler error:\s*(.+)")
_GLOBAL_NAME = re.compile(r"GLOBAL\s+([\w.]+)")


def _load_error(path: Path, exc: BaseException) -> SourceError:
    """Turn whatever torch.load raised into a SourceError that says what went wrong."""
    msg = str(exc)
    if "Weights only load failed" in msg:
        needs_code = "Unsupported global" in msg or "This file can still be loaded" in msg
        if needs_code:
            m = _GLOBAL_NAME.search(msg)
            what = f" ({m.group(1)})" if m else ""
            return SourceError(
                path,
                "refusing to load: the pickle needs code to run (h5feed always loads with "
                f"weights_only=True); it references a class or function{what} that is not a "
                "tensor or plain container; re-save it holding only tensors, lists and dicts",
            )
        m = _WEIGHTS_UNPICKLER_LINE.search(msg)
        detail = m.group(1).strip() if m else msg.splitlines()[0]
    else:
        detail = msg.splitlines()[0] if msg else "unexpected end of file"
    return SourceError(path, f"not a readable torch.save file (truncated or corrupt): {type(exc).__name__}: {detail}")


_ZIP_MAGIC = b"PK\x03\x04"


def _torch_load_path(path: Path) -> Any:
    """torch.load a .pt/.ckpt: memory-mapped when it is a zip (the default since torch 1.6)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise SourceError(path, f"cannot be opened: {e.strerror or e}") from e
    if not magic:
        raise SourceError(path, "empty file (0 bytes): truncated or never written")
    try:
        return torch.load(path, weights_only=True, map_location="cpu", mmap=magic == _ZIP_MAGIC)
    except SourceError:
        raise
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise _load_error(path, e) from e


def _torch_load_gz(path: Path) -> Any:
    """Decompress a .ckpt.gz into memory and torch.load it (weights_only)."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
        raise SourceError(
            path, f"truncated or corrupt gzip file ({type(e).__name__}: {e})"
        ) from e
    if not data:
        raise SourceError(path, "gzip file holds 0 bytes: truncated or never written")
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:
        raise _load_error(path, e) from e


def _require_dict(path: Path, obj: Any) -> dict:
    if not isinstance(obj, dict):
        raise SourceError(path, f"not a dict: the file holds a {type(obj).__name__}, expected a dict of tensors")
    return obj


def _require_keys(path: Path, d: dict, keys: tuple[str, ...], fmt: str) -> None:
    missing = [k for k in keys if k not in d]
    if missing:
        found = ", ".join(repr(k) for k in d.keys())
        raise SourceError(
            path,
            f"missing key(s) {', '.join(repr(k) for k in missing)} for format {fmt} "
            f"(found keys: {found or 'none'})",
        )


def _tensor(path: Path, d: dict, key: str, what: str | None = None) -> torch.Tensor:
    v = d[key]
    label = what or repr(key)
    if not isinstance(v, torch.Tensor):
        raise SourceError(path, f"{label} is a {type(v).__name__}, expected a tensor")
    return v


def _token_vector(path: Path, d: dict, key: str, allow_batch_dim: bool = False) -> torch.Tensor:
    """The token ids: an integer tensor [T] (or [1, T] where allowed), T >= 1."""
    v = d[key]
    if isinstance(v, (list, tuple)):
        try:
            v = torch.as_tensor(v)
        except (TypeError, ValueError, RuntimeError) as e:
            raise SourceError(path, f"{key!r} is a list that is not a flat list of integers ({e})") from e
    if not isinstance(v, torch.Tensor):
        raise SourceError(path, f"{key!r} is a {type(v).__name__}, expected an integer tensor [T]")
    if not _is_integer_dtype(v.dtype):
        raise SourceError(path, f"{key!r} has dtype {v.dtype}; token ids must be an integer dtype")
    if allow_batch_dim and v.dim() == 2 and v.shape[0] == 1:
        v = v[0]
    if v.dim() != 1:
        want = "[T] or [1, T]" if allow_batch_dim else "[T]"
        raise SourceError(path, f"{key!r} must be 1-D {want}, got shape {_fmt_shape(v)}")
    if v.shape[0] == 0:
        raise SourceError(path, f"empty sample: {key!r} has 0 tokens")
    return v


def _mask_vector(path: Path, d: dict, key: str, num_tokens: int, allow_batch_dim: bool = False) -> torch.Tensor | None:
    """The loss mask: None when missing or None, else an integer/bool tensor [T]."""
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, (list, tuple)):
        try:
            v = torch.as_tensor(v)
        except (TypeError, ValueError, RuntimeError) as e:
            raise SourceError(path, f"{key!r} is a list that is not a flat list of integers ({e})") from e
    if not isinstance(v, torch.Tensor):
        raise SourceError(path, f"{key!r} is a {type(v).__name__}, expected an integer tensor [T] or None")
    if not (_is_integer_dtype(v.dtype) or v.dtype == torch.bool):
        raise SourceError(path, f"{key!r} has dtype {v.dtype}; a loss mask must be integer (0/1) or bool")
    if allow_batch_dim and v.dim() == 2 and v.shape[0] == 1:
        v = v[0]
    if v.dim() != 1:
        raise SourceError(path, f"{key!r} must be 1-D [T], got shape {_fmt_shape(v)}")
    if v.shape[0] != num_tokens:
        raise SourceError(path, f"{key!r} has {v.shape[0]} entries but the sample has {num_tokens} tokens")
    return v


def _hidden(path: Path, t: torch.Tensor, label: str, dims: str) -> None:
    if not t.dtype.is_floating_point:
        raise SourceError(path, f"{label} has dtype {t.dtype}; hidden states must be floating point")
    if t.dim() != dims.count(",") + 1:
        raise SourceError(path, f"{label} must be {dims} ({dims.count(',') + 1}-D), got shape {_fmt_shape(t)}")


def _ids_to_int64(path: Path, ids: torch.Tensor, key: str) -> torch.Tensor:
    """int64 copy/view of token ids, refusing conversions that would change a value."""
    if ids.dtype == torch.int64:
        return ids.contiguous()
    if ids.dtype == torch.uint64:
        if int(ids.max()) > _MAX_INT64:
            raise SourceError(path, f"{key!r} is uint64 with values above the int64 range; cannot convert losslessly")
    return ids.to(torch.int64).contiguous()


def _mask_to_int64(mask: torch.Tensor | None) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dtype == torch.int64:
        return mask.contiguous()
    return mask.to(torch.int64).contiguous()


@dataclass
class _Checked:
    """A validated sample whose large tensors are not materialized yet."""

    input_ids: torch.Tensor
    ids_key: str
    loss_mask: torch.Tensor | None
    aux: list[torch.Tensor] | torch.Tensor  # list: concatenate along -1
    last: torch.Tensor
    shape: SampleShape

    def materialize(self, path: Path) -> SourceSample:
        if isinstance(self.aux, list):
            aux = torch.cat(self.aux, dim=-1)
        else:
            aux = self.aux.contiguous()
        return SourceSample(
            input_ids=_ids_to_int64(path, self.input_ids, self.ids_key),
            loss_mask=_mask_to_int64(self.loss_mask),
            aux_hidden_states=aux,
            last_hidden_state=self.last.contiguous(),
        )


# --------------------------------------------------------------------------- formats


class SourceFormat(ABC):
    """One input format: finds, probes and reads its sample files."""

    name: FormatName
    last_state_norm: Literal["pre", "post"]

    @abstractmethod
    def discover(self, root: Path) -> list[SourceFile]:
        """Every sample file under root, sorted by (sample_index, relpath)."""

    @abstractmethod
    def probe(self, source: SourceFile) -> SampleShape:
        """The sample's shape, validating keys and shapes without reading the hidden states where possible."""

    @abstractmethod
    def load(self, source: SourceFile) -> SourceSample:
        """The whole sample, validated, in the standard layout."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class _TorchDictFormat(SourceFormat):
    """Formats that are one torch.save dict per sample."""

    _pattern: re.Pattern[str]
    _what: str

    def discover(self, root: Path) -> list[SourceFile]:
        root = _check_root(root)
        found = _discover(root, self._pattern)
        if not found:
            raise SourceError(root, f"no {self._what} files found (searched all sub-folders)")
        return found

    def _read(self, path: Path) -> dict:
        return _require_dict(path, _torch_load_path(path))

    @abstractmethod
    def _check(self, path: Path, d: dict) -> _Checked: ...

    def probe(self, source: SourceFile) -> SampleShape:
        return self._check(source.path, self._read(source.path)).shape

    def load(self, source: SourceFile) -> SourceSample:
        return self._check(source.path, self._read(source.path)).materialize(source.path)


class SpeculatorsLegacyPt(_TorchDictFormat):
    """A: ``data_{i}.pt`` with ``hidden_states`` = list of K+1 [T, H] tensors (last one pre-norm)."""

    name: FormatName = "speculators-legacy-pt"
    last_state_norm: Literal["pre", "post"] = "pre"
    _pattern = re.compile(r"data_(\d+)\.pt")
    _what = "data_{i}.pt"

    def _check(self, path: Path, d: dict) -> _Checked:
        _require_keys(path, d, ("input_ids", "hidden_states"), self.name)
        ids = _token_vector(path, d, "input_ids")
        t = ids.shape[0]
        hs = d["hidden_states"]
        if not isinstance(hs, (list, tuple)):
            raise SourceError(
                path,
                f"'hidden_states' is a {type(hs).__name__}, expected a list of K+1 tensors [T, H] "
                "(K auxiliary layers, then the last layer)",
            )
        if len(hs) < 2:
            raise SourceError(
                path,
                f"'hidden_states' is a list of {len(hs)} tensor(s); expected K+1 >= 2 "
                "(K auxiliary layers, then the last layer)",
            )
        first = None
        for j, h in enumerate(hs):
            label = f"'hidden_states'[{j}]"
            if not isinstance(h, torch.Tensor):
                raise SourceError(path, f"{label} is a {type(h).__name__}, expected a tensor [T, H]")
            _hidden(path, h, label, "[T, H]")
            if h.shape[0] != t:
                raise SourceError(path, f"{label} has {h.shape[0]} tokens but 'input_ids' has {t}")
            if first is None:
                first = h
            elif h.shape[1] != first.shape[1] or h.dtype != first.dtype:
                raise SourceError(
                    path,
                    f"{label} is {_fmt_shape(h)} {h.dtype} but 'hidden_states'[0] is "
                    f"{_fmt_shape(first)} {first.dtype}; every layer must have the same H and dtype",
                )
        assert first is not None
        mask = _mask_vector(path, d, "loss_mask", t)
        shape = SampleShape(t, int(first.shape[1]), len(hs) - 1, first.dtype)
        return _Checked(ids, "input_ids", mask, list(hs[:-1]), hs[-1], shape)


class SpeculatorsV0Pt(_TorchDictFormat):
    """B: ``data_{i}.pt`` with ``hidden_state`` [T, K*H] and ``target`` [T, H] (post-norm)."""

    name: FormatName = "speculators-v0-pt"
    last_state_norm: Literal["pre", "post"] = "post"
    _pattern = re.compile(r"data_(\d+)\.pt")
    _what = "data_{i}.pt"

    def _check(self, path: Path, d: dict) -> _Checked:
        _require_keys(path, d, ("input_ids", "hidden_state", "target"), self.name)
        ids = _token_vector(path, d, "input_ids")
        t = ids.shape[0]
        aux = _tensor(path, d, "hidden_state")
        last = _tensor(path, d, "target")
        _hidden(path, aux, "'hidden_state'", "[T, K*H]")
        _hidden(path, last, "'target'", "[T, H]")
        for label, x in (("'hidden_state'", aux), ("'target'", last)):
            if x.shape[0] != t:
                raise SourceError(path, f"{label} has {x.shape[0]} tokens but 'input_ids' has {t}")
        h = int(last.shape[1])
        if h == 0 or aux.shape[1] % h != 0 or aux.shape[1] == 0:
            raise SourceError(
                path,
                f"'hidden_state' width {aux.shape[1]} is not a positive multiple of the hidden size "
                f"{h} of 'target'; expected [T, K*H]",
            )
        if aux.dtype != last.dtype:
            raise SourceError(path, f"'hidden_state' is {aux.dtype} but 'target' is {last.dtype}; expected one dtype")
        mask = _mask_vector(path, d, "loss_mask", t)
        return _Checked(ids, "input_ids", mask, aux, last, SampleShape(t, h, int(aux.shape[1]) // h, aux.dtype))


class SpecForgeCkpt(_TorchDictFormat):
    """C: SpecForge ``data_{i}.ckpt[.gz]``: ``aux_hidden_state`` [1, T, K*H], ``hidden_state`` [1, T, H] (post-norm)."""

    name: FormatName = "specforge-ckpt"
    last_state_norm: Literal["pre", "post"] = "post"
    _pattern = re.compile(r"data_(\d+)\.ckpt(?:\.gz)?")
    _what = "data_{i}.ckpt or data_{i}.ckpt.gz"

    def _read(self, path: Path) -> dict:
        if path.name.endswith(".gz"):
            return _require_dict(path, _torch_load_gz(path))
        return _require_dict(path, _torch_load_path(path))

    def _check(self, path: Path, d: dict) -> _Checked:
        _require_keys(path, d, ("input_ids", "aux_hidden_state", "hidden_state"), self.name)
        ids = _token_vector(path, d, "input_ids", allow_batch_dim=True)
        t = ids.shape[0]
        aux = _tensor(path, d, "aux_hidden_state")
        last = _tensor(path, d, "hidden_state")
        _hidden(path, aux, "'aux_hidden_state'", "[1, T, K*H]")
        _hidden(path, last, "'hidden_state'", "[1, T, H]")
        for label, x in (("'aux_hidden_state'", aux), ("'hidden_state'", last)):
            if x.shape[0] != 1:
                raise SourceError(path, f"{label} has a leading batch dim of {x.shape[0]}, expected 1 (shape {_fmt_shape(x)})")
            if x.shape[1] != t:
                raise SourceError(path, f"{label} has {x.shape[1]} tokens but 'input_ids' has {t}")
        h = int(last.shape[2])
        if h == 0 or aux.shape[2] == 0 or aux.shape[2] % h != 0:
            raise SourceError(
                path,
                f"'aux_hidden_state' width {aux.shape[2]} is not a positive multiple of the hidden size "
                f"{h} of 'hidden_state'; expected [1, T, K*H]",
            )
        if aux.dtype != last.dtype:
            raise SourceError(path, f"'aux_hidden_state' is {aux.dtype} but 'hidden_state' is {last.dtype}; expected one dtype")
        mask = _mask_vector(path, d, "loss_mask", t, allow_batch_dim=True)
        shape = SampleShape(t, h, int(aux.shape[2]) // h, aux.dtype)
        return _Checked(ids, "input_ids", mask, aux[0], last[0], shape)


# --------------------------------------------------------------------------- D: safetensors + Arrow

_ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_ST_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class _StEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def _read_safetensors_header(path: Path) -> tuple[dict[str, _StEntry], int]:
    """Parse and check a safetensors header; returns the entries and the file size.

    Done by hand (the format is 8 bytes of length + JSON) so that probing reads a
    few hundred bytes, and so that a truncated file is caught by comparing each
    tensor's end with the file size instead of failing later at a random place.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise SourceError(path, f"truncated or not a safetensors file ({size} bytes)")
            n = int.from_bytes(head, "little")
            if n > _ST_MAX_HEADER or 8 + n > size:
                raise SourceError(
                    path,
                    f"truncated or not a safetensors file (header claims {n} bytes, file has {size})",
                )
            raw = f.read(n)
    except OSError as e:
        raise SourceError(path, f"cannot be opened: {e.strerror or e}") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(path, f"corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise SourceError(path, "corrupt safetensors header (not a JSON object)")
    base = 8 + n
    entries: dict[str, _StEntry] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            b, e = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceError(path, f"corrupt or unsupported safetensors entry {key!r}: {info!r} ({exc})") from exc
        numel = 1
        for s in shape:
            numel *= s
        if e - b != numel * dtype.itemsize or b < 0:
            raise SourceError(path, f"corrupt safetensors entry {key!r}: offsets {b}..{e} do not fit shape {list(shape)} {dtype}")
        if base + e > size:
            raise SourceError(
                path,
                f"truncated safetensors file: tensor {key!r} ends at byte {base + e} but the file has {size} bytes",
            )
        entries[key] = _StEntry(dtype, shape, base + b, base + e)
    return entries, size


class _ArrowRows:
    """Read-only, memory-mapped view of an HF ``datasets.save_to_disk`` folder, via pyarrow only.

    speculators 0.5+ (``ArrowDataset``) pairs row i of this dataset with
    ``hidden_states/hs_{i}.safetensors`` and takes ``loss_mask`` and
    ``seq_len`` from the row (``input_ids`` must equal the file's ``token_ids``).
    """

    def __init__(self, root: Path):
        import pyarrow as pa

        self.root = root
        state_path = root / "state.json"
        try:
            state = json.loads(state_path.read_text())
            files = [entry["filename"] for entry in state["_data_files"]]
        except FileNotFoundError as e:
            raise SourceError(
                root,
                "no Arrow dataset here (state.json missing): speculators 0.5+ keeps loss_mask and "
                "seq_len in a datasets.save_to_disk folder beside hidden_states/",
            ) from e
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SourceError(state_path, f"unreadable datasets state.json ({type(e).__name__}: {e})") from e
        if not files:
            raise SourceError(state_path, "lists no _data_files")
        tables = []
        for name in files:
            if "/" in name or "\\" in name or name in ("", ".", ".."):
                raise SourceError(state_path, f"_data_files entry {name!r} is not a plain file name")
            tables.append(self._read_ipc(root / name))
        try:
            self.table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        except pa.ArrowInvalid as e:
            raise SourceError(root, f"the Arrow shards have different schemas ({e})") from e
        self.indices = None
        idx_files = state.get("_indices_data_files")
        if idx_files:
            itab = pa.concat_tables([self._read_ipc(root / entry["filename"]) for entry in idx_files])
            self.indices = itab.column("indices")
        self.num_rows = len(self.indices) if self.indices is not None else self.table.num_rows
        names = set(self.table.column_names)
        self.input_ids = self.table.column("input_ids") if "input_ids" in names else None
        self.loss_mask = self.table.column("loss_mask") if "loss_mask" in names else None
        self.seq_len = self.table.column("seq_len") if "seq_len" in names else None

    @staticmethod
    def _read_ipc(path: Path):
        import pyarrow as pa

        try:
            source = pa.memory_map(str(path), "r")
        except (OSError, pa.ArrowException) as e:
            raise SourceError(path, f"cannot open Arrow file ({e})") from e
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            pass
        try:  # not what save_to_disk writes, but harmless to accept
            return pa.ipc.open_file(source).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise SourceError(path, f"truncated or corrupt Arrow IPC file ({e})") from e

    def _row(self, i: int) -> int:
        if i < 0 or i >= self.num_rows:
            raise IndexError(i)
        return int(self.indices[i].as_py()) if self.indices is not None else i

    @staticmethod
    def _list_at(col, row: int, what: str, path: Path) -> torch.Tensor | None:
        import numpy as np

        scalar = col[row]
        values = scalar.values
        if values is None:
            return None
        arr = values.to_numpy(zero_copy_only=False)
        if arr.dtype.kind not in "iub":
            raise SourceError(path, f"{what} has Arrow type {values.type}; expected integers")
        return torch.from_numpy(np.array(arr, copy=True))

    def lookup(self, i: int, path: Path, full: bool) -> tuple[int | None, torch.Tensor | None, torch.Tensor | None, int | None]:
        """(seq_len, loss_mask, input_ids, loss_mask_length) of row i; ids/mask only when full."""
        try:
            row = self._row(i)
        except IndexError:
            raise SourceError(
                path,
                f"no row {i} in the Arrow dataset at {self.root} ({self.num_rows} rows): "
                "speculators pairs hs_{i}.safetensors with row i",
            ) from None
        seq_len = None
        if self.seq_len is not None:
            v = self.seq_len[row].as_py()
            seq_len = None if v is None else int(v)
        mask = ids = None
        mask_len = None
        if self.loss_mask is not None:
            scalar = self.loss_mask[row]
            mask_len = None if scalar.values is None else len(scalar.values)
            if full:
                mask = self._list_at(self.loss_mask, row, f"'loss_mask' of row {i}", path)
        if full and self.input_ids is not None:
            ids = self._list_at(self.input_ids, row, f"'input_ids' of row {i}", path)
        return seq_len, mask, ids, mask_len


class SpeculatorsSafetensors(SourceFormat):
    """D: speculators 0.5+ ``hidden_states/hs_{i}.safetensors`` ([T, K+1, H], last pre-norm) + Arrow dataset."""

    name: FormatName = "speculators-safetensors"
    last_state_norm: Literal["pre", "post"] = "pre"
    _pattern = re.compile(r"hs_(\d+)\.safetensors")

    def __init__(self) -> None:
        self._arrow: dict[tuple[str, int], _ArrowRows] = {}
        self._lock = threading.Lock()

    def discover(self, root: Path) -> list[SourceFile]:
        root = _check_root(root)
        # Flat hidden_states/ (0.5-0.8) or sharded hidden_states/0000/ (newer): walk it all.
        found = _discover(root, self._pattern, Path(os.path.abspath(root)) / "hidden_states")
        if not found:
            hint = ""
            if _discover(root, self._pattern, Path(os.path.abspath(root))):
                hint = " (hs_*.safetensors files exist elsewhere: pass the folder that holds hidden_states/ and state.json)"
            raise SourceError(root, f"no hidden_states/hs_{{i}}.safetensors files found{hint}")
        self._rows(Path(os.path.abspath(root)))  # fail early when the Arrow dataset is missing
        return found

    @staticmethod
    def _data_root(source: SourceFile) -> Path:
        """The folder of the Arrow dataset: the source root that relpath is relative to."""
        return source.path.parents[len(Path(source.relpath).parts) - 1]

    def _rows(self, root: Path) -> _ArrowRows:
        try:
            stamp = (root / "state.json").stat().st_mtime_ns
        except OSError:
            stamp = -1
        key = (str(root), stamp)
        with self._lock:
            rows = self._arrow.get(key)
            if rows is None:
                rows = _ArrowRows(root)
                self._arrow = {k: v for k, v in self._arrow.items() if k[0] != key[0]}
                self._arrow[key] = rows
            return rows

    def _check(self, source: SourceFile, full: bool):
        path = source.path
        entries, _ = _read_safetensors_header(path)
        missing = [k for k in ("token_ids", "hidden_states") if k not in entries]
        if missing:
            raise SourceError(
                path,
                f"missing key(s) {', '.join(repr(k) for k in missing)} for format {self.name} "
                f"(found keys: {', '.join(repr(k) for k in entries) or 'none'})",
            )
        ids_e, hs_e = entries["token_ids"], entries["hidden_states"]
        if not _is_integer_dtype(ids_e.dtype):
            raise SourceError(path, f"'token_ids' has dtype {ids_e.dtype}; token ids must be an integer dtype")
        if len(ids_e.shape) != 1:
            raise SourceError(path, f"'token_ids' must be 1-D [T], got shape {list(ids_e.shape)}")
        t = ids_e.shape[0]
        if t == 0:
            raise SourceError(path, "empty sample: 'token_ids' has 0 tokens")
        if not hs_e.dtype.is_floating_point:
            raise SourceError(path, f"'hidden_states' has dtype {hs_e.dtype}; hidden states must be floating point")
        if len(hs_e.shape) != 3:
            raise SourceError(path, f"'hidden_states' must be [T, K+1, H] (3-D), got shape {list(hs_e.shape)}")
        if hs_e.shape[0] != t:
            raise SourceError(path, f"'hidden_states' has {hs_e.shape[0]} tokens but 'token_ids' has {t}")
        if hs_e.shape[1] < 2:
            raise SourceError(
                path,
                f"'hidden_states' holds {hs_e.shape[1]} layer(s) (shape {list(hs_e.shape)}); expected "
                "K+1 >= 2 (K auxiliary layers, then the last layer)",
            )
        k, h = hs_e.shape[1] - 1, hs_e.shape[2]
        if h == 0:
            raise SourceError(path, f"'hidden_states' has hidden size 0 (shape {list(hs_e.shape)})")
        seq_len, mask, arrow_ids, mask_len = self._rows(self._data_root(source)).lookup(
            source.sample_index, path, full
        )
        where = f"row {source.sample_index} of the Arrow dataset"
        if seq_len is not None and seq_len != t:
            raise SourceError(path, f"{where} says seq_len={seq_len} but the file holds {t} tokens")
        if mask_len is not None and mask_len != t:
            raise SourceError(path, f"'loss_mask' of {where} has {mask_len} entries but the file holds {t} tokens")
        return entries, SampleShape(t, h, k, hs_e.dtype), mask, arrow_ids

    def probe(self, source: SourceFile) -> SampleShape:
        return self._check(source, full=False)[1]

    def load(self, source: SourceFile) -> SourceSample:
        path = source.path
        entries, shape, mask, arrow_ids = self._check(source, full=True)
        t, k, h = shape.num_tokens, shape.num_aux_layers, shape.hidden_size
        ids_e, hs_e = entries["token_ids"], entries["hidden_states"]
        # Map the file privately and copy each part once, straight into its final
        # contiguous tensor (no intermediate [T, K+1, H] copy).
        try:
            raw = torch.from_file(str(path), shared=False, size=os.path.getsize(path), dtype=torch.uint8)
        except (RuntimeError, OSError) as e:
            raise SourceError(path, f"cannot be memory-mapped ({e})") from e

        def part(e: _StEntry) -> torch.Tensor:
            b = raw[e.start : e.end]
            if e.start % e.dtype.itemsize:
                b = b.clone()  # unaligned: copy to an aligned buffer first
            return b.view(e.dtype).view(e.shape)

        hs = part(hs_e)
        aux = hs[:, :k].contiguous().view(t, k * h)  # one copy (none when T == 1)
        last = hs[:, k].contiguous()
        input_ids = _ids_to_int64(path, part(ids_e), "token_ids")
        if arrow_ids is not None and not torch.equal(arrow_ids.to(torch.int64), input_ids):
            raise SourceError(
                path,
                f"'token_ids' differ from 'input_ids' of row {source.sample_index} of the Arrow dataset "
                "(speculators would skip this sample): the files and the dataset are out of step",
            )
        return SourceSample(input_ids, _mask_to_int64(mask), aux, last)


# --------------------------------------------------------------------------- registry and detection

FORMATS: dict[FormatName, SourceFormat] = {
    f.name: f
    for f in (SpeculatorsLegacyPt(), SpeculatorsV0Pt(), SpecForgeCkpt(), SpeculatorsSafetensors())
}


def detect_format(root: Path) -> SourceFormat:
    """The format of the sample files under root; legacy vs v0 ``.pt`` by the keys of the first file."""
    root = _check_root(Path(root))
    absroot = Path(os.path.abspath(root))
    if _discover(absroot, SpeculatorsSafetensors._pattern, absroot / "hidden_states"):
        return FORMATS["speculators-safetensors"]
    ckpts = _discover(absroot, SpecForgeCkpt._pattern)
    pts = _discover(absroot, SpeculatorsLegacyPt._pattern)
    if ckpts and pts:
        raise SourceError(
            root,
            f"holds both data_{{i}}.pt ({len(pts)}) and data_{{i}}.ckpt[.gz] ({len(ckpts)}) files; "
            "convert each set from its own folder",
        )
    if ckpts:
        return FORMATS["specforge-ckpt"]
    if pts:
        first = pts[0].path
        d = _require_dict(first, _torch_load_path(first))
        if "hidden_states" in d:
            return FORMATS["speculators-legacy-pt"]
        if "hidden_state" in d and "target" in d:
            return FORMATS["speculators-v0-pt"]
        found = ", ".join(repr(k) for k in d.keys()) or "none"
        raise SourceError(
            first,
            f"keys ({found}) match neither speculators legacy ('hidden_states' list) nor "
            "speculators v0 ('hidden_state' + 'target')",
        )
    raise SourceError(
        root,
        "no sample files of any known format found: expected data_{i}.pt, data_{i}.ckpt[.gz] "
        "or hidden_states/hs_{i}.safetensors",
    )
