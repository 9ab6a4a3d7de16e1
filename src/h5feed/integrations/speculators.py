"""speculators 0.9's own `train` command on an h5feed store: the hidden-states backend ``h5feed``.

speculators' `ArrowDataset` reads sample i of its Arrow dataset through a backend of hs-connectors'
registry (`HiddenStatesBackend.registry`), whose `get_cached(i)` returns what
``hidden_states/hs_{i}.safetensors`` holds: ``{"hidden_states": [T, K+1, H], "token_ids": [T]}``.
Importing this module registers the backend ``h5feed``, which returns exactly that (same keys, dtypes,
shapes and bits) from the store converted from those files (from FP8 files, or with --precision fp8: what the
fp8 backend's FP8Transfer returns, in bfloat16), each read checked: damaged bytes are a
`CorruptSampleError`, never a sample (or, with ``--h5feed-on-corrupt skip``, a skip in speculators' own terms:
the batch keeps its other samples and its `error_records` counts the skipped one).  speculators' parser takes
the backends' flags from the registry when it is built, so the backend must be registered before:
``python -m h5feed.speculators_train`` does that, then runs speculators' `train` with the user's arguments,
speculators' code unchanged.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any, get_args

import numpy as np
import torch
from hs_connectors.transfer import HiddenStatesBackend, HiddenStatesTransfer

from h5feed.conversion.writer import UNIQUE_SOURCE_INDEX
from h5feed.errors import CorruptSampleError, H5feedError, StoreError
from h5feed.formats.speculators import SpeculatorsLegacyPt
from h5feed.formats.speculators_safetensors import SpeculatorsSafetensors
from h5feed.loading.datasets import OnCorrupt
from h5feed.store import Store, plain_allocator
from h5feed.store.fp8 import dequantized
from h5feed.store.writer_state import WRITER_SOURCE

if TYPE_CHECKING:
    from speculators.train.recovery import SampleUnavailable

if "speculators.train.config.resolution" in sys.modules:  # it reads the registry's flags once, when imported
    warnings.warn("speculators' train parser was set up before h5feed's backend was registered, so it lacks "
                  "--h5feed-store: import h5feed.integrations.speculators before speculators.train, or run "
                  "`python -m h5feed.speculators_train`", stacklevel=2)

log = logging.getLogger(__name__)
BACKEND_NAME = "h5feed"
SERVED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # as the files hold them, with no extra arrays


class StoreTransfer(HiddenStatesTransfer):
    """The samples of a store converted from speculators' ``hidden_states/hs_{i}.safetensors``, by file index i.

    The store's index records, for each sample, the file it was converted from (`source_path`) and the i
    of its name (`source_index`, parsed once by the converter's format and covered by the index checksum):
    `get_cached(i)` serves the sample whose file was ``hs_{i}.safetensors``, and refuses an i the store
    lacks, naming it.  A damaged sample raises its `CorruptSampleError`, or with ``on_corrupt="skip"`` is logged
    and returned as speculators' `SampleUnavailable`, which its collate leaves out and counts (`error_records`).
    Pickled as its store (location and options; each DataLoader worker, spawned by speculators, opens its own
    files or clients and rebuilds the file-index map).
    """

    def __init__(self, store: Store, on_corrupt: OnCorrupt = "raise") -> None:
        if on_corrupt not in get_args(OnCorrupt):
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', not {on_corrupt!r}")
        check_serves_speculators(store)
        self.store, self.on_corrupt = store, on_corrupt
        self._sample_of_file = samples_by_file_index(store)

    def __reduce__(self) -> tuple[type[StoreTransfer], tuple[Store, OnCorrupt]]:
        return type(self), (self.store, self.on_corrupt)

    def holds(self, file_idx: int) -> bool:
        """Whether the store holds the sample of ``hs_{file_idx}.safetensors`` (row `file_idx`)."""
        return int(file_idx) in self._sample_of_file

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | SampleUnavailable:
        """What speculators' `file` backend returns for ``hs_{file_idx}.safetensors``, read from the store
        (a `SampleUnavailable` for a damaged sample skipped)."""
        i = self._sample_of_file.get(int(file_idx))
        if i is None:
            raise StoreError(
                self.store.path,
                f"holds no sample converted from hidden_states/hs_{file_idx}.safetensors, which speculators' "
                f"dataset asks for (row {file_idx} of its Arrow dataset): convert that file into the store "
                "(`h5feed convert` on the same folder appends what is missing), or train on an Arrow dataset "
                "whose rows the store holds",
            )
        try:
            raw = dequantized(self.store.read_sample(i, extras=()), plain_allocator)  # an FP8 store's: FP8Transfer's
        except CorruptSampleError as error:
            if self.on_corrupt == "raise":
                raise
            from speculators.train.recovery import SampleUnavailable  # speculators' skip: dropped and counted

            log.error("skipping a damaged sample (on_corrupt='skip'): %s", error)
            return SampleUnavailable(reason=str(error))
        t, k, h = raw.num_tokens, self.store.num_aux_layers, self.store.hidden_size
        hidden_states = torch.cat((raw.aux_hidden_states.view(t, k, h), raw.last_hidden_state.view(t, 1, h)), dim=1)
        return {"token_ids": raw.input_ids, "hidden_states": hidden_states}  # load_file's order: int64 first

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor]:
        raise H5feedError(
            f"{self.store.path}: the h5feed backend serves the samples converted into the store; it does not "
            "receive new ones from vLLM (asked for "
            f"{hs_transfer_params.get('hidden_states_path') or hs_transfer_params.get('handle')!r}). "
            "Generate the missing hidden states with the 'file' backend, convert them, and train again",
        )


def check_serves_speculators(store: Store) -> None:
    """Refuse a store whose samples are not what speculators' `file` backend would read from its files: one converted
    from them, or one the ``h5feed-tap`` backend filled (`h5feed.integrations.speculators_tap`: the same [T, K+1, H]
    samples, pre-norm last layer, appended by open_writer one per row, their source index the row)."""
    info, fmt = store.info, SpeculatorsSafetensors.name
    tapped = info.source_format == SpeculatorsLegacyPt.name and bool(info.source_info.get(UNIQUE_SOURCE_INDEX))
    if info.source_format != fmt and not tapped:
        raise StoreError(store.path, f"was converted from {info.source_format} files, not from speculators' "
                         f"hidden_states/hs_{{i}}.safetensors ({fmt}): the h5feed backend pairs row i of "
                         "speculators' Arrow dataset with the sample converted from hs_{i}.safetensors")
    if info.extra_arrays or not info.has_last_state or info.ids_shifted or info.torch_dtype not in SERVED_DTYPES:
        raise StoreError(store.path, f"holds {info.dtype} hidden states with arrays "
                         f"{', '.join(info.array_names)}: not the plain [T, K+1, H] layout the h5feed backend "
                         "serves; read it with h5feed's own loaders (BatchLoader, HiddenStatesDataset)")


def samples_by_file_index(store: Store) -> dict[int, int]:
    """{i of hs_{i}.safetensors: store sample}, refusing a store that holds two samples of one file index."""
    file_indices = np.asarray(store.source_indices, dtype=np.int64)
    unique, first, counts = np.unique(file_indices, return_index=True, return_counts=True)
    if (counts > 1).any():
        twice = int(unique[np.argmax(counts > 1)])
        paths = [store.source_paths[i] for i in np.flatnonzero(file_indices == twice)]
        raise StoreError(store.path, f"holds {len(paths)} samples of file index {twice} ({', '.join(paths)}): "
                         "speculators' dataset has one row per index; keep one file of each index in "
                         "hidden_states/ and convert again")
    return dict(zip(unique.tolist(), first.tolist()))


@HiddenStatesBackend.register(BACKEND_NAME)
class H5feedBackend(HiddenStatesBackend):
    """speculators' ``--hidden-states-backend h5feed``: the store named by ``--h5feed-store``."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        # speculators re-states each flag with its type and help only (no action), and fills in its default
        parser.add_argument("--h5feed-store", type=str, default=None,
                            help="The h5feed store converted from DATA_PATH/hidden_states (a path or a URL such as "
                                 "s3://bucket/hs.zarr), or filled by --hidden-states-backend h5feed-tap (a local "
                                 "folder, made at the first sample). Used with --hidden-states-backend h5feed or "
                                 "h5feed-tap.")
        parser.add_argument("--h5feed-on-corrupt", type=str, choices=get_args(OnCorrupt), default="raise",
                            help="A sample whose stored bytes fail their checks: 'raise' its error (default), or "
                                 "'skip' it, logged and counted in the batch's error_records. Used with "
                                 "--hidden-states-backend h5feed.")
        parser.add_argument("--h5feed-cache-dir", type=str, default=None,
                            help="A node-local folder caching a remote store's objects (default: none: every "
                                 "epoch reads the bucket). Used with --hidden-states-backend h5feed.")

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """Nothing: the backend serves a store, it does not take hidden states from vLLM."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> StoreTransfer:
        location = getattr(args, "h5feed_store", None)
        if not location:
            raise H5feedError(
                "--hidden-states-backend h5feed needs --h5feed-store PATH_OR_URL, the store converted from "
                f"{os.path.join(data_path, 'hidden_states')} (`h5feed convert {data_path} STORE`); run "
                "speculators through `python -m h5feed.speculators_train`, which adds the flag",
            )
        store = Store(location, cache_dir=getattr(args, "h5feed_cache_dir", None))
        converted_from = store.info.source_root
        if converted_from not in ("", WRITER_SOURCE) and os.path.realpath(converted_from) != os.path.realpath(data_path):
            # moved data is fine; other data is not, and speculators would skip each sample with a warning only
            log.warning("%s was converted from %s, and speculators trains on the Arrow dataset in %s: if these are "
                        "not the same data, every sample's token ids will differ from its row's and speculators "
                        "will skip it", store.path, converted_from, data_path)
        return StoreTransfer(store, getattr(args, "h5feed_on_corrupt", "raise"))

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise H5feedError("the h5feed backend reads a converted store and takes nothing from vLLM: launch vLLM "
                          "with the 'file' backend, then `h5feed convert` its hidden_states folder")
