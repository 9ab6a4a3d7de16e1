"""vLLM's own hidden-state files: the ``{req_id}.safetensors`` its ``ExampleHiddenStatesConnector`` writes.

vLLM (``speculative_config={"method": "extract_hidden_states", ...}`` with that connector) writes one
file per request into its ``shared_storage_path``: ``hidden_states`` [T, K, H] in the model's dtype
(the layers of ``eagle_aux_hidden_state_layer_ids``, in that order) and ``token_ids`` [T] int64, with
``safetensors.torch.save_file`` and no metadata.  hs-connectors' ``FP8HiddenStatesConnector`` (its subclass)
writes the same files with ``hidden_states`` in float8_e4m3fn and ``hidden_states_scales`` beside it: they
convert into an FP8 store that keeps both as they are.  The last of the K layers is the final layer's output,
before the norm, only when ``num_hidden_layers`` is in that list (as speculators configures it): the
files cannot say so, so the user states it (``--last-state-norm pre``), as for other formats.

With prefix caching or chunked prefill on, vLLM computes and the connector writes only part of a prompt's
positions beside all of its token ids: such a file is refused, naming that cause, since no position of it can
be matched to its token.

Each file is written under a companion ``{req_id}.safetensors.lock``, created and held with
``flock(LOCK_EX)`` before the file exists and released once it is written; readers take ``LOCK_SH``,
as vLLM's own ``load_hidden_states`` does.  Discovery waits, a bounded time, for the locks held; a file
still locked after that is an error naming it, or with skip_bad an *unfinished* skip that a rerun
appends once it is written.  A lock alone and free is a request whose file was never written.

With speculators' Arrow dataset beside the files (``state.json``), each file is paired with the row
whose ``input_ids`` equal its ``token_ids`` (speculators checks the same equality) and takes that
row's loss mask; without it the samples have no loss mask, and the store says so.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from h5feed.errors import SourceError
from h5feed.formats.base import Detected, Detection, SampleShape, SourceFormat, SourceSample
from h5feed.formats.checks import ids_to_int64, mask_to_int64, refuse_unknown_keys
from h5feed.formats.discovery import Discovery, SkippedEntry, SourceFile, check_root, find_samples, nothing_readable
from h5feed.formats.registry import register_format
from h5feed.formats.safetensors_file import fp8_scales, open_safetensors
from h5feed.formats.speculators_safetensors import ArrowRows, SpeculatorsSafetensors, layers_file_shape, split_layers
from h5feed.io.paths import regular_file
from h5feed.store.layout import HIDDEN_SCALES, LastStateNorm

__all__ = ["LOCK_SUFFIX", "VllmSafetensors"]

LOCK_SUFFIX = ".lock"  # vLLM's lock beside each file: {req_id}.safetensors.lock
_KEYS = ("hidden_states", "token_ids", HIDDEN_SCALES)  # the scales: hs-connectors' FP8HiddenStatesConnector's
_POLL_S = 0.05  # how often a held lock is tried again


@register_format
class VllmSafetensors(SourceFormat):
    """H: vLLM's ``{req_id}.safetensors`` (``hidden_states`` [T, K, H], ``token_ids`` [T]), each written under its
    ``.lock``; with speculators' Arrow dataset beside them, or without a loss mask."""

    name = "vllm-safetensors"
    detection = Detection(Detected.BY_EXTENSION, "vLLM's {req_id}.safetensors")
    last_state_norm: LastStateNorm | None = None
    stated_norms: tuple[LastStateNorm, ...] = ("pre",)
    norm_hint = ("vLLM's connector stores the layers of eagle_aux_hidden_state_layer_ids and no metadata: the last "
                 "one is the final layer's output, before the norm, only when num_hidden_layers is in that list, as "
                 "speculators configures it; files without that layer hold no last state and cannot be converted")
    pattern = re.compile(r".+\.safetensors")
    what = "{req_id}.safetensors"
    extensions = (".safetensors",)
    numbered = False

    def search(self, root: Path) -> Discovery:
        files, _, skipped = self._listing(Path(os.path.abspath(root)))
        return Discovery(_ranked(files), skipped)

    def confirm(self, root: Path, found: Discovery) -> None:
        """vLLM's files (or hs-connectors' FP8 ones, with their scales), by the keys of the first of them whose header
        reads (one still being written may not).

        speculators' hs_{i}.safetensors hold the same keys: outside the hidden_states/ folder beside their
        Arrow dataset they are refused with where to point instead, since read as vLLM's they lose its loss masks."""
        if all(SpeculatorsSafetensors.pattern.fullmatch(f.path.name) for f in found.files):
            raise SourceError(root, "holds speculators' hs_{i}.safetensors files: pass the folder that holds "
                              "hidden_states/ and state.json (their loss masks are there), or --format vllm-safetensors "
                              "to read them as vLLM's files, without a loss mask")
        failed: list[SourceError] = []
        for source in found.files[:8]:
            try:
                with open_safetensors(source.path) as f:
                    keys = sorted(f.keys())
            except SourceError as exc:
                failed.append(exc)
                continue
            if keys in (["hidden_states", "token_ids"], ["hidden_states", HIDDEN_SCALES, "token_ids"]):  # FP8: scales
                return
            raise SourceError(source.path, f"keys ({', '.join(map(repr, keys)) or 'none'}) are not those of vLLM's "
                              "hidden-state files ('hidden_states' + 'token_ids')")
        raise failed[0]

    def scan(self, root: Path, skip_bad: bool = False, lock_timeout: float = 0.0) -> Discovery:
        """The finished files under root: the locks held are waited for until `lock_timeout` seconds have passed."""
        root = Path(os.path.abspath(check_root(root)))
        deadline = time.monotonic() + lock_timeout
        files, lone_locks, skipped = self._listing(root)
        if _wait_for_writers([_lock_of(f.path) for f in files] + [lock.path for lock in lone_locks], deadline):
            files, lone_locks, skipped = self._listing(root)  # the files written meanwhile
        finished = []
        for source in files:
            if _is_held(_lock_of(source.path)):
                skipped.append(_unfinished(source.path, source.relpath, lock_timeout))
            else:
                finished.append(source)
        for lock in lone_locks:
            sample = lock.path.with_name(lock.path.name.removesuffix(LOCK_SUFFIX))
            relpath = lock.relpath.removesuffix(LOCK_SUFFIX)
            if _is_held(lock.path):
                skipped.append(_unfinished(sample, relpath, lock_timeout))
            elif sample.exists():  # written and released since the listing
                finished.append(SourceFile(sample, 0, relpath))
            else:
                skipped.append(SkippedEntry(lock.path, lock.relpath, f"is a lock with no {sample.name} beside it: vLLM "
                                            "never wrote that request's hidden states (it was aborted, or its write "
                                            "failed: see vLLM's log); delete the lock once you know why"))
        skipped.sort(key=lambda s: s.relpath)
        if skipped and not skip_bad:
            raise skipped[0].error()
        if not finished:
            raise nothing_readable(root, skipped) if skipped else self._none_found(root)
        if (root / "state.json").exists():
            ArrowRows.of(root)  # fail early when the Arrow dataset beside the files is unreadable
        return Discovery(_ranked(finished), skipped)

    def _listing(self, root: Path) -> tuple[list[SourceFile], list[SourceFile], list[SkippedEntry]]:
        """(the sample files, the locks with no sample file beside them, the entries skipped) under root."""
        found = find_samples(root, root, (".safetensors", ".safetensors.lock", ".safetensors.zst"), _NAMES,
                             self.what, numbered=False)
        names = {f.relpath for f in found.files}
        files, lone_locks, skipped = [], [], list(found.skipped)
        for f in found.files:
            if f.relpath.endswith(".zst"):
                skipped.append(SkippedEntry(f.path, f.relpath, "is zstd-compressed (vLLM's OnlineHiddenStatesConnector "
                                            "with use_compression): decompress it (zstd -d) and convert again"))
            elif not f.relpath.endswith(LOCK_SUFFIX):
                files.append(f)
            elif f.relpath.removesuffix(LOCK_SUFFIX) not in names:
                lone_locks.append(f)
        return files, lone_locks, skipped

    def probe(self, source: SourceFile) -> SampleShape:
        paired = _paired(source)
        with _reading(source.path), open_safetensors(source.path) as f:
            refuse_unknown_keys(source.path, list(f.keys()), _KEYS, self.name)
            shape = layers_file_shape(source.path, f, self.name)
            input_ids = ids_to_int64(source.path, f.get_tensor("token_ids"), "token_ids") if paired else None
        if input_ids is not None:
            self._loss_mask(source, input_ids)  # a file of no row, or of rows that disagree, is refused at planning
        return shape

    def load(self, source: SourceFile) -> SourceSample:
        path = source.path
        with _reading(path), open_safetensors(path) as f:
            refuse_unknown_keys(path, list(f.keys()), _KEYS, self.name)
            shape = layers_file_shape(path, f, self.name)
            aux, last, input_ids = split_layers(path, f, shape)
            scales = fp8_scales(f, shape)
        mask = self._loss_mask(source, input_ids) if _paired(source) else None
        return SourceSample(input_ids, mask, [aux], last, hidden_scales=scales)

    @staticmethod
    def _loss_mask(source: SourceFile, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The loss mask of the Arrow row whose input_ids are the file's token_ids (None: the row has none)."""
        rows = ArrowRows.of(source.root)
        matches = rows.rows_with_input_ids(source.path, input_ids)
        if not matches:
            raise SourceError(source.path, f"its token_ids are the input_ids of no row of the Arrow dataset at "
                              f"{source.root} ({rows.num_rows} rows): the files and the dataset are of different "
                              "prompts; convert the files without it (in a folder of their own) to have no loss mask")
        masks = [rows.lookup(i, source.path, len(input_ids), full=True)[0] for i in matches]
        for i, mask in zip(matches[1:], masks[1:]):
            if (mask is None) != (masks[0] is None) or (mask is not None and not torch.equal(mask, masks[0])):
                raise SourceError(source.path, f"its token_ids are the input_ids of rows {matches[0]} and {i} of the "
                                  "Arrow dataset, whose loss masks differ: which one is this file's cannot be told")
        return mask_to_int64(masks[0])


_NAMES = re.compile(r".+\.safetensors(?:\.lock|\.zst)?")  # a sample file, its lock, or a compressed one


def _paired(source: SourceFile) -> bool:
    """Whether speculators' Arrow dataset lies beside the files (its loss masks are then the samples')."""
    return (source.root / "state.json").exists()


def _ranked(files: list[SourceFile]) -> list[SourceFile]:
    """The files in relpath order, each indexed by its rank (request ids carry no sample index)."""
    return [SourceFile(f.path, i, f.relpath) for i, f in enumerate(sorted(files, key=lambda f: f.relpath))]


def _lock_of(path: Path) -> Path:
    return path.with_name(path.name + LOCK_SUFFIX)


def _unfinished(path: Path, relpath: str, waited_s: float) -> SkippedEntry:
    lock = _lock_of(path).name
    return SkippedEntry(path, relpath, f"is still being written: its lock {lock} was held for the {waited_s:g} s "
                        "waited (vLLM holds it until the file is complete); run the command again when vLLM is done "
                        "(give --lock-timeout more seconds to wait longer), or pass --skip-bad to convert the finished "
                        "files now and append this one on a rerun", unfinished=True)


def _shared_lock(lock: Path) -> int | None:
    """An open descriptor holding LOCK_SH on `lock` (closing it releases it), None when there is no lock file;
    BlockingIOError while its writer holds LOCK_EX."""
    try:
        fd = os.open(regular_file(lock), os.O_RDONLY | os.O_NONBLOCK)  # a FIFO is refused before it is opened
    except FileNotFoundError:
        return None  # written without a lock (use_synchronization_lock off), or the lock removed once read
    except OSError as exc:
        raise SourceError(lock, f"cannot be opened ({exc.strerror or exc}): h5feed reads a file only under its lock") \
            from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_held(lock: Path) -> bool:
    """Whether the writer of `lock`'s file still holds it."""
    try:
        fd = _shared_lock(lock)
    except BlockingIOError:
        return True
    if fd is not None:
        os.close(fd)
    return False


def _wait_for_writers(locks: list[Path], deadline: float) -> bool:
    """Wait until none of `locks` is held, or until the deadline (time.monotonic); whether one was held at first."""
    held = [lock for lock in locks if _is_held(lock)]
    waited = bool(held)
    while held and time.monotonic() < deadline:
        time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
        held = [lock for lock in held if _is_held(lock)]
    return waited


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Hold LOCK_SH on the file's lock while it is read, as vLLM's reader does.  Discovery found it free: held
    now, its writer is writing it again (a request id reused by a new vLLM run into the same folder)."""
    try:
        fd = _shared_lock(_lock_of(path))
    except BlockingIOError:
        raise SourceError(path, f"is being written again (its lock {_lock_of(path).name} is held since it was found "
                          "finished): convert once vLLM is done with this folder") from None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)
