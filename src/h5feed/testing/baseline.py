"""The `.pt` loader h5feed is measured against: speculators 0.4's `Eagle3SampleFileDataset`.

A re-statement, line for line, of `speculators/train/data.py` in the speculators
0.4.0 wheel (0.4.0.1 is identical; see notes/trainer_semantics.md section 1):
`torch.load(path, mmap=True, weights_only=True, map_location="cpu")`, then
`standardize_data_v1` (cat of the aux layers), the cast of every key whose name
contains "hidden_states", `lengths` and `position_ids`, the optional transform,
then `shift_batch`.  `max_len` is stored and not used by the item, as in 0.4
(its collate, `create_collate_fn`, restated here too, cuts the batch to `max_len`).

It is the baseline of `h5feed bench`: it must stay exactly as fast, or as slow,
as the real one.  Do not optimise it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

BatchType = dict[str, Any]
StandardizeFnSig = Callable[[dict[str, Any]], dict[str, Any]]

__all__ = ["Eagle3SampleFileDataset", "create_collate_fn", "list_files", "shift_batch", "standardize_data_v1"]


def list_files(path: str | os.PathLike[str]) -> list[Path]:
    """Every file under `path` whose name ends in "pt", in `os.walk` order (not sorted), as in 0.4."""
    datapath = []
    for root, _directories, files in os.walk(path):
        for file in files:
            if not file.endswith("pt"):
                continue
            datapath.append(Path(root) / file)
    return datapath


def shift_batch(batch: BatchType) -> BatchType:
    """0.4's `shift_batch`: align (x[1:], g[:-1], y[1:], l[1:]); lengths - 1; position_ids start at 1."""
    return {
        "input_ids": batch["input_ids"][1:],
        "hidden_states": batch["hidden_states"][:-1],
        "verifier_last_hidden_states": batch["verifier_last_hidden_states"][1:],
        "loss_mask": batch["loss_mask"][1:],
        "lengths": batch["lengths"] - 1,
        "position_ids": batch["position_ids"][1:],
    }


def standardize_data_v1(data: dict[str, Any]) -> dict[str, Any]:
    """0.4's only standardizer: the aux layers concatenated, the last layer as the verifier's state."""
    return {
        "hidden_states": torch.cat(data["hidden_states"][:-1], dim=-1),
        "input_ids": data["input_ids"],
        "verifier_last_hidden_states": data["hidden_states"][-1],
        "loss_mask": data["loss_mask"],
    }


class Eagle3SampleFileDataset(Dataset[BatchType]):
    """speculators 0.4 `Eagle3SampleFileDataset` (same arguments, same items, same cost).

    Args:
        max_len: the trainer's max_len; kept, unused by the item (0.4's collate cuts).
        datapath: a folder searched with `list_files`; exclusive with `file_list`.
        file_list: explicit sample files.
        transform: called with the full-length dict before the shift (speculators noise).
        hidden_states_dtype: dtype every "hidden_states" key is cast to (0.4 default float32).
        standardize_fn: the 0.4 default `standardize_data_v1`.
    """

    def __init__(
        self,
        max_len: int,
        datapath: str | os.PathLike[str] | None = None,
        file_list: list[str] | list[Path] | None = None,
        transform: Callable[[BatchType], BatchType] | None = None,
        hidden_states_dtype: torch.dtype = torch.float,
        standardize_fn: StandardizeFnSig = standardize_data_v1,
    ) -> None:
        message = (
            "Either `datapath` or `file_list` must be provided, but not both. Use `datapath` to auto-discover "
            "files, or `file_list` to use a list of explicit file paths."
        )
        if datapath is not None and file_list is not None:
            raise ValueError(message)
        if datapath is not None:
            file_list = list_files(datapath)
        if file_list is None:
            raise ValueError(message)
        self.data = file_list
        self.max_len = max_len
        self.transform = transform
        self.standardize_fn = standardize_fn
        self.hidden_states_dtype = hidden_states_dtype
        self.approx_lengths = self._compute_approx_lengths()

    def __len__(self) -> int:
        return len(self.data)

    def _compute_approx_lengths(self) -> list[int]:
        """`sample_lengths.json` beside the FIRST file if it has every key, else sizes scaled by item 0's length."""
        sample_lengths_path = Path(self.data[0]).parent / "sample_lengths.json"
        if sample_lengths_path.exists():
            try:
                with sample_lengths_path.open() as f:
                    sample_lengths = json.load(f)
                lengths = []
                for fname in self.data:
                    file_idx = Path(fname).stem.split("_")[-1]
                    lengths.append(sample_lengths[file_idx])
                return lengths
            except (KeyError, ValueError):
                pass
        lengths_0 = self.__getitem__(0)["lengths"][0].item()
        size_0 = Path(self.data[0]).stat().st_size
        return [math.ceil(Path(fname).stat().st_size / size_0 * lengths_0) for fname in self.data]

    def __getitem__(self, index: int) -> BatchType:
        data = torch.load(self.data[index], mmap=True, weights_only=True, map_location="cpu")
        data = self.standardize_fn(data)
        data = {k: v.to(self.hidden_states_dtype) if "hidden_states" in k else v for k, v in data.items()}
        seq_len = data["input_ids"].shape[0]
        data["lengths"] = torch.tensor([seq_len], dtype=torch.long)
        data["position_ids"] = torch.arange(seq_len, dtype=torch.long)
        if self.transform:
            data = self.transform(data)
        return shift_batch(data)


def create_collate_fn(max_len: int) -> Callable[[list[BatchType]], BatchType]:
    """speculators 0.4 `create_collate_fn(max_len)` as released: `torch.cat`, slice and `F.pad` to max_len
    (each into fresh memory), a batch dim, `lengths` cut where max_len is reached.  The baseline's collate."""

    def collate(batch: list[BatchType]) -> BatchType:
        out = {}
        for key in batch[0]:
            out[key] = torch.cat([b[key] for b in batch], dim=0)
            if key != "lengths":
                sliced = out[key][:max_len]
                out[key] = F.pad(sliced, [0, 0] * (sliced.dim() - 1) + [0, max_len - sliced.shape[0]]).unsqueeze(0)
        lengths, total = [], 0
        for length in out["lengths"]:
            if length + total >= max_len:
                lengths.append(max_len - total)
                break
            lengths.append(length)
            total += length
        out["lengths"] = torch.tensor(lengths, dtype=torch.long)
        return out

    return collate
