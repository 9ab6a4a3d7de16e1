"""Sample files in a bucket, for `h5feed convert s3://... DST`.

The formats find, probe and read local files (`h5feed.formats`), and their discovery
rules (names, folders, misnamed files) are worth keeping exactly.  So the bucket's
listing becomes a local *shadow* folder: each sample file is a sparse placeholder with
the object's size and its modification time as the server states it (nothing is
downloaded for it), every other object (a vocab mapping, a manifest) is fetched whole.
Discovery, planning and change detection (size and mtime, as for local files) run on
the shadow unchanged.  A worker reads a sample by fetching its object into a private
temporary file under the name it has in the bucket, running the format's reader on it
(`torch.load(weights_only=True)`, as always) and deleting it: local disk holds one
source file per busy worker.  Errors name the object's URL, never the shadow.

Only formats that keep one sample per file are read this way; the others
(speculators-safetensors' Arrow rows, NeMo's shards of many samples) are refused with
what to do instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from h5feed.errors import PathError, SourceError, StoreError
from h5feed.formats import FORMATS, SourceFile, SourceFormat
from h5feed.io import ObjectNotFound, ObjectStore, open_url
from h5feed.io.paths import UnsafeName, contained_path, is_folder_marker
from h5feed.store.attributes import SkippedFile

E = TypeVar("E", bound=PathError)
log = logging.getLogger(__name__)

# Objects that may be sample files: a placeholder in the shadow, fetched by the worker that reads it.
SAMPLE_SUFFIXES = (".pt", ".ckpt", ".ckpt.gz", ".safetensors")
# Files beside the samples that the formats read during planning (companions): fetched whole.
SIDE_FILES = ("vocab_mapping.pt",)
PER_FILE_FORMATS = ("speculators-legacy-pt", "speculators-v0-pt", "specforge-ckpt", "modelopt-pt", "angelslim-ckpt")


@dataclass(frozen=True)
class SourceFetcher:
    """What a worker needs to read a sample from the bucket: the objects, the shadow root, a scratch folder.
    Pickles as configuration (the client is made in the worker)."""

    objects: ObjectStore
    shadow: str
    scratch: str

    def key(self, source: SourceFile) -> str:
        return SourceFormat.file_of(source.path).relative_to(self.shadow).as_posix()

    @contextlib.contextmanager
    def fetched(self, source: SourceFile) -> Iterator[SourceFile]:
        """The sample, downloaded into a temporary file of the same name; its errors name the object's URL."""
        key = self.key(source)
        folder = Path(self.scratch) / uuid.uuid4().hex
        folder.mkdir(parents=True)
        try:
            local = folder / Path(key).name
            try:
                local.write_bytes(self.objects.get_large(key))
            except ObjectNotFound as exc:
                raise SourceError(self.objects.key_url(key), "is gone from the bucket since it was listed") from exc
            with naming(SourceError, {str(local): self.objects.key_url(key)}):
                yield SourceFile(local.with_name(source.path.name), source.sample_index, source.relpath)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


class BucketSources:
    """The shadow of a bucket's sample files (see the module docstring); `open` makes and removes it."""

    def __init__(self, url: str, objects: ObjectStore, workdir: Path) -> None:
        self.url, self.objects = url, objects
        self.shadow = workdir / "shadow"
        self.skipped: list[SkippedFile] = []  # objects refused by `_mirror` with skip_bad, as a store records skips
        self.fetcher = SourceFetcher(objects, str(self.shadow), str(workdir / "fetched"))

    @classmethod
    @contextlib.contextmanager
    def open(cls, url: str, storage_options: dict[str, Any] | None,
             workdir_parent: str | os.PathLike[str] | None, skip_bad: bool) -> Iterator[BucketSources]:
        url = url.rstrip("/")
        if workdir_parent is not None:
            Path(workdir_parent).mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix="h5feed-sources-", dir=workdir_parent))
        try:
            sources = cls(url, open_url(url, storage_options), workdir)
            sources._mirror(skip_bad)
            with naming((SourceError, StoreError), {str(sources.shadow): url}):
                yield sources
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _mirror(self, skip_bad: bool) -> None:
        """The shadow of every object whose key is a path inside it; a key that is not (`..`, absolute, `a//b`)
        is an error, or with `skip_bad` a recorded skip: nothing is ever written outside the shadow."""
        listed = self.objects.list_info("")
        if not listed:
            raise SourceError(self.url, "holds no objects (or the bucket does not exist): check the URL and "
                              "--storage-option endpoint_url")
        for key, info in listed.items():
            if is_folder_marker(key, info.size):
                continue
            try:
                path = contained_path(self.shadow, key)
            except UnsafeName as exc:
                problem = f"its key {exc.problem}, so it cannot be read as a file under {self.url}"
                if not skip_bad:
                    raise SourceError(self.objects.key_url(key), f"{problem}: rename or delete the object, or pass "
                                      "--skip-bad to convert the others and record it as skipped") from exc
                log.warning("skipping %s: %s", self.objects.key_url(key), problem)
                self.skipped.append(SkippedFile(key, problem))
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            if key.endswith(SAMPLE_SUFFIXES) and path.name not in SIDE_FILES:
                with open(path, "wb") as f:
                    f.truncate(info.size)  # sparse: the size, no data
            else:
                path.write_bytes(self.objects.get_large(key, info.size))
            if info.modified_ns is not None:
                os.utime(path, ns=(info.modified_ns, info.modified_ns))

    def materialize_first(self) -> None:
        """Fetch the first sample file of each kind into the shadow: format detection reads its keys."""
        for name in ("specforge-ckpt", "speculators-legacy-pt", "modelopt-pt", "vllm-safetensors"):
            files = FORMATS[name].search(self.shadow).files  # type: ignore[index]
            if files:
                path = SourceFormat.file_of(files[0].path)
                stat = path.stat()
                path.write_bytes(self.objects.get_large(self.fetcher.key(files[0])))
                os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    def check_format(self, fmt: SourceFormat) -> None:
        if fmt.name not in PER_FILE_FORMATS:
            raise SourceError(self.url, f"{fmt.name} sources cannot be read from a bucket yet (only formats of one "
                              "sample per file): copy them to a local folder (e.g. `aws s3 sync`) and convert that")


@contextlib.contextmanager
def naming(kinds: type[E] | tuple[type[E], ...], places: dict[str, str]) -> Iterator[None]:
    """Re-raise errors of `kinds` (exactly those types) whose path lies under one of `places` (a local
    stand-in) as naming the real place (a URL) instead."""
    try:
        yield
    except kinds as exc:
        if type(exc) not in (kinds if isinstance(kinds, tuple) else (kinds,)):
            raise
        for local, real in places.items():
            if exc.path == local or exc.path.startswith(local + "/"):
                raise type(exc)(real + exc.path[len(local):], exc.problem) from exc
        raise
