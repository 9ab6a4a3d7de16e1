"""The embedded default data set of `h5feed bench`: a Kimi-shaped synthetic `.pt` set and its store, built once.

Also how cold passes start: `drop_page_cache` (root only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from h5feed.errors import H5feedError
from h5feed.store import Store
from h5feed.testing.synthetic import write_synthetic

BASELINE_FORMAT = "speculators-legacy-pt"
DEFAULT_CACHE_DIR = Path("~/.cache/h5feed/bench")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


@dataclass(frozen=True)
class SyntheticSpec:
    """The synthetic source set `h5feed bench` builds when given no store (Kimi-K2 shape by default)."""

    num_samples: int = 48
    hidden_size: int = 7168
    num_aux_layers: int = 3
    tokens: tuple[int, int] = (1500, 1900)
    seed: int = 0
    format: str = BASELINE_FORMAT

    @property
    def name(self) -> str:
        lo, hi = self.tokens
        return f"{self.format}-H{self.hidden_size}-K{self.num_aux_layers}-T{lo}-{hi}-n{self.num_samples}-s{self.seed}"

    def approx_bytes(self) -> int:
        return self.num_samples * (self.tokens[0] + self.tokens[1]) // 2 * (self.num_aux_layers + 1) * self.hidden_size * 2


DEFAULT_SPEC = SyntheticSpec()


@dataclass(frozen=True)
class DefaultSet:
    """The embedded default set `h5feed bench` builds (or reuses) when given no store: its shape, the folder it is
    kept in, and the workers converting it (None: all cores)."""

    spec: SyntheticSpec = DEFAULT_SPEC
    cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR
    convert_workers: int | None = None


def set_folder(cache_dir: str | os.PathLike[str], spec: SyntheticSpec) -> Path:
    """Where `ensure_default_set` keeps a set and its store: one folder for both, which one `rm -rf` removes."""
    return Path(cache_dir).expanduser() / spec.name


def _source_complete(src: Path, marker: Path, spec: SyntheticSpec) -> bool:
    try:
        record = json.loads(marker.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    if record.get("spec") != dataclasses.asdict(spec) | {"tokens": list(spec.tokens)}:
        return False
    files = record.get("files", {})
    if len(files) != spec.num_samples:
        return False
    for rel, size in files.items():
        try:
            if (src / rel).stat().st_size != size:
                return False
        except FileNotFoundError:
            return False
    return True


def _store_complete(store_path: Path, src: Path, spec: SyntheticSpec) -> bool:
    try:
        store = Store(store_path)
    except (H5feedError, OSError, ValueError, KeyError):
        return False
    return (
        len(store) == spec.num_samples
        and Path(store.info.source_root) == src.resolve()
        and store.info.hidden_size == spec.hidden_size
        and not store.info.skipped
    )


def ensure_default_set(
    cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR,
    spec: SyntheticSpec = DEFAULT_SPEC,
    *,
    convert_workers: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The store of the embedded default set, writing and converting it first unless a complete one is cached."""
    from h5feed.conversion import convert

    say = log or (lambda message: None)
    folder = set_folder(cache_dir, spec)
    src, store_path, marker = folder / "src", folder / "store", folder / "src-complete.json"
    if not _source_complete(src, marker, spec):
        for stale in (marker, src, store_path):
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink(missing_ok=True)
        say(f"building the bench set once, in {folder}: {spec.num_samples} synthetic {spec.format} samples "
            f"(~{spec.approx_bytes() / 1e9:.1f} GB, H={spec.hidden_size}, K={spec.num_aux_layers}, "
            f"{spec.tokens[0]}..{spec.tokens[1]} tokens), then their store beside them (about two thirds their "
            "size).  This takes a few minutes on a machine of few cores; later runs reuse both (remove them with "
            f"`rm -rf {folder}`)")
        t0 = time.perf_counter()
        files = write_synthetic(src, spec.format, spec.num_samples, spec.hidden_size, spec.num_aux_layers,
                                        spec.tokens, spec.seed)
        record = {
            "spec": dataclasses.asdict(spec) | {"tokens": list(spec.tokens)},
            "files": {Path(f).relative_to(src).as_posix(): Path(f).stat().st_size for f in files},
        }
        marker.write_text(json.dumps(record))
        say(f"wrote {sum(record['files'].values()) / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    else:
        say(f"reusing the synthetic set in {src}")
    if _store_complete(store_path, src, spec):
        say(f"reusing the store {store_path}")
        return store_path
    workers = convert_workers if convert_workers is not None else (os.cpu_count() or 1)
    say(f"converting {src} -> {store_path} with {workers} worker(s)")
    try:
        convert(src, store_path, workers=workers, progress=progress)  # resumes an unfinished one
    except H5feedError:
        convert(src, store_path, workers=workers, progress=progress, overwrite=True)
    if not _store_complete(store_path, src, spec):
        raise H5feedError(f"converting the bench set into {store_path} did not give a complete store")
    return store_path


def drop_page_cache() -> str | None:
    """Drop the page cache; None on success, else why it could not be done."""
    try:
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
    except OSError as exc:
        who = "root" if os.geteuid() != 0 else "write access to it"
        return f"cannot drop the page cache (writing {DROP_CACHES}: {exc.strerror or exc}; needs {who})"
    return None

