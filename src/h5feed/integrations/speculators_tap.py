"""speculators 0.9 on hidden states streamed from vLLM through Mooncake, kept as they come: the backend ``h5feed-tap``.

hs-connectors' `mooncake` backend hands speculators' `ArrowDataset` the sample vLLM put into Mooncake for each row,
and deletes it once read: every epoch asks the verifier for every sample again.  ``h5feed-tap`` serves the same
samples, fetched by hs-connectors' own `MooncakeTransfer` (same dict, same bits, the object deleted as that backend
deletes it), and appends each into an h5feed store as it goes, with `h5feed.open_writer`: written behind, on the
writer's thread, while the trainer goes on; journaled (a kill -9 loses only the samples not journaled yet, and the
next run publishes the rest); published every ``--h5feed-tap-publish-every`` samples.  A row the store holds is
served from it (`StoreTransfer`, the ``h5feed`` backend's reader): in this run's later epochs, with no Mooncake
request and no verifier work, and in later runs and other drafters, which may read the store with ``h5feed``.

Which row a sample is: speculators asks ``get_cached(i)`` for row i first and, when that misses, generates the row's
sample and reads it with ``get_generated(params)``, in the same thread; the tap pairs the two.  A sample is kept
only when speculators' own check (`check_hidden_states`) accepts it against row i's ``input_ids``: one it would
refuse and generate again is not stored.  Its loss mask is row i's, as `h5feed convert` stores it.

Every DataLoader worker (speculators spawns them, for its train and validation loaders, on every rank) appends as a
writer of its own (`tap-0`, `tap-1`, ...: the first id no running process holds, so a rerun resumes the ids a killed
run left).  Two workers may receive the same row (one kept it in epoch 1 but had not published it when another asked
for it in epoch 2, or another run taps into the store at the same time): the store is written with
`unique_source_index`, so its index keeps one sample per row, the first published.

A sample that cannot be kept (another verifier's shape, a full disk, a store held by `h5feed convert`) is still
served; the error is raised by the next ``get_cached``, outside speculators' retries, and stops the training: a tap
that silently stopped keeping would regenerate every later epoch after all.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import torch
from hs_connectors.mooncake_store import MooncakeHiddenStatesStore
from hs_connectors.transfer import HiddenStatesBackend, HiddenStatesTransfer, MooncakeBackend, MooncakeTransfer

from h5feed.conversion.options import WriteOptions
from h5feed.conversion.writer import StoreWriter, WriterReport, open_writer
from h5feed.errors import H5feedError, SourceError, StoreError
from h5feed.formats.speculators import SpeculatorsLegacyPt
from h5feed.formats.speculators_safetensors import ArrowRows
from h5feed.integrations.mooncake_local import INSTALL_HINT, master_answers
from h5feed.integrations.speculators import H5feedBackend, StoreTransfer
from h5feed.io import is_remote
from h5feed.loading.datasets import OnCorrupt
from h5feed.store import Store
from h5feed.store.layout import read_info
from h5feed.store.writer_state import live_writers, writer_locks

if TYPE_CHECKING:
    from speculators.train.recovery import SampleUnavailable

log = logging.getLogger(__name__)
BACKEND_NAME = "h5feed-tap"
WRITER_PREFIX = "tap-"  # the ids of the tap's writers: tap-0, tap-1, ... (one per process appending)
MAX_WRITERS = 4096  # ids tried before a store is called full of writers
STORE_FORMAT = SpeculatorsLegacyPt.name  # [T, H] layers, the last pre-norm: speculators' [T, K+1, H], unstacked
EXIT_WAIT_S, WORKER_EXIT_WAIT_S = 120.0, 3.0  # how long an exiting process waits for its last samples' publication
REFRESH_ALLOWANCE_S = 1.0  # a worker re-reads the store's index, looking for rows other workers published, ...
REFRESH_SHARE = 0.02  # ... for at most this much plus this share of the time it waited for generated samples


@dataclass(frozen=True)
class TapOptions:
    """Where the tap keeps the samples and how it writes them."""

    store: str  # a local folder (made at the first sample)
    data_path: str  # speculators' Arrow dataset: row i's input_ids and loss_mask
    write_behind: int = 2  # samples written on the writer's thread while the trainer goes on
    publish_every: int = 16  # samples between publications (readers, and other workers, see them from then on)
    on_corrupt: OnCorrupt = "raise"  # a stored sample whose bytes fail their checks (as the h5feed backend's)


class TapTransfer(HiddenStatesTransfer):
    """What speculators' `mooncake` backend serves, each sample also kept in an h5feed store; rows the store holds
    are served from it (see the module docstring).

    Pickled as its Mooncake settings and options: each spawned DataLoader worker sets up its own Mooncake client
    (when it first needs one), its own writer (when it first keeps a sample) and its own view of the store."""

    def __init__(self, mooncake: MooncakeTransfer, options: TapOptions) -> None:
        self.mooncake, self.options = mooncake, options
        self.path = Path(options.store)
        self._writer: StoreWriter | None = None
        self._snapshot: StoreTransfer | None = None
        self._refreshing_s, self._generating_s = 0.0, 0.0  # spent re-reading the index; waiting for generation
        self._kept: set[int] = set()  # rows this process appended (published or not yet)
        self._asked = threading.local()  # .row, .at: the row whose get_cached missed last in this thread, when
        self._failure: H5feedError | None = None
        self._lock = threading.Lock()
        self._said_unpaired = False

    def __reduce__(self) -> tuple[type[TapTransfer], tuple[MooncakeTransfer, TapOptions]]:
        fresh = MooncakeTransfer(MooncakeHiddenStatesStore(self.mooncake.store.config))  # no client crosses over
        return type(self), (fresh, self.options)

    # --- speculators' calls ----------------------------------------------------------------------
    def setup(self) -> None:
        """hs-connectors' Mooncake setup, once the master is known to answer (its own setup retries an absent one
        for 90 s, then reports a status code)."""
        if self.mooncake.store.is_setup:
            return
        address = self.mooncake.store.config.master_server_address
        why = master_answers(address)
        if why is not None:
            raise H5feedError(f"the Mooncake master at {address} does not answer ({why}): start `mooncake_master` "
                              f"there ({INSTALL_HINT}), or pass --mooncake-master HOST:PORT, the address vLLM's "
                              "MooncakeHiddenStatesConnector puts its samples through")
        self.mooncake.setup()

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | SampleUnavailable | None:
        """Row `file_idx`'s sample from the store, or None (speculators then generates it)."""
        if self._failure is not None:
            raise self._failure
        row = int(file_idx)
        if row in self._kept:  # this process kept it: published now if it was not yet
            if not self._holds(row):
                with self._lock:
                    self._writer_or_fail().publish()
                self._refresh()
        elif not self._holds(row) and self._may_refresh() and self._store_grew():
            self._refresh()  # another worker may have published it since
        if self._holds(row):
            assert self._snapshot is not None
            return self._snapshot.get_cached(row)
        self._asked.row, self._asked.at = row, time.perf_counter()
        return None

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """The `mooncake` backend's sample, kept in the store as the row speculators just asked for."""
        sample = self.mooncake.get_generated(hs_transfer_params)
        row = getattr(self._asked, "row", None)
        if row is not None:
            self._generating_s += time.perf_counter() - self._asked.at
            self._asked.at = time.perf_counter()  # a retry of the same row counts from here
        if sample is None or self._failure is not None:
            return sample
        if row is None:
            if not self._said_unpaired:
                self._said_unpaired = True
                log.warning("%s: a sample generated with no row asked for first (get_cached) is served, not kept: "
                            "the tap keeps what speculators' ArrowDataset asks for", self.path)
            return sample
        if row not in self._kept:
            try:
                self._keep(row, sample)
            except Exception as exc:  # noqa: BLE001 (served all the same; raised by the next get_cached)
                self._failure = H5feedError(
                    f"{self.path}: the h5feed-tap backend could not keep row {row}'s sample ({exc}); training stops "
                    "here, with the samples kept before it in the store: remove the cause and train again (rows the "
                    "store holds are read from it, the others generated), or tap into another --h5feed-store (one "
                    "store holds one verifier's hidden states)")
                self._failure.__cause__ = exc
                log.error("%s", self._failure)
        return sample

    def delete(self, handle: str) -> None:
        self.mooncake.delete(handle)

    # --- keeping ---------------------------------------------------------------------------------
    def _keep(self, row: int, sample: dict[str, torch.Tensor]) -> None:
        """Append the sample as row `row`, unless speculators' own check would refuse it for that row."""
        from speculators.data_generation.offline import check_hidden_states

        token_ids, hidden_states = sample["token_ids"], sample["hidden_states"]
        where = self.path / f"hs_{row}"
        try:
            loss_mask, row_ids = ArrowRows.of(Path(self.options.data_path)).lookup(row, where, len(token_ids),
                                                                                   full=True)
            check_hidden_states(sample, [] if row_ids is None else row_ids.tolist())
        except (SourceError, ValueError) as exc:
            log.warning("%s: row %d's sample is not kept (speculators refuses it and generates it again): %s",
                        self.path, row, exc)
            return
        with self._lock:
            self._writer_or_fail().append(input_ids=token_ids, hidden_states=list(hidden_states.unbind(1)),
                                          loss_mask=loss_mask, name=f"hs_{row}", source_index=row)
            self._kept.add(row)

    def _writer_or_fail(self) -> StoreWriter:
        if self._writer is None:
            self._writer = open_tap_writer(self.options)
            atexit.register(self._close_at_exit)
        return self._writer

    def close(self) -> WriterReport | None:
        """Write what is behind, publish it and let the store go."""
        with self._lock:
            writer, self._writer = self._writer, None
            return None if writer is None else writer.close()

    def _close_at_exit(self) -> None:
        """Close the writer as this process exits.  By then the interpreter has stopped the thread pools the
        store's index is published through (zarr's reads and writes run on one): the writer lets the store go
        with its last samples journaled, and a short process of its own publishes them (waited for a few seconds
        in a DataLoader worker, which its loader gives seconds to exit; it goes on after).  A kill -9 leaves them
        to the next run (`prepare_store`) or to ``python -m h5feed.integrations.speculators_tap publish STORE``."""
        writer = self._writer
        if writer is None:
            return
        writer_id = str(writer.files.writer)
        try:
            self.close()
        except Exception:  # noqa: BLE001 (publishing failed as the interpreter stops: a fresh process does it)
            command = [sys.executable, "-m", __name__, "publish", str(self.path), "--writer", writer_id]
            child = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                                     start_new_session=True, stdout=subprocess.DEVNULL)
            in_a_worker = "torch.utils.data" in sys.modules and torch.utils.data.get_worker_info() is not None
            with suppress(subprocess.TimeoutExpired):
                child.wait(timeout=WORKER_EXIT_WAIT_S if in_a_worker else EXIT_WAIT_S)

    # --- the store as published --------------------------------------------------------------------
    def _holds(self, row: int) -> bool:
        return self._snapshot is not None and self._snapshot.holds(row)

    def _may_refresh(self) -> bool:
        """Whether re-reading the index (O(samples)) is within its budget: in a first epoch every row misses, and
        re-reading at each would cost O(samples^2); in a later one a miss is most likely a row another worker
        published, and re-reading costs far less than generating it again."""
        return self._refreshing_s <= REFRESH_ALLOWANCE_S + REFRESH_SHARE * self._generating_s

    def _store_grew(self) -> bool:
        """Whether the store publishes more samples than this process's view of it (one small file read)."""
        if not (self.path / "zarr.json").is_file():
            return False
        info = read_info(self.path)
        return info.status == "complete" and info.num_samples > (0 if self._snapshot is None else len(self._snapshot.store))

    def _refresh(self) -> None:
        """Read the store's index again: the rows every writer has published by now."""
        t0 = time.perf_counter()
        self._snapshot = published_store(self.path, self.options.on_corrupt)
        self._refreshing_s += time.perf_counter() - t0


def published_store(path: Path, on_corrupt: OnCorrupt) -> StoreTransfer | None:
    """The store's published samples as the h5feed backend reads them, or None while it has none (no folder yet, or
    its writers have published nothing)."""
    if not (path / "zarr.json").is_file() or read_info(path).status != "complete":
        return None
    return StoreTransfer(Store(path), on_corrupt)


def open_tap_writer(options: TapOptions) -> StoreWriter:
    """A writer of the store under the first tap id no running process holds (a rerun resumes a killed run's ids)."""
    path = Path(options.store)
    for k in range(MAX_WRITERS):
        writer_id = f"{WRITER_PREFIX}{k}"
        if writer_id in held_ids(path):
            continue
        try:
            writing = WriteOptions(write_behind=options.write_behind, publish_every=options.publish_every)
            return open_writer(path, writer=writer_id, format=STORE_FORMAT, writing=writing, unique_source_index=True)
        except StoreError:
            if writer_id in held_ids(path):  # another process took this id in the same instant
                continue
            raise
    raise StoreError(path, f"{MAX_WRITERS} tap writers hold it now: give each training run a store of its own")


def held_ids(path: Path) -> set[str]:
    return {str(w.get("writer")) for w in live_writers(path)}


def publish_journaled(store: str | os.PathLike[str], writer_ids: Sequence[str] | None = None) -> int:
    """Publish what tap writers journaled and did not publish: those of `writer_ids`, or (None) every one a killed
    process left (its lock left behind, held by nobody).  Each is opened and closed, which publishes its journal.
    Returns the samples the store publishes then."""
    path = Path(store)
    if writer_ids is None:
        writer_ids = [d.writer for d in writer_locks(path).departed if (d.writer or "").startswith(WRITER_PREFIX)]
    for writer_id in writer_ids:
        if writer_id in held_ids(path):
            continue
        try:
            open_writer(path, writer=writer_id, format=STORE_FORMAT, unique_source_index=True).close()
        except StoreError:
            if writer_id not in held_ids(path):  # not another process resuming it first
                raise
    return 0 if published_store(path, "raise") is None else len(Store(path))


def prepare_store(options: TapOptions) -> int:
    """Before any worker starts: refuse what the tap could not write into (a URL, a store `h5feed convert` made or
    holds, a store of other settings, a missing Arrow dataset: opening a writer says the store's reasons), and
    publish what a killed run's writers journaled but never published (each departed tap id is opened and closed,
    which publishes its journal).  Returns the rows the store holds then, which are read from it."""
    if is_remote(options.store):
        raise H5feedError(f"--hidden-states-backend {BACKEND_NAME} keeps the samples in a local folder, not in "
                          f"{options.store}: tap into a folder of this machine (upload it afterwards, and train "
                          "from the bucket with --hidden-states-backend h5feed)")
    ArrowRows.of(Path(options.data_path))  # raises SourceError when speculators' dataset is not there
    path = Path(options.store)
    publish_journaled(path)
    open_tap_writer(TapOptions(options.store, options.data_path)).close()
    snapshot = published_store(path, options.on_corrupt)  # checks what the h5feed backend checks
    rows = 0 if snapshot is None else len(snapshot.store)
    log.info("%s: %d rows are in the store and are read from it; the others are generated through Mooncake and "
             "kept", options.store, rows)
    return rows


@HiddenStatesBackend.register(BACKEND_NAME)
class TapBackend(HiddenStatesBackend):
    """speculators' ``--hidden-states-backend h5feed-tap``: the `mooncake` backend's samples, kept in
    ``--h5feed-store``."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        MooncakeBackend.add_train_args(parser)  # --mooncake-master etc., as the mooncake backend takes them
        H5feedBackend.add_train_args(parser)  # --h5feed-store, --h5feed-on-corrupt (the cache is for buckets)
        parser.add_argument("--h5feed-tap-write-behind", type=int, default=2,
                            help="Samples the tap writes into the store on a thread of its own while training goes "
                                 "on (0: each one before it is served). Used with --hidden-states-backend h5feed-tap.")
        parser.add_argument("--h5feed-tap-publish-every", type=int, default=16,
                            help="Samples between publications of the store's index: other workers (and readers) "
                                 "read a kept sample from the store once it is published, and a process's exit "
                                 "publishes the rest. Used with --hidden-states-backend h5feed-tap.")

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        MooncakeBackend.add_launch_args(parser)

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> TapTransfer:
        store = getattr(args, "h5feed_store", None)
        if not store:
            raise H5feedError(f"--hidden-states-backend {BACKEND_NAME} needs --h5feed-store FOLDER, where it keeps the "
                              "samples it receives (made at the first one; a store it filled before goes on); run "
                              "speculators through `python -m h5feed.speculators_train`, which adds the flag")
        on_corrupt = getattr(args, "h5feed_on_corrupt", "raise")
        if on_corrupt not in get_args(OnCorrupt):
            raise ValueError(f"--h5feed-on-corrupt must be 'raise' or 'skip', not {on_corrupt!r}")
        options = TapOptions(store, data_path, write_behind=args.h5feed_tap_write_behind,
                             publish_every=args.h5feed_tap_publish_every, on_corrupt=on_corrupt)
        prepare_store(options)
        return TapTransfer(MooncakeBackend.from_train_args(args, data_path), options)

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        """vLLM's side is the mooncake backend's: its MooncakeHiddenStatesConnector puts, the tap keeps."""
        return MooncakeBackend.build_kv_transfer_config(args)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m h5feed.integrations.speculators_tap publish STORE`: publish what killed tap writers journaled."""
    parser = argparse.ArgumentParser(prog="python -m h5feed.integrations.speculators_tap",
                                     description="Publish the samples the h5feed-tap backend's writers journaled and "
                                                 "did not publish (a run killed, or its last samples at exit).")
    commands = parser.add_subparsers(dest="command", required=True)
    publish = commands.add_parser("publish", help="publish the journaled samples of a tap store")
    publish.add_argument("store", help="the store (--h5feed-store)")
    publish.add_argument("--writer", action="append", default=None,
                         help="a writer id (tap-N) to publish (default: every one a killed process left)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"{args.store}: {publish_journaled(args.store, args.writer)} samples published")


if __name__ == "__main__":
    main()
