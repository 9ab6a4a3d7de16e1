"""Finding a source's sample files: a walk of its folder in which nothing that may hide samples is passed over.

An entry that may hide samples (an unreadable folder, a broken or looping link, a link out of
the source, a misnamed sample file) is a `SkippedEntry`: an error naming it, or with ``skip_bad``
a recorded skip.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from h5feed.errors import SourceError

__all__ = ["Discovery", "SkippedEntry", "SourceFile", "check_root", "find_samples", "nothing_readable"]


@dataclass(frozen=True)
class SourceFile:
    """One sample file found under a source root."""

    path: Path  # absolute path of the sample file
    sample_index: int  # the i of data_{i}.pt / data_{i}.ckpt / hs_{i}.safetensors
    relpath: str  # path relative to the source root, '/'-separated (provenance)

    @property
    def root(self) -> Path:
        """The source root that relpath is relative to (where a dataset beside the files lies)."""
        return self.path.parents[len(Path(self.relpath).parts) - 1]


@dataclass(frozen=True)
class SkippedEntry:
    """An entry under a source root that discovery could not use as a sample file, and why."""

    path: Path  # absolute: a file, a symbolic link or a folder
    relpath: str  # relative to the source root, '/'-separated: what a store's ``skipped`` list records
    problem: str
    unfinished: bool = False  # its writer was still writing it: a rerun tries it again (vLLM's locked files)

    def error(self) -> SourceError:
        return SourceError(self.path, self.problem)

    def record(self) -> dict[str, str]:
        """The entry as a store's ``skipped`` list keeps it."""
        return {"path": self.relpath, "problem": self.problem}


@dataclass(frozen=True)
class Discovery:
    """What ``SourceFormat.scan`` found under a source root."""

    files: list[SourceFile]  # sorted by (sample_index, relpath)
    skipped: list[SkippedEntry]  # sorted by relpath; empty unless scanned with skip_bad


@dataclass(frozen=True)
class _Candidate:
    """A file with a sample file's extension; a symbolic link keeps its own path, ``real`` is its target."""

    path: Path
    real: str
    is_link: bool


def _relpath(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _broken_link_problem(path: Path, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "is a symbolic link that loops: not followed"
    if exc.errno == errno.ENOENT:
        return f"is a broken symbolic link: its target {os.readlink(path)} does not exist"
    return f"is a symbolic link that cannot be followed ({exc.strerror or exc})"


def _walk(root: Path, top: Path, extensions: tuple[str, ...]) -> tuple[list[_Candidate], list[SkippedEntry]]:
    """Every file under ``top`` named ``*{extension}``, and every entry that may hide sample files.

    Folders are walked where they really are.  A symbolic link is resolved: one that
    leads out of ``top`` is not followed (it could pull in a sibling run's samples);
    one to a folder inside ``top`` adds nothing (that folder is walked itself, so there
    are no cycles and no duplicates); one to a file inside ``top`` is a candidate under
    its own name.  A folder that cannot be listed and a link that cannot be resolved
    (broken, looping) are skipped entries whatever their names: either may hide samples.
    """
    scope = os.path.realpath(top)
    candidates: list[_Candidate] = []
    skipped: list[SkippedEntry] = []

    def skip(path: Path, problem: str) -> None:
        skipped.append(SkippedEntry(path, _relpath(path, root), problem))

    folders = [top]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError as exc:
            if folder == root:
                raise SourceError(root, f"cannot be read ({exc.strerror or exc})") from exc
            skip(folder, f"folder cannot be read ({exc.strerror or exc}): the files in it were not searched")
            continue
        for entry in entries:
            path = Path(entry.path)
            wanted = entry.name.endswith(extensions)
            if entry.is_symlink():
                try:
                    real = os.path.realpath(path, strict=True)
                    mode = os.stat(real).st_mode
                except OSError as exc:
                    skip(path, _broken_link_problem(path, exc))
                    continue
                inside = os.path.commonpath([scope, real]) == scope
                if stat.S_ISDIR(mode):
                    if not inside:
                        skip(path, f"is a symbolic link to the folder {real}, outside {top}: not followed")
                elif wanted:
                    if not inside:
                        skip(path, f"is a symbolic link to {real}, outside {top}: not followed")
                    elif not stat.S_ISREG(mode):
                        skip(path, f"is a symbolic link to {real}, which is not a regular file")
                    else:
                        candidates.append(_Candidate(path, real, is_link=True))
            elif entry.is_dir(follow_symlinks=False):
                folders.append(path)
            elif wanted:
                if entry.is_file(follow_symlinks=False):
                    real = os.path.join(scope, os.path.relpath(path, top))
                    candidates.append(_Candidate(path, real, is_link=False))
                else:
                    skip(path, "is not a regular file (a pipe, socket or device)")
    return candidates, skipped


def find_samples(
    root: Path, top: Path, extensions: tuple[str, ...], pattern: re.Pattern[str], what: str, numbered: bool = True
) -> Discovery:
    """The sample files under ``top`` (names matching ``pattern``, group 1 = index), and every entry skipped.

    A file with a sample file's extension whose name does not match is skipped, not
    ignored: ``data_x.pt`` or ``notes.pt`` beside ``data_3.pt`` is most likely a sample
    under a wrong name.  A link to a file that is already a sample is skipped too.
    Names that carry no number (``numbered=False``) get their rank in relpath order.
    """
    root = Path(os.path.abspath(root))
    top = Path(os.path.abspath(top))
    if not top.is_dir():
        return Discovery([], [])
    candidates, skipped = _walk(root, top, extensions)
    files: list[SourceFile] = []
    owner: dict[str, str] = {}  # the real path of each sample file -> its relpath
    for c in sorted(candidates, key=lambda c: (c.is_link, c.path)):  # a file under its own name before links to it
        rel = _relpath(c.path, root)
        m = pattern.fullmatch(c.path.name)
        if m is None:
            problem = f"has a sample file's extension but its name does not match {what}"
            skipped.append(SkippedEntry(c.path, rel, problem))
        elif c.real in owner:
            skipped.append(SkippedEntry(c.path, rel, f"is a symbolic link to {owner[c.real]}, already a sample file"))
        else:
            owner[c.real] = rel
            files.append(SourceFile(c.path, int(m.group(1)) if numbered else 0, rel))
    files.sort(key=lambda s: (s.sample_index, s.relpath))
    if not numbered:
        files = [SourceFile(f.path, i, f.relpath) for i, f in enumerate(files)]
    skipped.sort(key=lambda s: s.relpath)
    return Discovery(files, skipped)


def nothing_readable(root: Path, skipped: list[SkippedEntry]) -> SourceError:
    first = "; ".join(f"{s.relpath}: {s.problem}" for s in skipped[:3])
    return SourceError(root, f"no readable sample files: {len(skipped)} skipped, first problems: {first}")


def check_root(root: Path) -> Path:
    root = Path(root)
    if not root.exists():
        raise SourceError(root, "does not exist")
    if not root.is_dir():
        raise SourceError(root, "is not a directory (a source is the folder that holds the sample files)")
    return root
