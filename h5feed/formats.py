"""Readers of every input format of FORMATS.md, behind one interface.

Each trainer wrote its hidden states its own way (see FORMATS.md): a list of
per-layer tensors in a ``.pt`` (speculators legacy), pre-concatenated tensors
(speculators v0), tensors with a leading batch dim in a possibly gzipped
``.ckpt`` (SpecForge), ``[T, K+1, H]`` safetensors beside an Arrow dataset
(speculators 0.5+), ``<conversation_id>.pt`` dumps (NVIDIA Model-Optimizer),
``rank_*/rows_*/data_{i}.ckpt`` with optional per-token extras (Tencent
AngelSlim), or fixed-length safetensors shards of padded, pre-shifted samples
with the draft-vocab target distribution and no last state (NVIDIA NeMo
Automodel's EAGLE-3 cache).  The key ``hidden_states`` means a list, the last
state or the aux concat depending on the pipeline: formats are told apart by
their companion keys and shapes, not by that key alone.

The converter should not care: every format here finds its sample files (``scan``, ``discover``), tells their shape cheaply (``probe``) and
reads them into one standard :class:`SourceSample` (``load``), with errors that
name the file and say what is wrong with it.

Trust: nothing under a source is passed over in silence.  An entry that may hide
samples (an unreadable folder, a broken or looping link, a link out of the
source, a misnamed ``*.pt``) is an error naming it, or with ``skip_bad`` a
recorded skip.

Safety: pickles are only ever read with ``torch.load(weights_only=True)``; a
file that needs code to unpickle is refused, never executed.
"""

from __future__ import annotations

import errno
import gzip
import io
import json
import os
import pickletools
import re
import stat
import struct
import threading
import zipfile
import zlib
from abc import ABC, abstractmethod
from collections.abc import Collection
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Literal

import torch

from h5feed.errors import SourceError
from h5feed.io.paths import regular_file
from h5feed.store.layout import LastStateNorm, dtype_name

__all__ = [
    "FORMATS",
    "Companion",
    "Discovery",
    "ExtraArray",
    "FormatName",
    "SampleShape",
    "SkippedEntry",
    "SourceFile",
    "SourceFormat",
    "SourceSample",
    "detect_format",
    "last_state_norm_of",
]

FormatName = Literal[
    "speculators-legacy-pt", "speculators-v0-pt", "specforge-ckpt", "speculators-safetensors",
    "modelopt-pt", "angelslim-ckpt", "nemo-eagle3-cache",
]


@dataclass(frozen=True)
class SourceFile:
    """One sample file found under a source root."""

    path: Path  # absolute path of the sample file
    sample_index: int  # the i of data_{i}.pt / data_{i}.ckpt / hs_{i}.safetensors
    relpath: str  # path relative to the source root, '/'-separated (provenance)


@dataclass(frozen=True)
class ExtraArray:
    """An optional per-token array a format keeps beside the four every store has."""

    name: str
    dtype: str  # torch dtype name
    width: int  # values per token: stored [rows, width], or [rows] when 1

    def record(self) -> dict[str, Any]:
        """As a store's `extra_arrays` attribute keeps it."""
        return {"dtype": self.dtype, "width": self.width}


@dataclass(frozen=True)
class SampleShape:
    """What a store must allocate for one sample, known before reading its data.

    Beyond the sizes: the optional arrays, a format-specific `layout` every sample of
    a store must share (how to rebuild the trainer's item: key order, source shapes),
    and what the file itself says about its last state's norm (None: nothing)."""

    num_tokens: int
    hidden_size: int
    num_aux_layers: int
    dtype: torch.dtype
    extras: tuple[ExtraArray, ...] = ()
    layout: str = ""
    last_state_norm: LastStateNorm | None = None


@dataclass
class SourceSample:
    """One sample in the standard layout every format is converted to."""

    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor | None  # int64 [T], None when the file had none
    aux_parts: list[torch.Tensor]  # [T, h_i] each, in layer order: concatenated along -1 they are [T, K*H]
    last_hidden_state: torch.Tensor | None  # [T, H] (pre- or post-norm: see the format); None: not stored (NeMo)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # [T, width] or [T], in `ExtraArray` order
    hidden_size: int = 0  # H, when there is no last state to tell it
    layout: str = ""
    last_state_norm: LastStateNorm | None = None

    def stored_loss_mask(self) -> torch.Tensor:
        """The loss mask as a store keeps it: ones where the file had none (the index records which)."""
        return self.loss_mask if self.loss_mask is not None else torch.ones_like(self.input_ids)

    @property
    def aux_hidden_states(self) -> torch.Tensor:
        """The aux layers concatenated, [T, K*H] (a copy when they are stored as separate layers)."""
        return self.aux_rows(0, len(self.input_ids))

    def aux_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of the aux states, contiguous: the converter builds one chunk at a time
        instead of concatenating the whole sample."""
        parts = [part[start:stop] for part in self.aux_parts]
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0].contiguous()

    @property
    def shape(self) -> SampleShape:
        """The sample's shape, as ``probe`` would report it."""
        h = int(self.last_hidden_state.shape[1]) if self.last_hidden_state is not None else self.hidden_size
        return SampleShape(
            num_tokens=len(self.input_ids),
            hidden_size=h,
            num_aux_layers=sum(int(part.shape[1]) for part in self.aux_parts) // h,
            dtype=self.aux_parts[0].dtype,
            extras=tuple(ExtraArray(k, dtype_name(v.dtype), int(v.shape[1]) if v.dim() == 2 else 1)
                         for k, v in self.extras.items()),
            layout=self.layout,
            last_state_norm=self.last_state_norm,
        )


@dataclass(frozen=True)
class Companion:
    """A file beside the samples that the trainer needs too (a vocab mapping, a cache manifest).

    `copy`: kept in the store, byte for byte (small, and gone with the source);
    otherwise only its size and crc32c are recorded (large, and rebuilt from the model)."""

    path: Path
    relpath: str
    copy: bool


# --------------------------------------------------------------------------- helpers


def _fmt_shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


# --------------------------------------------------------------------------- discovery


@dataclass(frozen=True)
class SkippedEntry:
    """An entry under a source root that discovery could not use as a sample file, and why."""

    path: Path  # absolute: a file, a symbolic link or a folder
    relpath: str  # relative to the source root, '/'-separated: what a store's ``skipped`` list records
    problem: str

    def error(self) -> SourceError:
        return SourceError(self.path, self.problem)

    def record(self) -> dict[str, str]:
        """The entry as a store's ``skipped`` list keeps it."""
        return {"path": self.relpath, "problem": self.problem}


@dataclass(frozen=True)
class Discovery:
    """What ``SourceFormat.scan`` found under a source root."""

    files: list[SourceFile]  # sorted by (sample_index, relpath)
    skipped: list[SkippedEntry]  # sorted by relpath; empty unless scanned with skip_bad


@dataclass(frozen=True)
class _Candidate:
    """A file with a sample file's extension; a symbolic link keeps its own path, ``real`` is its target."""

    path: Path
    real: str
    is_link: bool


def _relpath(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _broken_link_problem(path: Path, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "is a symbolic link that loops: not followed"
    if exc.errno == errno.ENOENT:
        return f"is a broken symbolic link: its target {os.readlink(path)} does not exist"
    return f"is a symbolic link that cannot be followed ({exc.strerror or exc})"


def _walk(root: Path, top: Path, extensions: tuple[str, ...]) -> tuple[list[_Candidate], list[SkippedEntry]]:
    """Every file under ``top`` named ``*{extension}``, and every entry that may hide sample files.

    Folders are walked where they really are.  A symbolic link is resolved: one that
    leads out of ``top`` is not followed (it could pull in a sibling run's samples);
    one to a folder inside ``top`` adds nothing (that folder is walked itself, so there
    are no cycles and no duplicates); one to a file inside ``top`` is a candidate under
    its own name.  A folder that cannot be listed and a link that cannot be resolved
    (broken, looping) are skipped entries whatever their names: either may hide samples.
    """
    scope = os.path.realpath(top)
    candidates: list[_Candidate] = []
    skipped: list[SkippedEntry] = []

    def skip(path: Path, problem: str) -> None:
        skipped.append(SkippedEntry(path, _relpath(path, root), problem))

    folders = [top]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError as exc:
            if folder == root:
                raise SourceError(root, f"cannot be read ({exc.strerror or exc})") from exc
            skip(folder, f"folder cannot be read ({exc.strerror or exc}): the files in it were not searched")
            continue
        for entry in entries:
            path = Path(entry.path)
            wanted = entry.name.endswith(extensions)
            if entry.is_symlink():
                try:
                    real = os.path.realpath(path, strict=True)
                    mode = os.stat(real).st_mode
                except OSError as exc:
                    skip(path, _broken_link_problem(path, exc))
                    continue
                inside = os.path.commonpath([scope, real]) == scope
                if stat.S_ISDIR(mode):
                    if not inside:
                        skip(path, f"is a symbolic link to the folder {real}, outside {top}: not followed")
                elif wanted:
                    if not inside:
                        skip(path, f"is a symbolic link to {real}, outside {top}: not followed")
                    elif not stat.S_ISREG(mode):
                        skip(path, f"is a symbolic link to {real}, which is not a regular file")
                    else:
                        candidates.append(_Candidate(path, real, is_link=True))
            elif entry.is_dir(follow_symlinks=False):
                folders.append(path)
            elif wanted:
                if entry.is_file(follow_symlinks=False):
                    real = os.path.join(scope, os.path.relpath(path, top))
                    candidates.append(_Candidate(path, real, is_link=False))
                else:
                    skip(path, "is not a regular file (a pipe, socket or device)")
    return candidates, skipped


def _find_samples(
    root: Path, top: Path, extensions: tuple[str, ...], pattern: re.Pattern[str], what: str, numbered: bool = True
) -> Discovery:
    """The sample files under ``top`` (names matching ``pattern``, group 1 = index), and every entry skipped.

    A file with a sample file's extension whose name does not match is skipped, not
    ignored: ``data_x.pt`` or ``notes.pt`` beside ``data_3.pt`` is most likely a sample
    under a wrong name.  A link to a file that is already a sample is skipped too.
    Names that carry no number (``numbered=False``) get their rank in relpath order.
    """
    root = Path(os.path.abspath(root))
    top = Path(os.path.abspath(top))
    if not top.is_dir():
        return Discovery([], [])
    candidates, skipped = _walk(root, top, extensions)
    files: list[SourceFile] = []
    owner: dict[str, str] = {}  # the real path of each sample file -> its relpath
    for c in sorted(candidates, key=lambda c: (c.is_link, c.path)):  # a file under its own name before links to it
        rel = _relpath(c.path, root)
        m = pattern.fullmatch(c.path.name)
        if m is None:
            problem = f"has a sample file's extension but its name does not match {what}"
            skipped.append(SkippedEntry(c.path, rel, problem))
        elif c.real in owner:
            skipped.append(SkippedEntry(c.path, rel, f"is a symbolic link to {owner[c.real]}, already a sample file"))
        else:
            owner[c.real] = rel
            files.append(SourceFile(c.path, int(m.group(1)) if numbered else 0, rel))
    files.sort(key=lambda s: (s.sample_index, s.relpath))
    if not numbered:
        files = [SourceFile(f.path, i, f.relpath) for i, f in enumerate(files)]
    skipped.sort(key=lambda s: s.relpath)
    return Discovery(files, skipped)


def _nothing_readable(root: Path, skipped: list[SkippedEntry]) -> SourceError:
    first = "; ".join(f"{s.relpath}: {s.problem}" for s in skipped[:3])
    return SourceError(root, f"no readable sample files: {len(skipped)} skipped, first problems: {first}")


def _check_root(root: Path) -> Path:
    root = Path(root)
    if not root.exists():
        raise SourceError(root, "does not exist")
    if not root.is_dir():
        raise SourceError(root, "is not a directory (a source is the folder that holds the sample files)")
    return root


# --------------------------------------------------------------------------- torch.load


# Pickle opcodes that run code, and what they do: torch's weights-only unpickler has no
# handler for them and reports them as an "Unsupported operand".
_CODE_OPCODES = {
    "STACK_GLOBAL": "imports a class or function",
    "INST": "imports a class or function and calls it",
    "EXT1": "imports a registered class or function",
    "EXT2": "imports a registered class or function",
    "EXT4": "imports a registered class or function",
    "OBJ": "builds an object of a class",
    "NEWOBJ_EX": "builds an object of a class",
}
_OPCODES = {ord(op.code): op for op in pickletools.opcodes}
_UNSUPPORTED_OPERAND = re.compile(r"Unsupported operand (\d+)")

# How torch's weights-only unpickler (torch/_weights_only_unpickler.py) words its refusal
# of a pickle that needs code, and what that pickle does.
_REFERENCES = "it references {}, a class or function that is not a tensor or plain container"
_NEEDS_CODE = (
    (re.compile(r"GLOBAL (\S+) was not an allowed global"), _REFERENCES),
    (re.compile(r"unsupported GLOBAL (\S+) whose module \S+ is blocked"), _REFERENCES),
    (re.compile(r"call reduce for unrecognized function ([^\n]+)"), "it calls {}, not one of torch's tensor builders"),
    (re.compile(r"Can only create new object for [^\n]+ but got ([^\n]+)"), "it creates an object of {}"),
    (re.compile(r"Can only build [^\n]+ but got ([^\n]+)"), "it sets the state of an object of {}"),
)


def _unsupported_opcode(words: str) -> pickletools.OpcodeInfo | None:
    """The pickle opcode of an "Unsupported operand N" refusal, None for other words or bytes that are no opcode."""
    m = _UNSUPPORTED_OPERAND.fullmatch(words)
    return _OPCODES.get(int(m.group(1))) if m else None


def _what_needs_code(words: str) -> str | None:
    """What a pickle refused by torch's weights-only unpickler does that needs code, or None."""
    for pattern, template in _NEEDS_CODE:
        m = pattern.search(words)
        if m:
            return template.format(m.group(1)[:120])
    op = _unsupported_opcode(words)
    if op is not None and op.name in _CODE_OPCODES:
        return f"it uses the pickle opcode {op.name}, which {_CODE_OPCODES[op.name]}"
    return None


_STRING_OPCODES = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_GET_OPCODES = {"GET", "BINGET", "LONG_BINGET"}
_PUT_OPCODES = {"PUT", "BINPUT", "LONG_BINPUT"}


def _refused_global(pickle: BinaryIO) -> str | None:
    """Why torch's weights-only unpickler refuses one pickle, or None: the first class or function it imports that
    torch does not allow.  Read from its opcodes (pickletools), never unpickled; only the strings pushed and memoized
    are followed, which is enough to name what a GLOBAL, INST or STACK_GLOBAL imports."""
    allowed = {**torch._weights_only_unpickler._get_allowed_globals(),
               **torch._weights_only_unpickler._get_user_allowed_globals()}
    pushed: list[str | None] = []  # what each opcode pushed: a string, or None for anything else
    memo: dict[int, str | None] = {}
    for op, arg, _ in pickletools.genops(pickle):
        if op.name in _STRING_OPCODES:
            pushed.append(arg if isinstance(arg, str) else None)
        elif op.name in _GET_OPCODES:
            pushed.append(memo.get(arg))
        elif op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op.name in _PUT_OPCODES:
            memo[arg] = pushed[-1] if pushed else None
        elif op.name in ("GLOBAL", "INST", "STACK_GLOBAL"):
            module, name = arg.split(" ", 1) if op.name != "STACK_GLOBAL" else (pushed[-2:] + [None, None])[:2]
            full_path = f"{module}.{name}"
            if full_path not in allowed:
                return _REFERENCES.format(full_path.removeprefix("builtins."))
            pushed.append(None)
        elif op.name in ("EXT1", "EXT2", "EXT4"):
            return f"it uses the pickle opcode {op.name}, which {_CODE_OPCODES[op.name]}"
        elif op.stack_after:
            pushed.append(None)
    return None


def _code_in_pickle(loaded: Path | bytes) -> str | None:
    """What a torch.save file that the weights-only unpickler stopped reading early (at a frame of pickle protocol
    4 or 5) needs code for, or None.  The pickle is a zip's data.pkl, or one of the series of pickles an older
    torch.save file begins with (magic number, protocol, system information, the object)."""
    try:
        with open(loaded, "rb") if isinstance(loaded, Path) else io.BytesIO(loaded) as file:
            if zipfile.is_zipfile(file):
                with zipfile.ZipFile(file) as archive:
                    name = next((n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"), None)
                    if name is None:
                        return None
                    with archive.open(name) as pickle:
                        return _refused_global(pickle)
            file.seek(0)
            for _ in range(4):
                refused = _refused_global(file)
                if refused:
                    return refused
    except (OSError, ValueError, EOFError, IndexError, MemoryError, struct.error, zipfile.BadZipFile, AttributeError):
        pass  # damaged past the point torch read (or a length no file holds), or a torch without these tables
    return None


def _load_error(path: Path, exc: BaseException, loaded: Path | bytes) -> SourceError:
    """Turn whatever torch.load raised into a SourceError that says what went wrong; `loaded` is what it loaded.

    A refusal of torch's weights-only unpickler comes wrapped in advice to retry with
    ``weights_only=False``: h5feed reports the unpickler's own words (the wrapped
    error's context, as torch re-raises ``from None``) and never passes that advice on.
    The unpickler stops at the first frame of pickle protocol 4 or 5, before it sees
    what the pickle imports: h5feed then reads the pickle's opcodes itself, so that a
    code-carrying pickle is refused as one whatever its protocol.
    """
    msg = str(exc)
    if "Weights only load failed" in msg:
        inner = exc.__context__
        words = str(inner) if inner is not None else "refused by torch's weights-only unpickler"
        needs_code = _what_needs_code(words)
        op = _unsupported_opcode(words)
        if needs_code is None and op is not None and op.proto > 2:
            needs_code = _code_in_pickle(loaded)
        if needs_code:
            return SourceError(
                path,
                "refusing to load: the pickle needs code to run (h5feed always loads with weights_only=True): "
                f"{needs_code}; re-save it holding only tensors, lists and dicts",
            )
        if op is not None and op.proto > 2:
            return SourceError(
                path,
                f"its pickle uses the opcode {op.name} of pickle protocol {op.proto}, which torch's weights-only "
                "loader cannot read; re-save it with torch.save's default pickle protocol (2)",
            )
        detail = f"UnpicklingError: {words}"
    else:
        detail = f"{type(exc).__name__}: {msg.splitlines()[0] if msg else 'unexpected end of file'}"
    return SourceError(path, f"not a readable torch.save file (truncated or corrupt): {detail}")


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
    if magic == _ZIP_MAGIC and not zipfile.is_zipfile(path):
        raise SourceError(path, "not a readable torch.save file (truncated or corrupt): the zip directory at its end is missing")
    try:
        return torch.load(path, weights_only=True, map_location="cpu", mmap=magic == _ZIP_MAGIC)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise _load_error(path, e, path) from e


def _torch_load_gz(path: Path) -> Any:
    """Decompress a .ckpt.gz into memory and torch.load it (weights_only)."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (EOFError, zlib.error, OSError) as e:  # gzip.BadGzipFile is an OSError
        raise SourceError(path, f"truncated or corrupt gzip file ({type(e).__name__}: {e})") from e
    if not data:
        raise SourceError(path, "gzip file holds 0 bytes: truncated or never written")
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:
        raise _load_error(path, e, data) from e


def _gz_head_dict(path: Path) -> dict | None:
    """The dict of a gzipped torch.save file with shape-only (meta) tensors, from the first KBs of the stream.

    torch.save writes the pickle as the zip's first entry, so a probe need not
    decompress ~100 MB of tensor data (the conversion does that once).  The pickle
    goes through torch's weights-only unpickler, as in `torch.load(weights_only=True)`.
    None, and the caller reads the whole file, when the head is not what this expects.
    """
    try:
        with gzip.open(path, "rb") as f:
            head = f.read(_GZ_HEAD_BYTES)
        if head[:4] != _ZIP_MAGIC or len(head) < 30:
            return None
        name_length, extra_length = struct.unpack("<HH", head[26:30])
        if not head[30 : 30 + name_length].endswith(b"/data.pkl"):
            return None
        unpickler = torch._weights_only_unpickler.Unpickler(io.BytesIO(head[30 + name_length + extra_length :]),
                                                            encoding="utf-8")
        unpickler.persistent_load = _meta_storage  # type: ignore[attr-defined]
        obj = unpickler.load()
    except Exception:  # a damaged head, an unexpected layout, a torch without this unpickler: read it all
        return None
    return obj if isinstance(obj, dict) else None


_GZ_HEAD_BYTES = 1 << 16


def _meta_storage(saved_id: tuple) -> torch.TypedStorage:
    """A storage of the pickled size and dtype that holds no data (tensors rebuilt on it are shape-only)."""
    _, storage_type, _key, _location, numel = saved_id
    dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
    untyped = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
    return torch.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def _require_dict(path: Path, obj: Any) -> dict:
    if not isinstance(obj, dict):
        raise SourceError(path, f"not a dict: the file holds a {type(obj).__name__}, expected a dict of tensors")
    return obj


def _require_keys(path: Path, d: Collection[str], keys: tuple[str, ...], fmt: str) -> None:
    missing = [k for k in keys if k not in d]
    if missing:
        found = ", ".join(repr(k) for k in d)
        raise SourceError(
            path,
            f"missing key(s) {', '.join(repr(k) for k in missing)} for format {fmt} (found keys: {found or 'none'})",
        )


def _tensor(path: Path, d: dict, key: str) -> torch.Tensor:
    v = d[key]
    if not isinstance(v, torch.Tensor):
        raise SourceError(path, f"{key!r} is a {type(v).__name__}, expected a tensor")
    return v


def _vector(path: Path, v: Any, key: str, expected: str) -> torch.Tensor:
    """v as a tensor; a list of integers is converted."""
    if isinstance(v, (list, tuple)):
        try:
            v = torch.as_tensor(v)
        except (TypeError, ValueError, RuntimeError) as e:
            raise SourceError(path, f"{key!r} is a list that is not a flat list of integers ({e})") from e
    if not isinstance(v, torch.Tensor):
        raise SourceError(path, f"{key!r} is a {type(v).__name__}, expected {expected}")
    return v


def _token_vector(path: Path, v: Any, key: str, allow_batch_dim: bool = False) -> torch.Tensor:
    """The token ids: an integer tensor [T] (or [1, T] where allowed), T >= 1."""
    v = _vector(path, v, key, "an integer tensor [T]")
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


def _mask_vector(path: Path, v: Any, key: str, num_tokens: int, allow_batch_dim: bool = False) -> torch.Tensor | None:
    """The loss mask: None when missing or None, else an integer/bool tensor [T]."""
    if v is None:
        return None
    v = _vector(path, v, key, "an integer tensor [T] or None")
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


def _aux_and_last(
    path: Path, d: dict, aux_key: str, last_key: str, t: int, batched: bool
) -> tuple[torch.Tensor, torch.Tensor, SampleShape]:
    """The aux [T, K*H] and last [T, H] tensors of d, each stored as [1, T, ...] when batched."""
    aux, last = _tensor(path, d, aux_key), _tensor(path, d, last_key)
    lead = "[1, T, " if batched else "[T, "
    _hidden(path, aux, repr(aux_key), lead + "K*H]")
    _hidden(path, last, repr(last_key), lead + "H]")
    for key, x in ((aux_key, aux), (last_key, last)):
        if batched and x.shape[0] != 1:
            raise SourceError(
                path, f"{key!r} has a leading batch dim of {x.shape[0]}, expected 1 (shape {_fmt_shape(x)})"
            )
        if x.shape[int(batched)] != t:
            raise SourceError(path, f"{key!r} has {x.shape[int(batched)]} tokens but 'input_ids' has {t}")
    if batched:
        aux, last = aux[0], last[0]
    h = int(last.shape[1])
    if h == 0 or aux.shape[1] == 0 or aux.shape[1] % h != 0:
        raise SourceError(
            path,
            f"{aux_key!r} width {aux.shape[1]} is not a positive multiple of the hidden size "
            f"{h} of {last_key!r}; expected {lead}K*H]",
        )
    if aux.dtype != last.dtype:
        raise SourceError(path, f"{aux_key!r} is {aux.dtype} but {last_key!r} is {last.dtype}; expected one dtype")
    return aux, last, SampleShape(t, h, int(aux.shape[1]) // h, aux.dtype)


def _ids_to_int64(path: Path, ids: torch.Tensor, key: str) -> torch.Tensor:
    """int64 copy/view of token ids, refusing conversions that would change a value."""
    if ids.dtype == torch.uint64:
        as_int64 = ids.contiguous().view(torch.int64)  # same bits: values above 2**63-1 turn negative
        if bool((as_int64 < 0).any()):
            raise SourceError(path, f"{key!r} is uint64 with values above the int64 range; cannot convert losslessly")
        return as_int64
    return ids.to(torch.int64).contiguous()  # every other integer dtype widens without loss


def _mask_to_int64(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask.to(torch.int64).contiguous()


@dataclass
class _Checked:
    """A validated sample, its large tensors as the file holds them (mapped, not copied)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor | None
    aux: list[torch.Tensor] | torch.Tensor  # list: concatenate along -1
    last: torch.Tensor
    shape: SampleShape
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # [T, width] or [T], as the shape lists them

    def materialize(self, path: Path) -> SourceSample:
        return SourceSample(
            input_ids=_ids_to_int64(path, self.input_ids, "input_ids"),
            loss_mask=_mask_to_int64(self.loss_mask),
            aux_parts=list(self.aux) if isinstance(self.aux, list) else [self.aux],
            last_hidden_state=self.last.contiguous(),
            extras={name: tensor.contiguous() for name, tensor in self.extras.items()},
            layout=self.shape.layout,
            last_state_norm=self.shape.last_state_norm,
        )


# --------------------------------------------------------------------------- formats


class SourceFormat(ABC):
    """One input format: finds, probes and reads its sample files."""

    name: FormatName
    last_state_norm: LastStateNorm | None  # None: the files (or the user) say it; see `last_state_norm_of`
    has_last_state = True  # False: the format stores no last hidden state (NeMo's cache)
    ids_shifted = False  # True: input_ids and loss_mask are stored shifted left by one (NeMo's cache)
    _pattern: re.Pattern[str]  # a sample file's name; group 1 is its index
    _what: str  # that name, for messages
    _extensions: tuple[str, ...]  # a file named *{extension} that does not match _pattern is skipped, not ignored
    _folder: str = ""  # where the sample files live under the root ("" = anywhere)
    _numbered = True  # the names carry the sample's index (else: its rank in relpath order)

    def scan(self, root: Path, skip_bad: bool = False) -> Discovery:
        """Every sample file under root and, with skip_bad, every entry that cannot be read as one.

        Without skip_bad the first such entry (an unreadable folder, a broken or
        looping link, a link out of the root, a misnamed file) is a SourceError naming it.
        """
        root = _check_root(root)
        found = self._search(root)
        if found.skipped and not skip_bad:
            raise found.skipped[0].error()
        if not found.files:
            raise _nothing_readable(root, found.skipped) if found.skipped else self._none_found(root)
        return found

    def discover(self, root: Path) -> list[SourceFile]:
        """Every sample file under root, sorted by (sample_index, relpath); an entry that cannot be one is an error."""
        return self.scan(root).files

    def _search(self, root: Path) -> Discovery:
        absroot = Path(os.path.abspath(root))
        return _find_samples(absroot, absroot / self._folder, self._extensions, self._pattern, self._what,
                             self._numbered)

    def _none_found(self, root: Path) -> SourceError:
        return SourceError(root, f"no {self._what} files found (searched all sub-folders)")

    def companions(self, root: Path) -> list[Companion]:
        """Files beside the samples that the store must keep or record (checked here: never unpickled unsafely)."""
        return []

    def source_info(self, root: Path) -> dict[str, Any]:
        """What the source says beyond its samples that a trainer's flavor needs (kept in the store)."""
        return {}

    def source_nbytes(self, source: SourceFile) -> int:
        """Bytes of the source that hold this sample (for the converter's rates)."""
        return source.path.stat().st_size

    @staticmethod
    def file_of(path: Path) -> Path:
        """The file that holds a sample: its path, less the `#row` of a sample inside a shard of several."""
        return path.with_name(path.name.partition("#")[0])

    @abstractmethod
    def probe(self, source: SourceFile) -> SampleShape:
        """The sample's shape, validating keys and shapes without reading the hidden states where possible."""

    @abstractmethod
    def load(self, source: SourceFile) -> SourceSample:
        """The whole sample, validated, in the standard layout."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    def __reduce__(self):
        # Pickle by name, so that sending a format to a worker process neither
        # copies its caches (memory-mapped Arrow tables) nor fails on its lock.
        return (_format_by_name, (self.name,))


class _TorchDictFormat(SourceFormat):
    """Formats that are one torch.save dict per sample."""

    def _read(self, path: Path) -> dict:
        return _require_dict(path, (_torch_load_gz if path.name.endswith(".gz") else _torch_load_path)(path))

    @abstractmethod
    def _check(self, path: Path, d: dict) -> _Checked: ...

    def probe(self, source: SourceFile) -> SampleShape:
        head = _gz_head_dict(source.path) if source.path.name.endswith(".gz") else None
        return self._check(source.path, head if head is not None else self._read(source.path)).shape

    def load(self, source: SourceFile) -> SourceSample:
        return self._check(source.path, self._read(source.path)).materialize(source.path)


class SpeculatorsLegacyPt(_TorchDictFormat):
    """A: ``data_{i}.pt`` with ``hidden_states`` = list of K+1 [T, H] tensors (last one pre-norm)."""

    name: FormatName = "speculators-legacy-pt"
    last_state_norm: LastStateNorm | None = "pre"
    _pattern = re.compile(r"data_(\d+)\.pt")
    _what = "data_{i}.pt"
    _extensions = (".pt",)

    def _check(self, path: Path, d: dict) -> _Checked:
        _require_keys(path, d, ("input_ids", "hidden_states"), self.name)
        ids = _token_vector(path, d["input_ids"], "input_ids")
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
        mask = _mask_vector(path, d.get("loss_mask"), "loss_mask", t)
        return _Checked(ids, mask, list(hs[:-1]), hs[-1], SampleShape(t, int(first.shape[1]), len(hs) - 1, first.dtype))


class SpeculatorsV0Pt(_TorchDictFormat):
    """B: ``data_{i}.pt`` with ``hidden_state`` [T, K*H] and ``target`` [T, H] (post-norm)."""

    name: FormatName = "speculators-v0-pt"
    last_state_norm: LastStateNorm | None = "post"
    _pattern = re.compile(r"data_(\d+)\.pt")
    _what = "data_{i}.pt"
    _extensions = (".pt",)

    def _check(self, path: Path, d: dict) -> _Checked:
        _require_keys(path, d, ("input_ids", "hidden_state", "target"), self.name)
        ids = _token_vector(path, d["input_ids"], "input_ids")
        aux, last, shape = _aux_and_last(path, d, "hidden_state", "target", ids.shape[0], batched=False)
        return _Checked(ids, _mask_vector(path, d.get("loss_mask"), "loss_mask", shape.num_tokens), aux, last, shape)


class SpecForgeCkpt(_TorchDictFormat):
    """C: SpecForge ``data_{i}.ckpt[.gz]``: ``aux_hidden_state`` [1, T, K*H], ``hidden_state`` [1, T, H] (post-norm)."""

    name: FormatName = "specforge-ckpt"
    last_state_norm: LastStateNorm | None = "post"
    _pattern = re.compile(r"data_(\d+)\.ckpt(?:\.gz)?")
    _what = "data_{i}.ckpt or data_{i}.ckpt.gz"
    _extensions = (".ckpt", ".ckpt.gz")

    def _check(self, path: Path, d: dict) -> _Checked:
        _require_keys(path, d, ("input_ids", "aux_hidden_state", "hidden_state"), self.name)
        ids = _token_vector(path, d["input_ids"], "input_ids", allow_batch_dim=True)
        aux, last, shape = _aux_and_last(path, d, "aux_hidden_state", "hidden_state", ids.shape[0], batched=True)
        mask = _mask_vector(path, d.get("loss_mask"), "loss_mask", shape.num_tokens, allow_batch_dim=True)
        return _Checked(ids, mask, aux, last, shape)


# --------------------------------------------------------------------------- D: safetensors + Arrow


@contextmanager
def _open_safetensors(path: Path):
    """``safe_open`` the file, turning the library's errors into SourceErrors that name it.

    Keep the body to safetensors calls and checks: RuntimeError, ValueError and
    TypeError raised in it are reported as a corrupt file too.
    """
    from safetensors import SafetensorError, safe_open  # lazily: the other formats work without it

    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except OSError as e:
        raise SourceError(path, f"cannot be opened: {e.strerror or e}") from e
    except (SafetensorError, RuntimeError, ValueError, TypeError) as e:
        raise SourceError(path, f"truncated or corrupt safetensors file ({type(e).__name__}: {e})") from e


def _st_meta(f: Any, key: str) -> torch.Tensor:
    """A meta tensor with the shape and dtype of tensor ``key`` of an open file: reads none of its data."""
    sl = f.get_slice(key)
    shape = sl.get_shape()
    dtype = (sl[:0] if shape else f.get_tensor(key)).dtype  # an empty slice, or the one value of a 0-D tensor
    return torch.empty(shape, dtype=dtype, device="meta")


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
        self.input_ids, self.loss_mask, self.seq_len = (
            self.table.column(n) if n in names else None for n in ("input_ids", "loss_mask", "seq_len")
        )

    @staticmethod
    def _read_ipc(path: Path):
        import pyarrow as pa

        try:
            source = pa.memory_map(str(path), "r")
        except (OSError, pa.ArrowException) as e:
            raise SourceError(path, f"cannot open Arrow file ({e})") from e
        try:
            return pa.ipc.open_stream(source).read_all()
        except (pa.ArrowException, OSError):
            pass
        try:  # not what save_to_disk writes, but harmless to accept
            return pa.ipc.open_file(source).read_all()
        except (pa.ArrowException, OSError) as e:
            raise SourceError(path, f"truncated or corrupt Arrow IPC file ({e})") from e

    @staticmethod
    def _list_at(col, row: int, what: str, path: Path) -> torch.Tensor | None:
        values = col[row].values
        if values is None:
            return None
        arr = values.to_numpy(zero_copy_only=False)
        if arr.dtype.kind not in "iub":
            raise SourceError(path, f"{what} has Arrow type {values.type}; expected integers")
        return torch.tensor(arr)  # a copy: arr may be a read-only view of the mapped file

    def lookup(
        self, i: int, path: Path, num_tokens: int, full: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(loss_mask, input_ids) of row i, None unless full; checks its seq_len and mask length against the file."""
        if not 0 <= i < self.num_rows:
            raise SourceError(
                path,
                f"no row {i} in the Arrow dataset at {self.root} ({self.num_rows} rows): "
                "speculators pairs hs_{i}.safetensors with row i",
            )
        row = int(self.indices[i].as_py()) if self.indices is not None else i
        where = f"row {i} of the Arrow dataset"
        seq_len = None if self.seq_len is None else self.seq_len[row].as_py()
        if seq_len is not None and int(seq_len) != num_tokens:
            raise SourceError(path, f"{where} says seq_len={seq_len} but the file holds {num_tokens} tokens")
        mask = ids = None
        if self.loss_mask is not None:
            values = self.loss_mask[row].values
            if values is not None and len(values) != num_tokens:
                raise SourceError(
                    path, f"'loss_mask' of {where} has {len(values)} entries but the file holds {num_tokens} tokens"
                )
            if full:
                mask = self._list_at(self.loss_mask, row, f"'loss_mask' of row {i}", path)
        if full and self.input_ids is not None:
            ids = self._list_at(self.input_ids, row, f"'input_ids' of row {i}", path)
        return mask, ids


class SpeculatorsSafetensors(SourceFormat):
    """D: speculators 0.5+ ``hidden_states/hs_{i}.safetensors`` ([T, K+1, H], last pre-norm) + Arrow dataset."""

    name: FormatName = "speculators-safetensors"
    last_state_norm: LastStateNorm | None = "pre"
    _pattern = re.compile(r"hs_(\d+)\.safetensors")
    _what = "hs_{i}.safetensors"
    _extensions = (".safetensors",)
    _folder = "hidden_states"  # flat, or sharded in sub-folders (hidden_states/0000/) by newer speculators

    def __init__(self) -> None:
        self._arrow: dict[tuple[str, int], _ArrowRows] = {}
        self._lock = threading.Lock()

    def scan(self, root: Path, skip_bad: bool = False) -> Discovery:
        found = super().scan(root, skip_bad)
        self._rows(Path(os.path.abspath(root)))  # fail early when the Arrow dataset is missing
        return found

    def _none_found(self, root: Path) -> SourceError:
        absroot = Path(os.path.abspath(root))
        hint = ""
        if _find_samples(absroot, absroot, self._extensions, self._pattern, self._what).files:
            hint = " (hs_*.safetensors files exist elsewhere: pass the folder that holds hidden_states/ and state.json)"
        return SourceError(root, f"no hidden_states/hs_{{i}}.safetensors files found{hint}")

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

    def _file_shape(self, path: Path, f: Any) -> SampleShape:
        """Checks the file's keys, dtypes and shapes from its header alone."""
        _require_keys(path, list(f.keys()), ("token_ids", "hidden_states"), self.name)
        t = _token_vector(path, _st_meta(f, "token_ids"), "token_ids").shape[0]
        hs = _st_meta(f, "hidden_states")
        _hidden(path, hs, "'hidden_states'", "[T, K+1, H]")
        if hs.shape[0] != t:
            raise SourceError(path, f"'hidden_states' has {hs.shape[0]} tokens but 'token_ids' has {t}")
        if hs.shape[1] < 2:
            raise SourceError(
                path,
                f"'hidden_states' holds {hs.shape[1]} layer(s) (shape {_fmt_shape(hs)}); expected "
                "K+1 >= 2 (K auxiliary layers, then the last layer)",
            )
        if hs.shape[2] == 0:
            raise SourceError(path, f"'hidden_states' has hidden size 0 (shape {_fmt_shape(hs)})")
        return SampleShape(t, hs.shape[2], hs.shape[1] - 1, hs.dtype)

    def probe(self, source: SourceFile) -> SampleShape:
        with _open_safetensors(source.path) as f:
            shape = self._file_shape(source.path, f)
        self._rows(self._data_root(source)).lookup(source.sample_index, source.path, shape.num_tokens, full=False)
        return shape

    def load(self, source: SourceFile) -> SourceSample:
        path = source.path
        with _open_safetensors(path) as f:
            shape = self._file_shape(path, f)
            t, k, h = shape.num_tokens, shape.num_aux_layers, shape.hidden_size
            hs = f.get_slice("hidden_states")
            aux, last, ids = hs[:, :k], hs[:, k:], f.get_tensor("token_ids")
        mask, arrow_ids = self._rows(self._data_root(source)).lookup(source.sample_index, path, t, full=True)
        # The slices are views of the library's private (copy-on-write) file mapping, or in
        # older safetensors just these parts read: each part is copied once, straight into
        # its final contiguous tensor, and the [T, K+1, H] block never is.
        aux = aux.contiguous().view(t, k * h)  # no copy when T == 1
        last = last.contiguous().view(t, h)
        input_ids = _ids_to_int64(path, ids, "token_ids")
        if arrow_ids is not None and not torch.equal(arrow_ids.to(torch.int64), input_ids):
            raise SourceError(
                path,
                f"'token_ids' differ from 'input_ids' of row {source.sample_index} of the Arrow dataset "
                "(speculators would skip this sample): the files and the dataset are out of step",
            )
        return SourceSample(input_ids, _mask_to_int64(mask), [aux], last)


# --------------------------------------------------------------------------- E: Model-Optimizer


class ModelOptPt(_TorchDictFormat):
    """E: Model-Optimizer ``<conversation_id>.pt``: ``hidden_states`` [T, H] is the LAST state (not a list), the aux
    concat [T, K*H] is ``aux_hidden_states`` (HF and vLLM dumpers, newer TRT-LLM) or ``hidden_state_features``
    (the TRT-LLM dumper), with ``loss_mask`` [T] (not in the first release) and ``conversation_id``.

    The last state's norm is what a file says (the optional ``hidden_states_prenorm`` flag Model-Optimizer's
    dataset reads; ``hidden_state_features`` marks TRT-LLM, whose capture of the last layer is post-norm) or
    what the user states: the HF dumper writes the post-norm state and the vLLM dumper the pre-norm one, and
    neither says which (see `last_state_norm_of`).
    """

    name: FormatName = "modelopt-pt"
    last_state_norm: LastStateNorm | None = None
    _pattern = re.compile(r"(.+)\.pt")
    _what = "<conversation_id>.pt"
    _extensions = (".pt",)
    _numbered = False
    _aux_keys = ("aux_hidden_states", "hidden_state_features")
    _known_keys = ("input_ids", "hidden_states", *_aux_keys, "loss_mask", "conversation_id", "hidden_states_prenorm")

    def _check(self, path: Path, d: dict) -> _Checked:
        _require_keys(path, d, ("input_ids", "hidden_states"), self.name)
        aux_key = next((k for k in self._aux_keys if k in d), None)
        if aux_key is None:
            raise SourceError(path, f"has neither 'aux_hidden_states' nor 'hidden_state_features' (the aux layers) for "
                              f"format {self.name} (found keys: {', '.join(map(repr, d))})")
        _refuse_unknown_keys(path, d, self._known_keys, self.name)
        if isinstance(d["hidden_states"], (list, tuple)):
            raise SourceError(path, "'hidden_states' is a list, as in a speculators legacy file; in a Model-Optimizer "
                              "dump it is the last hidden state [T, H]")
        ids = _token_vector(path, d["input_ids"], "input_ids", allow_batch_dim=True)
        aux, last, shape = _aux_and_last(path, d, aux_key, "hidden_states", ids.shape[0], batched=False)
        mask = _mask_vector(path, d.get("loss_mask"), "loss_mask", shape.num_tokens)
        _check_conversation_id(path, d.get("conversation_id"))
        return _Checked(ids, mask, aux, last, replace(shape, last_state_norm=_stated_norm(path, d, aux_key)))


def _refuse_unknown_keys(path: Path, d: dict, known: tuple[str, ...], fmt: str) -> None:
    """A key h5feed does not know would be lost in the store: refuse rather than drop it."""
    unknown = [k for k in d if k not in known]
    if unknown:
        raise SourceError(path, f"has key(s) {', '.join(map(repr, unknown))} that format {fmt} does not have; "
                          "h5feed keeps every key the trainer reads and will not drop others in silence")


def _check_conversation_id(path: Path, conversation_id: Any) -> None:
    """Model-Optimizer names each dump `<conversation_id>.pt`: the store keeps the id as that name
    (`index/source_path`), so a renamed file would record a wrong id."""
    if conversation_id is None:
        return
    if isinstance(conversation_id, bool) or not isinstance(conversation_id, (str, int)):
        raise SourceError(path, f"'conversation_id' is a {type(conversation_id).__name__}, expected a string or an int")
    if f"{conversation_id}.pt" != path.name:
        raise SourceError(path, f"'conversation_id' is {conversation_id!r} but the file is named {path.name}: "
                          "Model-Optimizer names each dump <conversation_id>.pt and the store keeps the id as the "
                          "file name, so the two must agree")


def _stated_norm(path: Path, d: dict, aux_key: str) -> LastStateNorm | None:
    flag = d.get("hidden_states_prenorm")
    if isinstance(flag, torch.Tensor) and flag.numel() == 1:
        flag = flag.item()
    if flag is not None:
        if not isinstance(flag, (bool, int)):
            raise SourceError(path, f"'hidden_states_prenorm' is a {type(flag).__name__}, expected a bool")
        return "pre" if flag else "post"
    return "post" if aux_key == "hidden_state_features" else None


# --------------------------------------------------------------------------- F: AngelSlim


# How AngelSlim's backends shape `position_ids`, and how to take it to [T, width] (token-major) and back.
_POSITION_LAYOUTS: dict[tuple[int, ...], str] = {(-1,): "[T]", (1, -1): "[1, T]", (3, -1): "[3, T]",
                                                  (3, 1, -1): "[3, 1, T]"}


def position_ids_to_rows(p: torch.Tensor) -> torch.Tensor:
    """AngelSlim's `position_ids` ([T], [1, T], [3, T] or [3, 1, T]) as token-major rows: [T] or [T, 3]."""
    return p.reshape(-1, p.shape[-1]).t().squeeze(-1) if p.dim() > 1 else p


def position_ids_from_rows(rows: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of `position_ids_to_rows` for the shape `layout` recorded at conversion."""
    t = rows.shape[0]
    planes = rows.reshape(t, -1).t()  # [1 or 3, T]
    return {"[T]": planes[0], "[1, T]": planes, "[3, T]": planes, "[3, 1, T]": planes[:, None, :]}[layout]


class AngelSlimCkpt(_TorchDictFormat):
    """F: AngelSlim ``rank_<r>/rows_<s>-<s+5000>/data_<i>.ckpt``: ``hidden_states`` [1, T, K*H] is the AUX concat,
    ``target_hiddens`` [1, T, H] the last state, ``input_ids`` and ``loss_mask`` [1, T]; the vLLM backend adds
    ``inputs_embeds`` [1, T, H] and ``position_ids`` (possibly None), kept as optional arrays.
    ``vocab_mapping.pt`` beside the rank folders is kept in the store.

    The HF backend's ``target_hiddens`` is post-norm; the vLLM backend's is post-norm unless its norm hook did
    not fire, when it falls back to the pre-norm state and says so only in its log: such files need the
    user's ``--last-state-norm``.
    """

    name: FormatName = "angelslim-ckpt"
    last_state_norm: LastStateNorm | None = None
    _pattern = re.compile(r"data_(\d+)\.ckpt")
    _what = "data_{i}.ckpt"
    _extensions = (".ckpt",)
    _required = ("input_ids", "loss_mask", "hidden_states", "target_hiddens")
    _optional = ("inputs_embeds", "position_ids")  # written by the vLLM backends

    def _check(self, path: Path, d: dict) -> _Checked:
        _require_keys(path, d, self._required, self.name)
        _refuse_unknown_keys(path, d, self._required + self._optional, self.name)
        for key in ("input_ids", "loss_mask"):
            if _tensor(path, d, key).dim() != 2:
                raise SourceError(path, f"{key!r} must be [1, T] as AngelSlim writes it, got shape {_fmt_shape(d[key])}")
        ids = _token_vector(path, d["input_ids"], "input_ids", allow_batch_dim=True)
        aux, last, shape = _aux_and_last(path, d, "hidden_states", "target_hiddens", ids.shape[0], batched=True)
        t = shape.num_tokens
        mask = _mask_vector(path, d["loss_mask"], "loss_mask", t, allow_batch_dim=True)
        layout: dict[str, Any] = {"keys": list(d), "none": [k for k in self._optional if k in d and d[k] is None]}
        extras: dict[str, torch.Tensor] = {}
        embeds = d.get("inputs_embeds")
        if embeds is not None:
            extras["inputs_embeds"] = self._embeddings(path, embeds, d["target_hiddens"])
        positions = d.get("position_ids")
        if positions is not None:
            layout["position_ids"] = self._position_layout(path, positions, t)
            extras["position_ids"] = position_ids_to_rows(positions)
        norm: LastStateNorm | None = "post" if not any(k in d for k in self._optional) else None
        specs = tuple(ExtraArray(k, dtype_name(v.dtype), int(v.shape[1]) if v.dim() == 2 else 1) for k, v in extras.items())
        shape = replace(shape, extras=specs, layout=json.dumps(layout), last_state_norm=norm)
        return _Checked(ids, mask, aux, last, shape, extras)

    @staticmethod
    def _embeddings(path: Path, embeds: Any, last: torch.Tensor) -> torch.Tensor:
        """`inputs_embeds` [1, T, H], in the last state's shape and dtype, as [T, H]."""
        if not isinstance(embeds, torch.Tensor):
            raise SourceError(path, f"'inputs_embeds' is {_describe(embeds)}, expected a tensor [1, T, H] or None")
        if embeds.dim() == 3 and embeds.shape[1] != last.shape[1]:
            raise SourceError(path, f"'inputs_embeds' has {embeds.shape[1]} tokens but 'input_ids' has {last.shape[1]}")
        if embeds.shape != last.shape or embeds.dtype != last.dtype:
            raise SourceError(path, f"'inputs_embeds' is {_fmt_shape(embeds)} {embeds.dtype}; expected "
                              f"{_fmt_shape(last)} {last.dtype}, as 'target_hiddens'")
        return embeds[0]

    @staticmethod
    def _position_layout(path: Path, p: Any, t: int) -> str:
        if not isinstance(p, torch.Tensor) or not _is_integer_dtype(p.dtype) or p.dtype not in (torch.int64, torch.int32):
            raise SourceError(path, f"'position_ids' is {_describe(p)}, expected an int64 or int32 tensor")
        layout = _POSITION_LAYOUTS.get((*p.shape[:-1], -1)) if p.dim() else None
        if layout is None or p.shape[-1] != t:
            raise SourceError(path, f"'position_ids' has shape {_fmt_shape(p)}; expected [T], [1, T], [3, T] or "
                              f"[3, 1, T] with T = {t}")
        return layout

    def companions(self, root: Path) -> list[Companion]:
        path = Path(os.path.abspath(root)) / "vocab_mapping.pt"
        if not path.is_file():
            return []
        mapping = _require_dict(path, _torch_load_path(path))  # a pickle that needs code is refused here
        for key in ("d2t", "t2d"):
            if not isinstance(mapping.get(key), torch.Tensor):
                raise SourceError(path, f"is not AngelSlim's vocab mapping: no tensor {key!r} "
                                  f"(found keys: {', '.join(map(repr, mapping)) or 'none'})")
        return [Companion(path, "vocab_mapping.pt", copy=True)]


def _describe(v: Any) -> str:
    return f"a {v.dtype} tensor" if isinstance(v, torch.Tensor) else f"a {type(v).__name__}"


# --------------------------------------------------------------------------- G: NeMo Automodel EAGLE-3 cache


@dataclass(frozen=True)
class _NemoManifest:
    seq_length: int
    draft_vocab_size: int
    num_samples: int
    shard_size: int
    topk: int  # 0: target_probs stored in full
    hidden_size: int
    num_aux_layers: int
    dtype: torch.dtype
    format_version: int

    @property
    def prob_keys(self) -> tuple[str, ...]:
        return ("target_probs_values", "target_probs_indices") if self.topk else ("target_probs",)


class NemoEagle3Cache(SourceFormat):
    """G: NeMo Automodel's EAGLE-3 cache: ``manifest.json`` and ``shard-NNNNNN.safetensors``, each holding
    ``shard_size`` samples padded to ``seq_length`` S: ``input_ids``, ``loss_mask`` (both shifted left by one
    with a zero fill: token 0 is gone), ``attention_mask``, ``aux_hidden_states`` [S, K*H], ``position_mask``
    [S, 1] and the draft-vocab target distribution, full (``target_probs`` [S, Vd]) or top-k
    (``target_probs_values``, ``target_probs_indices`` [S, k]).  No last hidden state.

    A sample is ``shard-NNNNNN.safetensors#o`` (row o of that shard); its index is its place in the cache.
    Only its real tokens are kept (the right padding NeMo's dataloader added, whose rows the trainer masks
    out): the padding must be exactly what the precompute writes, or the sample is refused.
    """

    name: FormatName = "nemo-eagle3-cache"
    last_state_norm: LastStateNorm | None = None
    has_last_state = False
    ids_shifted = True
    _pattern = re.compile(r"shard-(\d{6})\.safetensors")
    _what = "shard-NNNNNN.safetensors"
    _extensions = (".safetensors",)
    _common_keys = ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "position_mask")

    def __init__(self) -> None:
        self._manifests: dict[tuple[str, int], tuple[_NemoManifest, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    # --- the cache ------------------------------------------------------------------------------
    def _manifest(self, root: Path) -> tuple[_NemoManifest, dict[str, Any]]:
        path = Path(os.path.abspath(root)) / "manifest.json"
        try:
            stamp = path.stat().st_mtime_ns
        except OSError as exc:
            raise SourceError(path, "missing: a NeMo Automodel EAGLE-3 cache has a manifest.json beside its shards") from exc
        with self._lock:
            cached = self._manifests.get((str(path), stamp))
        if cached is None:
            cached = (self._parse_manifest(path), json.loads(path.read_text()))
            with self._lock:
                self._manifests[(str(path), stamp)] = cached
        return cached

    def _parse_manifest(self, path: Path) -> _NemoManifest:
        try:
            m = json.loads(path.read_text())
            version = m.get("format_version")
            if version not in (1, 2):
                raise SourceError(path, f"format_version {version!r} is not a NeMo EAGLE-3 cache version h5feed reads (1, 2)")
            aux_layers = len(m["aux_layer_ids"])
            aux_dim = int(m["aux_hidden_dim"])
            if aux_layers < 1 or aux_dim % aux_layers:
                raise SourceError(path, f"aux_hidden_dim {aux_dim} is not a multiple of the {aux_layers} aux_layer_ids")
            draft_vocab = int(m["draft_vocab_size"])
            topk = int(m.get("target_probs_topk") or 0)
            manifest = _NemoManifest(
                seq_length=int(m["seq_length"]), draft_vocab_size=draft_vocab, num_samples=int(m["num_samples"]),
                shard_size=int(m["shard_size"]), topk=topk if 0 < topk < draft_vocab else 0,
                hidden_size=aux_dim // aux_layers, num_aux_layers=aux_layers, dtype=_NEMO_DTYPES[m["dtype"]],
                format_version=version,
            )
        except SourceError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SourceError(path, f"not a readable NeMo EAGLE-3 cache manifest ({type(exc).__name__}: {exc})") from exc
        if min(manifest.seq_length, manifest.shard_size, manifest.num_samples, manifest.draft_vocab_size) < 1:
            raise SourceError(path, "seq_length, shard_size, num_samples and draft_vocab_size must all be positive")
        return manifest

    def scan(self, root: Path, skip_bad: bool = False) -> Discovery:
        root = Path(os.path.abspath(_check_root(root)))
        manifest, _ = self._manifest(root)
        shards: dict[int, str] = {}
        skipped: list[SkippedEntry] = []
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            m = self._pattern.fullmatch(entry.name)
            if m:
                shards[int(m.group(1))] = regular_file(entry.path).name  # a FIFO would block its reader for ever
            elif entry.name.endswith(".safetensors") and entry.name != _NEMO_EMBEDDINGS:
                skipped.append(SkippedEntry(Path(entry.path), entry.name,
                                            f"has a sample file's extension but its name does not match {self._what}"))
        if skipped and not skip_bad:
            raise skipped[0].error()
        count = -(-manifest.num_samples // manifest.shard_size)
        if sorted(shards) != list(range(count)):
            missing = [f"shard-{s:06d}.safetensors" for s in range(count) if s not in shards]
            extra = [shards[s] for s in sorted(shards) if s >= count]
            raise SourceError(root, f"manifest.json declares {manifest.num_samples} samples in {count} shard(s) of "
                              f"{manifest.shard_size}, but " + (f"{', '.join(missing[:3])} is missing" if missing else
                              f"{', '.join(extra[:3])} is past them") + ": the cache is incomplete or mixed "
                              "(NeMo's reader refuses it too)")
        files = []
        for sample in range(manifest.num_samples):
            member = f"{shards[sample // manifest.shard_size]}#{sample % manifest.shard_size}"
            files.append(SourceFile(root / member, sample, member))
        return Discovery(files, skipped)

    def _search(self, root: Path) -> Discovery:
        absroot = Path(os.path.abspath(root))
        if not (absroot / "manifest.json").is_file():
            return Discovery([], [])
        return self.scan(absroot, skip_bad=True)

    @staticmethod
    def _member(source: SourceFile) -> tuple[Path, int]:
        """(the shard file, the sample's row in it) of ``shard-NNNNNN.safetensors#o``."""
        name, _, row = source.path.name.partition("#")
        if not row.isdigit():
            raise SourceError(source.path, "not a sample of a NeMo cache (expected shard-NNNNNN.safetensors#ROW)")
        return source.path.with_name(name), int(row)

    def _root(self, source: SourceFile) -> Path:
        return source.path.parent

    # --- one sample ------------------------------------------------------------------------------
    def _rows(self, f: Any, path: Path, manifest: _NemoManifest, shard_rows: int) -> None:
        """Checks the shard's keys, dtypes and shapes against the manifest, from its header alone."""
        keys = self._common_keys + manifest.prob_keys
        _require_keys(path, list(f.keys()), keys, self.name)
        s, k = manifest.seq_length, manifest.topk
        want = {"input_ids": ((s,), (torch.int64,)), "attention_mask": ((s,), (torch.int64,)),
                "loss_mask": ((s,), (torch.int64,)),
                "aux_hidden_states": ((s, manifest.hidden_size * manifest.num_aux_layers), (manifest.dtype,)),
                "position_mask": ((s, 1), (torch.bool,)), "target_probs": ((s, manifest.draft_vocab_size), (manifest.dtype,)),
                "target_probs_values": ((s, k), (manifest.dtype,)), "target_probs_indices": ((s, k), (torch.int32,))}
        for key in keys:
            meta = _st_meta(f, key)
            shape, dtypes = want[key]
            if tuple(meta.shape) != (shard_rows, *shape) or meta.dtype not in dtypes:
                raise SourceError(path, f"{key!r} is {_fmt_shape(meta)} {meta.dtype}; the manifest says "
                                  f"[{shard_rows}, {', '.join(map(str, shape))}] {dtypes[0]}")

    def _open(self, source: SourceFile) -> tuple[_NemoManifest, Path, int, int]:
        manifest, _ = self._manifest(self._root(source))
        shard, row = self._member(source)
        rows = min(manifest.shard_size, manifest.num_samples - source.sample_index // manifest.shard_size * manifest.shard_size)
        if not 0 <= row < rows or row != source.sample_index % manifest.shard_size:
            raise SourceError(shard, f"has no sample {row} for sample {source.sample_index} of the cache "
                              f"(it holds {rows} of {manifest.shard_size} per shard)")
        return manifest, shard, row, rows

    def probe(self, source: SourceFile) -> SampleShape:
        manifest, shard, row, rows = self._open(source)
        with _open_safetensors(shard) as f:
            self._rows(f, shard, manifest, rows)
            t = self._real_length(shard, row, f.get_slice("attention_mask")[row])
        return self._shape(manifest, t)

    def load(self, source: SourceFile) -> SourceSample:
        manifest, shard, row, rows = self._open(source)
        with _open_safetensors(shard) as f:
            self._rows(f, shard, manifest, rows)
            d = {key: f.get_slice(key)[row] for key in self._common_keys + manifest.prob_keys}
        t = self._real_length(shard, row, d["attention_mask"])
        self._check_padding(shard, row, d, t, manifest.seq_length)
        extras = {"position_mask": d["position_mask"][:t, 0].contiguous()}
        extras.update({key: d[key][:t].contiguous() for key in manifest.prob_keys})
        return SourceSample(
            input_ids=d["input_ids"][:t].contiguous(), loss_mask=d["loss_mask"][:t].contiguous(),
            aux_parts=[d["aux_hidden_states"][:t].contiguous()], last_hidden_state=None, extras=extras,
            hidden_size=manifest.hidden_size,
        )

    def _shape(self, manifest: _NemoManifest, t: int) -> SampleShape:
        probs = ((ExtraArray("target_probs_values", dtype_name(manifest.dtype), manifest.topk),
                  ExtraArray("target_probs_indices", "int32", manifest.topk)) if manifest.topk else
                 (ExtraArray("target_probs", dtype_name(manifest.dtype), manifest.draft_vocab_size),))
        return SampleShape(t, manifest.hidden_size, manifest.num_aux_layers, manifest.dtype,
                           (ExtraArray("position_mask", "bool", 1), *probs))

    @staticmethod
    def _real_length(shard: Path, row: int, attention_mask: torch.Tensor) -> int:
        """T: the sample's real tokens, from its attention mask (ones, then the right padding's zeros)."""
        t = int(attention_mask.sum())
        if t == 0:
            raise SourceError(shard, f"sample {row} is empty: its attention_mask has no token")
        expected = torch.zeros_like(attention_mask)
        expected[:t] = 1
        if not torch.equal(attention_mask, expected):
            raise SourceError(shard, f"sample {row}'s attention_mask is not {t} ones then zeros (the right padding "
                              "NeMo's precompute writes): h5feed keeps the real tokens only and cannot tell them here")
        return t

    @staticmethod
    def _check_padding(shard: Path, row: int, d: dict[str, torch.Tensor], t: int, s: int) -> None:
        """The dropped rows must be padding the trainer never sees: no loss, no supervised position, and ids
        that the flavor rebuilds exactly (the pad id shifted left by one, then the shift's zero fill)."""
        problems = []
        if bool(d["loss_mask"][t:].any()):
            problems.append("loss_mask is not 0 there")
        if bool(d["position_mask"][t:].any()):
            problems.append("position_mask is not False there")
        ids = d["input_ids"]
        if t < s and (int(ids[s - 1]) != 0 or not bool((ids[t : s - 1] == ids[t - 1]).all())):
            problems.append("input_ids are not the pad id shifted left by one (then 0)")
        if problems:
            raise SourceError(shard, f"sample {row}'s padding (rows {t} to {s}) is not what NeMo's precompute writes: "
                              f"{'; '.join(problems)}; h5feed drops padding only when nothing in it is lost")

    def source_info(self, root: Path) -> dict[str, Any]:
        manifest, raw = self._manifest(root)
        return {"seq_length": manifest.seq_length, "draft_vocab_size": manifest.draft_vocab_size,
                "target_probs_topk": manifest.topk, "manifest_format_version": manifest.format_version,
                "aux_layer_ids": list(raw["aux_layer_ids"])}

    def companions(self, root: Path) -> list[Companion]:
        root = Path(os.path.abspath(root))
        kept = [Companion(root / "manifest.json", "manifest.json", copy=True)]
        if (root / _NEMO_EMBEDDINGS).is_file():  # the target's embedding table, [V, H] fp32: recorded, not copied
            kept.append(Companion(root / _NEMO_EMBEDDINGS, _NEMO_EMBEDDINGS, copy=False))
        return kept

    def source_nbytes(self, source: SourceFile) -> int:
        _, shard, _, rows = self._open(source)
        return shard.stat().st_size // rows


_NEMO_EMBEDDINGS = "target_embeddings.safetensors"
_NEMO_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --------------------------------------------------------------------------- the last state's norm


def last_state_norm_of(
    fmt: SourceFormat, root: Path, shapes: list[tuple[SourceFile, SampleShape]], given: LastStateNorm | None
) -> LastStateNorm | None:
    """The norm of the store's last state: the format's, else what the files say, else what the user
    states (`given`); never a guess.  A file that says otherwise than the user, or than another file,
    is refused, naming it; so is a file that says nothing when the user said nothing."""
    if given not in (None, "pre", "post"):
        raise ValueError(f"last_state_norm must be 'pre' or 'post', not {given!r}")
    if not fmt.has_last_state:
        if given is not None:
            raise SourceError(root, f"--last-state-norm {given} was given, but {fmt.name} stores no last hidden state")
        return None
    if fmt.last_state_norm is not None:
        if given is not None and given != fmt.last_state_norm:
            raise SourceError(root, f"{fmt.name} files hold the {fmt.last_state_norm}-norm last hidden state; "
                              f"--last-state-norm {given} contradicts them")
        return fmt.last_state_norm
    stated: tuple[SourceFile, LastStateNorm] | None = None
    unstated: SourceFile | None = None
    for source, shape in shapes:
        norm = shape.last_state_norm
        if norm is None:
            unstated = unstated or source
        elif given is not None and norm != given:
            raise SourceError(source.path, f"says its last hidden state is {norm}-norm, but --last-state-norm "
                              f"{given} was given")
        elif stated is not None and norm != stated[1]:
            raise SourceError(source.path, f"says its last hidden state is {norm}-norm, but {stated[0].relpath} says "
                              f"{stated[1]}-norm: convert each set into its own store")
        else:
            stated = stated or (source, norm)
    if given is not None:
        return given
    if unstated is not None:
        raise SourceError(unstated.path, "does not say whether its last hidden state is taken before or after the "
                          f"verifier's final norm ({_NORM_HINTS[fmt.name]}): state it with --last-state-norm pre|post "
                          "(Python: last_state_norm='pre' or 'post')")
    assert stated is not None
    return stated[1]


_NORM_HINTS = {
    "modelopt-pt": "Model-Optimizer's HF and TRT-LLM dumpers write the post-norm state and its vLLM dumper the "
                   "pre-norm one; only the optional 'hidden_states_prenorm' flag says which",
    "angelslim-ckpt": "AngelSlim's vLLM backend writes the post-norm state unless its norm hook did not fire, and "
                      "then the pre-norm one, saying so only in its log",
}


# --------------------------------------------------------------------------- registry and detection

FORMATS: dict[FormatName, SourceFormat] = {
    f.name: f
    for f in (SpeculatorsLegacyPt(), SpeculatorsV0Pt(), SpecForgeCkpt(), SpeculatorsSafetensors(), ModelOptPt(),
              AngelSlimCkpt(), NemoEagle3Cache())
}


def _format_by_name(name: FormatName) -> SourceFormat:
    return FORMATS[name]


def _format_of_keys(d: dict, extension: str) -> FormatName | None:
    """The format a sample file's keys say (None: no known one).  ``hidden_states`` is a list in speculators
    legacy, the last state in Model-Optimizer and the aux concat in AngelSlim: the companions decide."""
    if extension == ".pt":
        if isinstance(d.get("hidden_states"), (list, tuple)):
            return "speculators-legacy-pt"
        if "hidden_state" in d and "target" in d:
            return "speculators-v0-pt"
        if "hidden_states" in d and any(k in d for k in ModelOptPt._aux_keys):
            return "modelopt-pt"
        return None
    if "aux_hidden_state" in d:
        return "specforge-ckpt"
    if "target_hiddens" in d:
        return "angelslim-ckpt"
    return None


_KEYS_EXPECTED = {
    ".pt": "speculators legacy ('hidden_states' list), speculators v0 ('hidden_state' + 'target') nor "
           "Model-Optimizer ('hidden_states' + 'aux_hidden_states' or 'hidden_state_features')",
    ".ckpt": "SpecForge ('aux_hidden_state' + 'hidden_state') nor AngelSlim ('hidden_states' + 'target_hiddens')",
}


def _detect_by_keys(root: Path, found: Discovery, extension: str, skip_bad: bool) -> SourceFormat:
    """The format of sample files by the keys of the first one that loads.

    A bad file is passed over (probing reports it, or skips it with skip_bad); when
    none of the first 8 loads, the first one's error is raised.  With skip_bad every
    file is tried, and when none loads the error lists what was wrong.
    """
    failed: list[SkippedEntry] = []
    for source in found.files if skip_bad else found.files[:8]:
        path = source.path
        try:
            head = _gz_head_dict(path) if path.name.endswith(".gz") else None
            d = head if head is not None else _require_dict(path, (_torch_load_gz if path.name.endswith(".gz")
                                                                   else _torch_load_path)(path))
        except SourceError as exc:
            failed.append(SkippedEntry(path, source.relpath, exc.problem))
            continue
        name = _format_of_keys(d, extension)
        if name is not None:
            return FORMATS[name]
        problem = f"keys ({', '.join(repr(k) for k in d) or 'none'}) match neither {_KEYS_EXPECTED[extension]}"
        if not skip_bad:
            raise SourceError(path, problem)
        failed.append(SkippedEntry(path, source.relpath, problem))
    if not skip_bad:
        raise failed[0].error()
    raise _nothing_readable(root, sorted(found.skipped + failed, key=lambda s: s.relpath))


def detect_format(root: Path, skip_bad: bool = False) -> SourceFormat:
    """The format of the sample files under root, by their names, then by the keys of the first file that loads.

    Entries that cannot be sample files are the chosen format's ``scan``'s business; here
    they count only when no sample file is found at all (then the first is an error, or
    with skip_bad the error lists them).  ``.pt`` files not named ``data_{i}.pt`` are
    Model-Optimizer's ``<conversation_id>.pt`` when nothing else is amiss.
    """
    root = _check_root(Path(root))
    if (root / "manifest.json").is_file() and any(FORMATS["nemo-eagle3-cache"]._pattern.fullmatch(p.name)
                                                   for p in root.iterdir()):
        return FORMATS["nemo-eagle3-cache"]
    names: tuple[FormatName, ...] = ("speculators-safetensors", "specforge-ckpt", "speculators-legacy-pt")
    searched = [FORMATS[name]._search(root) for name in names]
    safetensors, ckpts, pts = searched
    if safetensors.files:
        return FORMATS["speculators-safetensors"]
    if ckpts.files and pts.files:
        raise SourceError(
            root,
            f"holds both data_{{i}}.pt ({len(pts.files)}) and data_{{i}}.ckpt[.gz] ({len(ckpts.files)}) files; "
            "convert each set from its own folder",
        )
    if ckpts.files:
        return _detect_by_keys(root, ckpts, ".ckpt", skip_bad)
    if pts.files:
        return _detect_by_keys(root, pts, ".pt", skip_bad)
    skipped = sorted({s.relpath: s for found in searched for s in found.skipped}.values(), key=lambda s: s.relpath)
    dumps = FORMATS["modelopt-pt"]._search(root)
    dump_names = {f.relpath for f in dumps.files}
    if dumps.files and all(s.relpath in dump_names for s in skipped):  # only .pt files that are not data_{i}.pt
        return _detect_by_keys(root, dumps, ".pt", skip_bad)
    if skipped:
        raise _nothing_readable(root, skipped) if skip_bad else skipped[0].error()
    raise SourceError(
        root,
        "no sample files of any known format found: expected data_{i}.pt, data_{i}.ckpt[.gz] or "
        "hidden_states/hs_{i}.safetensors (or Model-Optimizer's <conversation_id>.pt, or a NeMo cache: "
        "manifest.json + shard-NNNNNN.safetensors)",
    )
