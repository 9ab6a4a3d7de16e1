"""SpecForge 0.2's own offline training (`specforge train`) on an h5feed store: its reader and its feature store.

SpecForge's offline runtime turns its feature files into `SampleRef`s (each algorithm's offline provider builds an
`OfflineManifestReader`, which lists the ``.ckpt``/``.ckpt.gz`` files in sorted path order), and its loader's
prefetch threads materialize each ref through a `FeatureStore` (`LocalFeatureStore.get` torch.loads the file);
the algorithm's normalizer and collator then make the batch.  Here, for a store named as the hidden-states path:

- `StoreManifestReader` lists the store's samples as the same refs (SpecForge's order, sample ids and metadata;
  the store's location and sample in the ref's ``h5feed+`` URI) from the store's index, at once: no file is
  opened, and SpecForge's opt-in validation pass (``SPECFORGE_VALIDATE_OFFLINE_FEATURES=1``) fills the refs'
  feature specs from the index too;
- `StoreFeatureStore.get` returns for each ref what `load_feature_file` returns for its file, by SpecForge's key
  names (same dtypes, shapes and bits), cut to the ref's ``max_len``, where every normalizer of SpecForge 0.2 cuts
  first.  Each read is checked: damaged bytes are a `CorruptSampleError` naming the sample and its source file,
  or with ``on_corrupt="skip"`` are logged and counted (``health()["h5feed_damaged_skipped"]``) while the next
  sound sample of the store stands in, as `HiddenStatesDataset` does (SpecForge's loader has no way to drop one).

SpecForge 0.2 has no registry of readers or feature stores that `specforge train` consults, so `install` puts
these two in the places its runtime looks them up: `OfflineManifestReader` in
``specforge.runtime.data_plane.offline_reader`` (every provider imports it from there when it builds its
reader) and `LocalFeatureStore` in ``specforge.launch`` (where the colocated offline runtime makes its store).
For a folder of feature files both behave as SpecForge's own.  ``python -m h5feed.specforge_train`` installs them,
then runs SpecForge's CLI, its code unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, get_args

import numpy as np
import specforge.launch
import torch
from specforge.runtime.contracts import SCHEMA_VERSION, FeatureHandle, FeatureSpec, SampleRef
from specforge.runtime.data_plane import offline_reader
from specforge.runtime.data_plane.feature_store import LocalFeatureStore
from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

from h5feed.errors import CorruptSampleError, H5feedError, StoreError
from h5feed.io.urls import is_remote
from h5feed.loading.options import OnCorrupt
from h5feed.store import RawSample, Store, plain_allocator
from h5feed.store.fp8 import dequantized

log = logging.getLogger(__name__)

__all__ = ["URI_PREFIX", "OpenStores", "StoreAccess", "StoreFeatureStore", "StoreManifestReader", "check_serves",
           "count_loss_tokens", "install", "names_store", "sample_order", "served_keys", "store_identity",
           "vocab_mapping_path"]

URI_PREFIX = "h5feed+"  # a ref's feature_store_uri: h5feed+{store location}#{sample}
DFLASH_FORMAT = "specforge-dflash-ckpt"
AUX_KEYS = ("aux_hidden_state", "hidden_states")  # EAGLE-3's name, DSpark's / DFlash's name
LAST_KEYS = ("hidden_state", "target_last_hidden_states")
TOKEN_KEYS = ("input_ids", "loss_mask")
COUNT_THREADS = 8  # reads in flight while the vocabulary counts are made
COUNT_WINDOW = 256  # samples whose ids are read ahead of the counting


@dataclass(frozen=True)
class StoreAccess:
    """How the runtime reads stores: what a damaged sample does, and a node-local cache for a store in a bucket."""

    on_corrupt: OnCorrupt = "raise"
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.on_corrupt not in get_args(OnCorrupt):
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', not {self.on_corrupt!r}")


def names_store(location: str) -> bool:
    """Whether SpecForge's hidden-states path names an h5feed store (a URL, or a folder with a zarr.json) rather
    than a folder of feature files."""
    return bool(location) and (is_remote(location) or (Path(location) / "zarr.json").is_file())


class OpenStores:
    """The stores this process reads, opened once each (the reader's and the feature store's threads share them)."""

    def __init__(self, access: StoreAccess) -> None:
        self.access = access
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()

    def get(self, location: str) -> Store:
        with self._lock:
            store = self._stores.get(location)
            if store is None:
                store = self._stores[location] = Store(location, cache_dir=self.access.cache_dir)
            return store


def served_keys(store: Store) -> dict[str, str]:
    """SpecForge's raw feature keys the store holds: {key: "input_ids" | "loss_mask" | "aux" | "last"}.

    A DFlash-family store keeps its files' keys; a store of files with a last state (SpecForge EAGLE-3's, DSpark's,
    or another pipeline's post-norm one) holds the same two arrays under either pipeline's names.  The last state is
    served only post-norm: SpecForge applies the verifier's lm_head to it directly."""
    info = store.info
    keys = {"input_ids": "input_ids", "loss_mask": "loss_mask"}
    keys.update({key: "aux" for key in (AUX_KEYS[1:] if info.source_format == DFLASH_FORMAT else AUX_KEYS)})
    if info.has_last_state and info.last_state_norm == "post":
        keys.update({key: "last" for key in LAST_KEYS})
    return keys


def check_serves(store: Store, feature_keys: tuple[str, ...]) -> None:
    """Refuse a store that lacks a key the algorithm reads, before its first step, saying what the store holds."""
    info = store.info
    if info.ids_shifted:
        raise StoreError(store.path, f"was converted from {info.source_format}, whose ids are shifted left by one "
                         "(token 0 is gone): SpecForge's offline algorithms read every token from token 0")
    served = served_keys(store)
    missing = [key for key in feature_keys if key not in served]
    if not missing:
        return
    if any(key in LAST_KEYS for key in missing) and info.has_last_state:
        why = (f"its last hidden state is {info.last_state_norm}-norm, and SpecForge applies the verifier's lm_head "
               "to its target states directly (post-norm)")
    else:
        why = f"it holds {', '.join(map(repr, served))} (converted from {info.source_format})"
    raise StoreError(store.path, f"cannot serve SpecForge the feature key(s) {', '.join(map(repr, missing))} this "
                     f"algorithm reads: {why}. Convert the files this algorithm's capture wrote")


def sample_order(store: Store) -> list[int]:
    """The store's samples in the order SpecForge lists their files (`list_feature_files`: sorted paths, which under
    one root is the order of the paths relative to it), so the refs' file indices, and the epochs' shuffles, are
    those of a run on the files."""
    return sorted(range(len(store)), key=lambda i: store.source_paths[i])


def _uri(store: Store, sample: int) -> str:
    return f"{URI_PREFIX}{store.path}#{sample}"


def _sample_of(uri: str) -> tuple[str, int]:
    location, _, sample = uri[len(URI_PREFIX):].rpartition("#")
    return location, int(sample)


class StoreManifestReader(OfflineManifestReader):
    """SpecForge's `OfflineManifestReader`, which for a store lists its samples from the index (bound to a
    process's `OpenStores` by `install`)."""

    stores: ClassVar[OpenStores]

    def __iter__(self) -> Iterator[SampleRef]:
        if not names_store(self.hidden_states_path):
            yield from super().__iter__()
            return
        store = self.stores.get(self.hidden_states_path)
        check_serves(store, self.feature_keys)
        for index, sample in enumerate(sample_order(store)):
            yield self._store_ref(store, index, sample)

    def _store_ref(self, store: Store, index: int, sample: int) -> SampleRef:
        """The ref SpecForge's reader makes for the sample's file (its specs, when it validates, from the index)."""
        specs: dict[str, FeatureSpec] = {}
        if self.validate_files:
            specs = {key: FeatureSpec(name=key, shape=_feature_shape(store, sample, key),
                                      dtype=_feature_dtype(store, key)) for key in self.feature_keys}
        num_tokens = int(store.sample_lengths[sample]) if self.validate_files else 0
        return SampleRef(
            sample_id=f"{self.run_id}:{index:08d}",
            run_id=self.run_id,
            source_task_id=None,
            feature_store_uri=_uri(store, sample),
            feature_keys={k: k for k in self.feature_keys},
            feature_specs=specs,
            strategy=self.strategy,
            schema_version=SCHEMA_VERSION,
            target_model_version=self.target_model_version,
            tokenizer_version=self.tokenizer_version,
            num_tokens=num_tokens,
            estimated_bytes=sum(int(np.prod(spec.shape)) * _itemsize(spec.dtype) for spec in specs.values()),
            metadata={"format": f"offline_{self.strategy}", "target_repr": self.target_repr,
                      "schema_version": SCHEMA_VERSION, "ttt_length": self.ttt_length, "max_len": self.max_len,
                      "file_index": index},
        )


def _feature_shape(store: Store, sample: int, key: str) -> tuple[int, ...]:
    t, role = int(store.sample_lengths[sample]), served_keys(store)[key]
    widths = {"aux": store.num_aux_layers * store.hidden_size, "last": store.hidden_size}
    return (t,) if role in TOKEN_KEYS else (1, t, widths[role])


def _feature_dtype(store: Store, key: str) -> str:
    return "int64" if served_keys(store)[key] in TOKEN_KEYS else str(store.info.dtype)


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


class StoreFeatureStore(LocalFeatureStore):
    """SpecForge's `LocalFeatureStore`, which also serves the refs `StoreManifestReader` lists (bound to a
    process's `OpenStores` by `install`)."""

    stores: ClassVar[OpenStores]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skipped = 0
        self._handles = 0
        self._counts_lock = threading.Lock()

    def get(self, sample_ref: SampleRef, *, device: torch.device | str = "cpu",
            names: list[str] | None = None) -> tuple[dict[str, torch.Tensor], FeatureHandle]:
        if not sample_ref.feature_store_uri.startswith(URI_PREFIX):
            return super().get(sample_ref, device=device, names=names)
        location, sample = _sample_of(sample_ref.feature_store_uri)
        store = self.stores.get(location)
        raw, sample = self._read(store, sample, sample_ref.metadata.get("max_len"))
        tensors = {name: _feature(store, raw, sample, sample_ref.feature_keys.get(name, name))
                   for name in names or list(sample_ref.feature_keys)}
        if str(device) != "cpu":
            tensors = {k: v.to(device) for k, v in tensors.items()}
        # nothing is resident to free: a store sample, as a file's, holds a lease on nothing
        with self._counts_lock:
            self._handles += 1
            token = f"{sample_ref.sample_id}:0:h5feed{self._handles}"
        return tensors, FeatureHandle(sample_id=sample_ref.sample_id, generation=0, lease_token=token)

    def _read(self, store: Store, sample: int, max_len: int | None) -> tuple[RawSample, int]:
        """Sample `sample` (its first max_len tokens), checked; with on_corrupt="skip" the next sound one instead of
        a damaged one."""
        n = len(store)
        for offset in range(n):
            i = (sample + offset) % n
            try:
                return dequantized(store.read_sample(i, max_len, extras=()), plain_allocator), i
            except CorruptSampleError as error:
                if self.stores.access.on_corrupt == "raise":
                    raise
                with self._counts_lock:
                    self._skipped += 1
                log.error("skipping a damaged sample (on_corrupt='skip'; the next sound sample stands in): %s", error)
        raise StoreError(store.path, f"every one of its {n} samples is damaged")

    def health(self) -> dict[str, Any]:
        with self._counts_lock:
            skipped = self._skipped
        return {**super().health(), "h5feed_damaged_skipped": skipped}


def _feature(store: Store, raw: RawSample, sample: int, key: str) -> torch.Tensor:
    """The tensor SpecForge's file holds under `key`: ids and mask [t] int64, hidden states [1, t, width]."""
    role = served_keys(store).get(key)
    if role is None:
        raise KeyError(f"{store.path}: sample {sample} (converted from {store.source_paths[sample]}) has no key "
                       f"{key!r} (the store holds {', '.join(map(repr, served_keys(store)))})")
    if role == "loss_mask" and not raw.has_loss_mask:
        raise KeyError(f"{store.path}: sample {sample}: its source file {store.source_paths[sample]} had no "
                       "'loss_mask', which SpecForge reads")
    if role in TOKEN_KEYS:
        return getattr(raw, role)
    return (raw.aux_hidden_states if role == "aux" else raw.last_hidden_state)[None]


def count_loss_tokens(store: Store, max_length: int, target_vocab_size: int, on_corrupt: OnCorrupt = "raise"
                      ) -> Counter:
    """SpecForge's `count_effective_feature_tokens` over the store: how often each token id carries loss in each
    sample's first max_length tokens, counted in SpecForge's file order and, within a sample, in ascending id order,
    as it counts (a Counter's ties are broken by that order when SpecForge picks the draft vocabulary).  Only the
    ids and masks are read."""
    def supervised_ids(i: int) -> torch.Tensor | CorruptSampleError:
        t = min(int(store.sample_lengths[i]), max_length)
        ids, mask = torch.empty(t, dtype=torch.int64), torch.empty(t, dtype=torch.int64)
        try:
            store.read_rows_into(i, "input_ids", 0, t, ids)
            store.read_rows_into(i, "loss_mask", 0, t, mask)
        except CorruptSampleError as error:
            return error
        return ids[mask.to(dtype=torch.bool)]

    counts: Counter = Counter()
    order = sample_order(store)
    with ThreadPoolExecutor(COUNT_THREADS) as pool:  # reads overlap (a cold disk, a bucket); counts stay in order
        for start in range(0, len(order), COUNT_WINDOW):  # a window at a time: memory bounded whatever the store
            window = order[start : start + COUNT_WINDOW]
            for i, selected in zip(window, pool.map(supervised_ids, window)):
                if isinstance(selected, CorruptSampleError):
                    if on_corrupt == "raise":
                        raise selected
                    log.error("skipping a damaged sample in the vocabulary counts (on_corrupt='skip'): %s", selected)
                    continue
                _count(store, i, selected, target_vocab_size, counts)
    return counts


def _count(store: Store, i: int, selected: torch.Tensor, target_vocab_size: int, counts: Counter) -> None:
    """Add one sample's supervised ids to `counts`, as SpecForge adds a file's."""
    if selected.numel() and int(selected.max()) >= target_vocab_size:
        raise StoreError(store.path, f"sample {i} (converted from {store.source_paths[i]}) holds token id "
                         f"{int(selected.max())}, outside the target vocab size {target_vocab_size}")
    token_ids, frequencies = selected.unique(return_counts=True)
    for token_id, frequency in zip(token_ids.tolist(), frequencies.tolist()):
        counts[int(token_id)] += int(frequency)


def store_identity(store: Store, max_length: int) -> str:
    """A digest of what the vocabulary counts read: the store's samples (paths, lengths, checksums) and the cut."""
    digest = hashlib.sha256(json.dumps({"store": str(store.path), "max_length": max_length}).encode())
    for column in (store.sample_lengths, np.asarray(store.checksums)):
        digest.update(np.ascontiguousarray(column).tobytes())
    digest.update("\0".join(store.source_paths).encode())
    return digest.hexdigest()


def install(access: StoreAccess) -> None:
    """Put the store-aware reader and feature store where SpecForge 0.2's offline runtime looks them up (see the
    module docstring); their classes are bound to one `OpenStores` of `access`.  Installing again rebinds them."""
    where = {"specforge.runtime.data_plane.offline_reader.OfflineManifestReader":
             (offline_reader, "OfflineManifestReader", OfflineManifestReader),
             "specforge.launch.LocalFeatureStore": (specforge.launch, "LocalFeatureStore", LocalFeatureStore)}
    for name, (module, attr, original) in where.items():
        current = getattr(module, attr, None)
        if current is not original and not (isinstance(current, type) and issubclass(current, original)
                                             and getattr(current, "stores", None) is not None):
            raise H5feedError(f"{name} is not SpecForge 0.2's own ({current!r}): this SpecForge is not the release "
                              "h5feed's integration was written for (pip install specforge==0.2.0)")
    stores = OpenStores(access)
    offline_reader.OfflineManifestReader = type("StoreManifestReader", (StoreManifestReader,), {"stores": stores})
    specforge.launch.LocalFeatureStore = type("StoreFeatureStore", (StoreFeatureStore,), {"stores": stores})


def vocab_mapping_path(cache_dir: str, identity: str, draft_vocab_size: int, target_vocab_size: int) -> Path:
    """Where the mapping of a store's counts is kept, beside SpecForge's own in data.cache_dir."""
    key = hashlib.sha256(f"{identity}:{target_vocab_size}:{draft_vocab_size}".encode()).hexdigest()
    return Path(os.path.abspath(cache_dir)) / "vocab_mapping" / f"h5feed-{key}.pt"
