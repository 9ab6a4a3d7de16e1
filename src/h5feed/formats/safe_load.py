"""Reading torch.save files without running code: ``torch.load(weights_only=True)``, and errors that say why not.

A file that needs code to unpickle is refused, never executed, and the refusal names what it
would run (read from the pickle's opcodes where torch's unpickler stops before it sees it).
"""

from __future__ import annotations

import gzip
import io
import pickletools
import re
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import torch

from h5feed.errors import SourceError
from h5feed.formats.checks import refuse_unbacked_tensors

__all__ = ["gz_head_dict", "load_torch_dict"]


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


def load_torch_dict(path: Path) -> dict:
    """The dict a ``.pt``/``.ckpt`` (or gzipped ``.ckpt.gz``) file holds, loaded with ``weights_only=True``; a tensor
    in it that claims more values than it holds is refused before anything copies it."""
    obj = (_torch_load_gz if path.name.endswith(".gz") else _torch_load_path)(path)
    if not isinstance(obj, dict):
        raise SourceError(path, f"not a dict: the file holds a {type(obj).__name__}, expected a dict of tensors")
    refuse_unbacked_tensors(path, obj)
    return obj


def gz_head_dict(path: Path) -> dict | None:
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
