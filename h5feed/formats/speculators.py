"""speculators' formats: the legacy and v0 ``data_{i}.pt`` files, and 0.5+'s ``hs_{i}.safetensors`` beside an Arrow
dataset."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import torch

from h5feed.errors import SourceError
from h5feed.formats.base import FormatName, SampleShape, SourceFormat, SourceSample
from h5feed.formats.checks import (
    CheckedSample,
    aux_and_last,
    check_hidden,
    fmt_shape,
    ids_to_int64,
    mask_to_int64,
    mask_vector,
    require_keys,
    token_vector,
)
from h5feed.formats.discovery import Discovery, SourceFile, find_samples
from h5feed.formats.safetensors_file import open_safetensors, tensor_meta
from h5feed.formats.torch_dict import TorchDictFormat
from h5feed.store.layout import LastStateNorm

__all__ = ["SpeculatorsLegacyPt", "SpeculatorsSafetensors", "SpeculatorsV0Pt"]


class SpeculatorsLegacyPt(TorchDictFormat):
    """A: ``data_{i}.pt`` with ``hidden_states`` = list of K+1 [T, H] tensors (last one pre-norm)."""

    name: FormatName = "speculators-legacy-pt"
    last_state_norm: LastStateNorm | None = "pre"
    pattern = re.compile(r"data_(\d+)\.pt")
    what = "data_{i}.pt"
    extensions = (".pt",)

    def _check(self, path: Path, d: dict) -> CheckedSample:
        require_keys(path, d, ("input_ids", "hidden_states"), self.name)
        ids = token_vector(path, d["input_ids"], "input_ids")
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
            check_hidden(path, h, label, "[T, H]")
            if h.shape[0] != t:
                raise SourceError(path, f"{label} has {h.shape[0]} tokens but 'input_ids' has {t}")
            if first is None:
                first = h
            elif h.shape[1] != first.shape[1] or h.dtype != first.dtype:
                raise SourceError(
                    path,
                    f"{label} is {fmt_shape(h)} {h.dtype} but 'hidden_states'[0] is "
                    f"{fmt_shape(first)} {first.dtype}; every layer must have the same H and dtype",
                )
        assert first is not None
        mask = mask_vector(path, d.get("loss_mask"), "loss_mask", t)
        return CheckedSample(ids, mask, list(hs[:-1]), hs[-1], SampleShape(t, int(first.shape[1]), len(hs) - 1, first.dtype))


class SpeculatorsV0Pt(TorchDictFormat):
    """B: ``data_{i}.pt`` with ``hidden_state`` [T, K*H] and ``target`` [T, H] (post-norm)."""

    name: FormatName = "speculators-v0-pt"
    last_state_norm: LastStateNorm | None = "post"
    pattern = re.compile(r"data_(\d+)\.pt")
    what = "data_{i}.pt"
    extensions = (".pt",)

    def _check(self, path: Path, d: dict) -> CheckedSample:
        require_keys(path, d, ("input_ids", "hidden_state", "target"), self.name)
        ids = token_vector(path, d["input_ids"], "input_ids")
        aux, last, shape = aux_and_last(path, d, "hidden_state", "target", ids.shape[0], batched=False)
        return CheckedSample(ids, mask_vector(path, d.get("loss_mask"), "loss_mask", shape.num_tokens), aux, last, shape)


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
    pattern = re.compile(r"hs_(\d+)\.safetensors")
    what = "hs_{i}.safetensors"
    extensions = (".safetensors",)
    folder = "hidden_states"  # flat, or sharded in sub-folders (hidden_states/0000/) by newer speculators

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
        if find_samples(absroot, absroot, self.extensions, self.pattern, self.what).files:
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
        require_keys(path, list(f.keys()), ("token_ids", "hidden_states"), self.name)
        t = token_vector(path, tensor_meta(f, "token_ids"), "token_ids").shape[0]
        hs = tensor_meta(f, "hidden_states")
        check_hidden(path, hs, "'hidden_states'", "[T, K+1, H]")
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
        return SampleShape(t, hs.shape[2], hs.shape[1] - 1, hs.dtype)

    def probe(self, source: SourceFile) -> SampleShape:
        with open_safetensors(source.path) as f:
            shape = self._file_shape(source.path, f)
        self._rows(self._data_root(source)).lookup(source.sample_index, source.path, shape.num_tokens, full=False)
        return shape

    def load(self, source: SourceFile) -> SourceSample:
        path = source.path
        with open_safetensors(path) as f:
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
        input_ids = ids_to_int64(path, ids, "token_ids")
        if arrow_ids is not None and not torch.equal(arrow_ids.to(torch.int64), input_ids):
            raise SourceError(
                path,
                f"'token_ids' differ from 'input_ids' of row {source.sample_index} of the Arrow dataset "
                "(speculators would skip this sample): the files and the dataset are out of step",
            )
        return SourceSample(input_ids, mask_to_int64(mask), [aux], last)
