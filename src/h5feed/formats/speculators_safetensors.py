"""speculators 0.5+'s ``hidden_states/hs_{i}.safetensors`` beside an Arrow dataset (`ArrowRows`), which vLLM's files
(`h5feed.formats.vllm`) share their layout and dataset with."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from pathlib import Path
from typing import Any, ClassVar

import torch

from h5feed.errors import SourceError
from h5feed.formats.base import Detected, Detection, SampleShape, SourceFormat, SourceSample
from h5feed.formats.checks import check_hidden, fmt_shape, ids_to_int64, mask_to_int64, require_keys, token_vector
from h5feed.formats.discovery import Discovery, SourceFile, find_samples
from h5feed.formats.registry import register_format
from h5feed.formats.safetensors_file import check_fp8_scales, fp8_scales, open_safetensors, tensor_meta
from h5feed.store.layout import LastStateNorm

__all__ = ["ArrowRows", "SpeculatorsSafetensors", "layers_file_shape", "split_layers"]


class ArrowRows:
    """Read-only, memory-mapped view of an HF ``datasets.save_to_disk`` folder, via pyarrow only.

    speculators 0.5+ (``ArrowDataset``) pairs row i of this dataset with
    ``hidden_states/hs_{i}.safetensors`` and takes ``loss_mask`` and
    ``seq_len`` from the row (``input_ids`` must equal the file's ``token_ids``).
    Read once per process (`of`): the tables are mapped, not copied.
    """

    _cache: ClassVar[dict[str, tuple[int, ArrowRows]]] = {}  # root -> (its state.json's mtime, the dataset)
    _cache_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def of(cls, root: Path) -> ArrowRows:
        """The dataset at root, read again only when its state.json changed."""
        try:
            stamp = (root / "state.json").stat().st_mtime_ns
        except OSError:
            stamp = -1
        with cls._cache_lock:
            cached = cls._cache.get(str(root))
            if cached is None or cached[0] != stamp:
                cached = (stamp, cls(root))
                cls._cache[str(root)] = cached
            return cached[1]

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
        self._rows_by_ids: dict[bytes, list[int]] | None = None  # digest of a row's input_ids -> its rows

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

    def rows_with_input_ids(self, path: Path, token_ids: torch.Tensor) -> list[int]:
        """The rows whose ``input_ids`` equal `token_ids` (int64), for files not named by their row (vLLM's):
        found by a digest of every row's ids, computed once, then compared exactly."""
        if self.input_ids is None:
            raise SourceError(path, f"cannot be paired with a row of the Arrow dataset at {self.root}: it has no "
                              "'input_ids' column")
        if self._rows_by_ids is None:
            by_ids: dict[bytes, list[int]] = {}
            for i in range(self.num_rows):
                ids = self._input_ids_of(i)
                if ids is not None:
                    by_ids.setdefault(_digest(ids), []).append(i)
            self._rows_by_ids = by_ids
        rows = []
        for i in self._rows_by_ids.get(_digest(token_ids), []):
            ids = self._input_ids_of(i)
            if ids is not None and torch.equal(ids, token_ids):
                rows.append(i)
        return rows

    def _input_ids_of(self, i: int) -> torch.Tensor | None:
        """Row i's input_ids as int64, None when the row has none."""
        assert self.input_ids is not None
        row = int(self.indices[i].as_py()) if self.indices is not None else i
        ids = self._list_at(self.input_ids, row, f"'input_ids' of row {i}", self.root)
        return None if ids is None else ids.to(torch.int64)


def _digest(ids: torch.Tensor) -> bytes:
    """A digest of int64 token ids: rows and files are matched by it, then compared exactly."""
    return hashlib.blake2b(ids.numpy().tobytes(), digest_size=16).digest()


def layers_file_shape(path: Path, f: Any, fmt: str) -> SampleShape:
    """The shape of an open ``hidden_states`` [T, K+1, H] + ``token_ids`` [T] file (speculators' and vLLM's),
    its keys, dtypes and shapes checked from its header alone."""
    require_keys(path, list(f.keys()), ("token_ids", "hidden_states"), fmt)
    t = token_vector(path, tensor_meta(f, "token_ids"), "token_ids").shape[0]
    hs = tensor_meta(f, "hidden_states")
    check_hidden(path, hs, "'hidden_states'", "[T, K+1, H]")
    if hs.shape[0] < t:
        raise SourceError(path, _suffix_only(hs.shape[0], t))
    if hs.shape[0] != t:
        raise SourceError(path, f"'hidden_states' has {hs.shape[0]} tokens but 'token_ids' has {t}")
    if hs.shape[1] < 2:
        raise SourceError(
            path,
            f"'hidden_states' holds {hs.shape[1]} layer(s) (shape {fmt_shape(hs)}); expected "
            "K+1 >= 2 (K auxiliary layers, then the last layer)",
        )
    if hs.shape[2] == 0:
        raise SourceError(path, f"'hidden_states' has hidden size 0 (shape {fmt_shape(hs)})")
    check_fp8_scales(path, f, hs)
    return SampleShape(t, hs.shape[2], hs.shape[1] - 1, hs.dtype)


def _suffix_only(positions: int, tokens: int) -> str:
    """Why a vLLM-written file holds fewer hidden-state positions than tokens, and what to do.

    With prefix caching vLLM computes (and its connector writes) only the positions after the cached prefix, and
    with chunked prefill only those of a chunk: the file then pairs a suffix of the states with the whole prompt,
    and no position of it can be told to be whose.  Extracting again without either is the only repair."""
    return (f"'hidden_states' holds {positions} positions but 'token_ids' has {tokens} tokens ({tokens - positions} "
            "missing): vLLM wrote only the positions it computed, most likely because prefix caching or chunked "
            "prefill was on during extraction (the missing ones came from its prefix cache, or from another "
            "chunk); extract these prompts again with enable_prefix_caching=False and chunked prefill off "
            "(enable_chunked_prefill=False, max_num_batched_tokens at least the longest prompt), as "
            "Model-Optimizer's vLLM dump script does")


def split_layers(path: Path, f: Any, shape: SampleShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(aux [T, K*H], last [T, H], input_ids int64 [T]) of an open file of that shape.

    The slices are views of the library's private (copy-on-write) file mapping, or in
    older safetensors just these parts read: each part is copied once, straight into
    its final contiguous tensor, and the [T, K+1, H] block never is."""
    t, k, h = shape.num_tokens, shape.num_aux_layers, shape.hidden_size
    hs = f.get_slice("hidden_states")
    aux = hs[:, :k].contiguous().view(t, k * h)  # no copy when T == 1
    last = hs[:, k:].contiguous().view(t, h)
    return aux, last, ids_to_int64(path, f.get_tensor("token_ids"), "token_ids")


@register_format
class SpeculatorsSafetensors(SourceFormat):
    """D: speculators 0.5+ ``hidden_states/hs_{i}.safetensors`` ([T, K+1, H], last pre-norm) + Arrow dataset.

    Files written by hs-connectors' ``fp8`` backend (speculators' ``--hidden-states-backend fp8``) hold
    ``hidden_states`` as float8_e4m3fn and ``hidden_states_scales`` float32 [T, 1, 1] beside it: both are read as
    they are (an FP8 store keeps them; `h5feed.store.fp8`).
    """

    name = "speculators-safetensors"
    detection = Detection(Detected.BY_FOLDER, "hidden_states/hs_{i}.safetensors")
    last_state_norm: LastStateNorm | None = "pre"
    pattern = re.compile(r"hs_(\d+)\.safetensors")
    what = "hs_{i}.safetensors"
    extensions = (".safetensors",)
    folder = "hidden_states"  # flat, or sharded in sub-folders (hidden_states/0000/) by newer speculators

    def scan(self, root: Path, skip_bad: bool = False, lock_timeout: float = 0.0) -> Discovery:
        found = super().scan(root, skip_bad, lock_timeout)
        ArrowRows.of(Path(os.path.abspath(root)))  # fail early when the Arrow dataset is missing
        return found

    def _none_found(self, root: Path) -> SourceError:
        absroot = Path(os.path.abspath(root))
        hint = ""
        if find_samples(absroot, absroot, self.extensions, self.pattern, self.what).files:
            hint = " (hs_*.safetensors files exist elsewhere: pass the folder that holds hidden_states/ and state.json)"
        return SourceError(root, f"no hidden_states/hs_{{i}}.safetensors files found{hint}")

    def probe(self, source: SourceFile) -> SampleShape:
        with open_safetensors(source.path) as f:
            shape = layers_file_shape(source.path, f, self.name)
        ArrowRows.of(source.root).lookup(source.sample_index, source.path, shape.num_tokens, full=False)
        return shape

    def load(self, source: SourceFile) -> SourceSample:
        path = source.path
        with open_safetensors(path) as f:
            shape = layers_file_shape(path, f, self.name)
            aux, last, input_ids = split_layers(path, f, shape)
            scales = fp8_scales(f, shape)
        mask, arrow_ids = ArrowRows.of(source.root).lookup(source.sample_index, path, len(input_ids), full=True)
        if arrow_ids is not None and not torch.equal(arrow_ids.to(torch.int64), input_ids):
            raise SourceError(
                path,
                f"'token_ids' differ from 'input_ids' of row {source.sample_index} of the Arrow dataset "
                "(speculators would skip this sample): the files and the dataset are out of step",
            )
        return SourceSample(input_ids, mask_to_int64(mask), [aux], last, hidden_scales=scales)
