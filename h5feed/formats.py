"""Readers of every input format of FORMATS.md, behind one interface.

Each trainer wrote its hidden states its own way (see FORMATS.md): a list of
per-layer tensors in a ``.pt`` (speculators legacy), pre-concatenated tensors
(speculators v0), tensors with a leading batch dim in a possibly gzipped
``.ckpt`` (SpecForge), or ``[T, K+1, H]`` safetensors beside an Arrow dataset
(speculators 0.5+).  The converter should not care: every format here finds its
sample files (``scan``, ``discover``), tells their shape cheaply (``probe``) and
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from h5feed.errors import SourceError

__all__ = [
    "FORMATS",
    "Discovery",
    "FormatName",
    "SampleShape",
    "SkippedEntry",
    "SourceFile",
    "SourceFormat",
    "SourceSample",
    "detect_format",
]

FormatName = Literal["speculators-legacy-pt", "speculators-v0-pt", "specforge-ckpt", "speculators-safetensors"]


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
    aux_parts: list[torch.Tensor]  # [T, h_i] each, in layer order: concatenated along -1 they are [T, K*H]
    last_hidden_state: torch.Tensor  # [T, H] (pre-norm: legacy/safetensors; post-norm: v0/specforge)

    def stored_loss_mask(self) -> torch.Tensor:
        """The loss mask as a store keeps it: ones where the file had none (the index records which)."""
        return self.loss_mask if self.loss_mask is not None else torch.ones_like(self.input_ids)

    @property
    def aux_hidden_states(self) -> torch.Tensor:
        """The aux layers concatenated, [T, K*H] (a copy when they are stored as separate layers)."""
        return self.aux_rows(0, len(self.last_hidden_state))

    def aux_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of the aux states, contiguous: the converter builds one chunk at a time
        instead of concatenating the whole sample."""
        parts = [part[start:stop] for part in self.aux_parts]
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0].contiguous()

    @property
    def shape(self) -> SampleShape:
        """The sample's shape, as ``probe`` would report it."""
        t, h = self.last_hidden_state.shape
        return SampleShape(
            num_tokens=int(t),
            hidden_size=int(h),
            num_aux_layers=sum(int(part.shape[1]) for part in self.aux_parts) // int(h),
            dtype=self.aux_parts[0].dtype,
        )


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


def _find_samples(root: Path, top: Path, extensions: tuple[str, ...], pattern: re.Pattern[str], what: str) -> Discovery:
    """The sample files under ``top`` (names matching ``pattern``, group 1 = index), and every entry skipped.

    A file with a sample file's extension whose name does not match is skipped, not
    ignored: ``data_x.pt`` or ``notes.pt`` beside ``data_3.pt`` is most likely a sample
    under a wrong name.  A link to a file that is already a sample is skipped too.
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
            files.append(SourceFile(c.path, int(m.group(1)), rel))
    files.sort(key=lambda s: (s.sample_index, s.relpath))
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


def _load_error(path: Path, exc: BaseException) -> SourceError:
    """Turn whatever torch.load raised into a SourceError that says what went wrong.

    A refusal of torch's weights-only unpickler comes wrapped in advice to retry with
    ``weights_only=False``: h5feed reports the unpickler's own words (the wrapped
    error's context, as torch re-raises ``from None``) and never passes that advice on.
    """
    msg = str(exc)
    if "Weights only load failed" in msg:
        inner = exc.__context__
        words = str(inner) if inner is not None else "refused by torch's weights-only unpickler"
        needs_code = _what_needs_code(words)
        if needs_code:
            return SourceError(
                path,
                "refusing to load: the pickle needs code to run (h5feed always loads with weights_only=True): "
                f"{needs_code}; re-save it holding only tensors, lists and dicts",
            )
        op = _unsupported_opcode(words)
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
        raise _load_error(path, e) from e


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
        raise _load_error(path, e) from e


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

    def materialize(self, path: Path) -> SourceSample:
        return SourceSample(
            input_ids=_ids_to_int64(path, self.input_ids, "input_ids"),
            loss_mask=_mask_to_int64(self.loss_mask),
            aux_parts=list(self.aux) if isinstance(self.aux, list) else [self.aux],
            last_hidden_state=self.last.contiguous(),
        )


# --------------------------------------------------------------------------- formats


class SourceFormat(ABC):
    """One input format: finds, probes and reads its sample files."""

    name: FormatName
    last_state_norm: Literal["pre", "post"]
    _pattern: re.Pattern[str]  # a sample file's name; group 1 is its index
    _what: str  # that name, for messages
    _extensions: tuple[str, ...]  # a file named *{extension} that does not match _pattern is skipped, not ignored
    _folder: str = ""  # where the sample files live under the root ("" = anywhere)

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
        return _find_samples(absroot, absroot / self._folder, self._extensions, self._pattern, self._what)

    def _none_found(self, root: Path) -> SourceError:
        return SourceError(root, f"no {self._what} files found (searched all sub-folders)")

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
    last_state_norm: Literal["pre", "post"] = "pre"
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
    last_state_norm: Literal["pre", "post"] = "post"
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
    last_state_norm: Literal["pre", "post"] = "post"
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
    last_state_norm: Literal["pre", "post"] = "pre"
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


# --------------------------------------------------------------------------- registry and detection

FORMATS: dict[FormatName, SourceFormat] = {
    f.name: f for f in (SpeculatorsLegacyPt(), SpeculatorsV0Pt(), SpecForgeCkpt(), SpeculatorsSafetensors())
}


def _format_by_name(name: FormatName) -> SourceFormat:
    return FORMATS[name]


def _detect_pt_format(root: Path, pts: Discovery, skip_bad: bool) -> SourceFormat:
    """Legacy vs v0 by the keys of the first file that loads.

    A bad file is passed over (probing reports it, or skips it with skip_bad); when
    none of the first 8 loads, the first one's error is raised.  With skip_bad every
    file is tried, and when none loads the error lists what was wrong.
    """
    failed: list[SkippedEntry] = []
    for source in pts.files if skip_bad else pts.files[:8]:
        try:
            d = _require_dict(source.path, _torch_load_path(source.path))
        except SourceError as exc:
            failed.append(SkippedEntry(source.path, source.relpath, exc.problem))
            continue
        if "hidden_states" in d:
            return FORMATS["speculators-legacy-pt"]
        if "hidden_state" in d and "target" in d:
            return FORMATS["speculators-v0-pt"]
        found = ", ".join(repr(k) for k in d) or "none"
        problem = (
            f"keys ({found}) match neither speculators legacy ('hidden_states' list) nor "
            "speculators v0 ('hidden_state' + 'target')"
        )
        if not skip_bad:
            raise SourceError(source.path, problem)
        failed.append(SkippedEntry(source.path, source.relpath, problem))
    if not skip_bad:
        raise failed[0].error()
    raise _nothing_readable(root, sorted(pts.skipped + failed, key=lambda s: s.relpath))


def detect_format(root: Path, skip_bad: bool = False) -> SourceFormat:
    """The format of the sample files under root; legacy vs v0 ``.pt`` by the keys of the first file that loads.

    Entries that cannot be sample files are the chosen format's ``scan``'s business; here
    they count only when no sample file is found at all (then the first is an error, or
    with skip_bad the error lists them).
    """
    root = _check_root(Path(root))
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
        return FORMATS["specforge-ckpt"]
    if pts.files:
        return _detect_pt_format(root, pts, skip_bad)
    skipped = sorted({s.relpath: s for found in searched for s in found.skipped}.values(), key=lambda s: s.relpath)
    if skipped:
        raise _nothing_readable(root, skipped) if skip_bad else skipped[0].error()
    raise SourceError(
        root,
        "no sample files of any known format found: expected data_{i}.pt, data_{i}.ckpt[.gz] "
        "or hidden_states/hs_{i}.safetensors",
    )
