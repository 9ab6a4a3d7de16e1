"""The interface every input format implements, and the records it hands the converter.

Every format finds its sample files (``scan``, ``discover``), tells their shape cheaply
(``probe``) and reads them into one standard `SourceSample` (``load``), with errors that name
the file and say what is wrong with it.  It declares how a source of it is told from the
others (`Detection`), which `h5feed.formats.registry.detect_format` asks of every format
registered, so a new format is one module that registers itself (`register_format`).
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, ClassVar

import torch

from h5feed.errors import SourceError
from h5feed.formats.discovery import Discovery, SourceFile, check_root, find_samples, nothing_readable
from h5feed.store.attributes import ExtraArray
from h5feed.store.layout import LastStateNorm, dtype_name

__all__ = ["DEFAULT_LOCK_TIMEOUT_S", "Companion", "Detected", "Detection", "ExtraArray", "SampleShape", "SourceFormat",
           "SourceSample"]

DEFAULT_LOCK_TIMEOUT_S = 60.0  # how long a conversion waits for files their writer still holds locked (vLLM's)



class Detected(IntEnum):
    """What of a source tells `detect_format` that it holds a format's files.  The formats are asked stage by
    stage, in this order, each stage's in the order they registered; the first that finds its files decides."""

    BY_LAYOUT = 1
    """Something only its sources have (`SourceFormat.recognizes`): NeMo's manifest.json beside its shards."""
    BY_FOLDER = 2
    """Its files in a folder of their own (`SourceFormat.folder`): found there, the source is this format's whatever
    lies beside them (speculators' hidden_states/hs_{i}.safetensors)."""
    BY_NAME = 3
    """Its files' names, which only formats that a file's keys tell apart share (`Detection.key_group`): data_{i}.pt.
    Files of two such names in one source are an error: each set converts from its own folder."""
    BY_EXTENSION = 4
    """Any file of its extensions, once no name said more; `SourceFormat.confirm` checks what was found: vLLM's
    {req_id}.safetensors."""
    BY_LEFTOVERS = 5
    """The files the searches by name passed over as misnamed, when every one of them is a file of this format:
    Model-Optimizer's <conversation_id>.pt."""


@dataclass(frozen=True)
class Detection:
    """How `detect_format` tells a source holds a format's files: each format declares its own.

    stage: when the format is asked (`Detected`).
    sought: what the error for a source of no known format calls the files this format looks for.
    key_group: formats whose sample files share a name and are told apart by the keys of one (each format's
        `claims`) share a group, named by that file name; the group's files are found by its first format's
        search.  "" (the default): the format's file names are its own.  Such files are torch.save dicts.
    keys: each key set the format claims, in words, for the error about a file no format of its group claims.
    asked_last: the format claims what the others of its group leave (a key that theirs hold too): it is asked
        after them.
    """

    stage: Detected
    sought: str
    key_group: str = ""
    keys: tuple[str, ...] = ()
    asked_last: bool = False


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
    hidden_scales: torch.Tensor | None = None  # float32 [T]: the per-token scales of FP8 hidden states

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


class SourceFormat(ABC):
    """One input format: finds, probes and reads its sample files."""

    name: str  # its name in the registry (`FORMATS`), which --format takes
    detection: ClassVar[Detection]  # how `detect_format` tells its sources from the other formats'
    last_state_norm: LastStateNorm | None  # None: the files (or the user) say it; see `last_state_norm_of`
    has_last_state = True  # False: the format stores no last hidden state (NeMo's cache)
    ids_shifted = False  # True: input_ids and loss_mask are stored shifted left by one (NeMo's cache)
    pattern: re.Pattern[str]  # a sample file's name; group 1 is its index
    what: str  # that name, for messages
    extensions: tuple[str, ...]  # a file named *{extension} that does not match pattern is skipped, not ignored
    folder: str = ""  # where the sample files live under the root ("" = anywhere)
    numbered = True  # the names carry the sample's index (else: its rank in relpath order)
    norm_hint = ""  # where the files may not say their last state's norm: what their writers do (for the error)
    stated_norms: tuple[LastStateNorm, ...] = ("pre", "post")  # what the user may state for files that do not say it

    def scan(self, root: Path, skip_bad: bool = False, lock_timeout: float = 0.0) -> Discovery:
        """Every sample file under root and, with skip_bad, every entry that cannot be read as one.

        Without skip_bad the first such entry (an unreadable folder, a broken or
        looping link, a link out of the root, a misnamed file) is a SourceError naming it.
        `lock_timeout`: how long to wait for files their writer still holds locked, for the formats
        whose writers lock them (vLLM's); the others have no locks.
        """
        root = check_root(root)
        found = self.search(root)
        if found.skipped and not skip_bad:
            raise found.skipped[0].error()
        if not found.files:
            raise nothing_readable(root, found.skipped) if found.skipped else self._none_found(root)
        return found

    def discover(self, root: Path) -> list[SourceFile]:
        """Every sample file under root, sorted by (sample_index, relpath); an entry that cannot be one is an error."""
        return self.scan(root).files

    def search(self, root: Path) -> Discovery:
        """What ``scan`` finds under root, without raising for the entries skipped or for finding nothing."""
        absroot = Path(os.path.abspath(root))
        return find_samples(absroot, absroot / self.folder, self.extensions, self.pattern, self.what, self.numbered)

    def _none_found(self, root: Path) -> SourceError:
        return SourceError(root, f"no {self.what} files found (searched all sub-folders)")

    def recognizes(self, root: Path) -> bool:
        """Whether the source at root is this format's by its layout alone (formats detected `BY_LAYOUT`)."""
        return False

    def claims(self, keys: Mapping[str, Any]) -> bool:
        """Whether a sample file of its key group holding this dict is this format's (`Detection.key_group`).  The
        dict may be a gzipped file's head, whose tensors have no data."""
        return False

    def confirm(self, root: Path, found: Discovery) -> None:
        """Raise a SourceError naming the first file found by its extension alone (formats detected `BY_EXTENSION`)
        that is not this format's, or the source when its files are another format's."""

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

    @classmethod
    def shared(cls) -> SourceFormat:
        """This process's one instance of the format, whose caches every sample it reads shares (the registry's)."""
        instance = cls.__dict__.get("_shared_instance")
        if instance is None:
            instance = cls()
            cls._shared_instance = instance
        return instance

    def __reduce__(self) -> tuple[Callable[[], SourceFormat], tuple[()]]:
        # Pickled as "the receiving process's shared instance", so that sending a format to a worker process
        # neither copies its caches (memory-mapped Arrow tables) nor fails on its lock.
        return (type(self).shared, ())
