"""The registry of formats: every format by name, telling a source's format from its files, and its last state's norm.

Each format's module registers its formats when it is imported (`register_format`), each declaring how its sources
are told from the others (`Detection`); `detect_format` asks them all, stage by stage (`Detected`), and knows no
format itself.  The key ``hidden_states`` means a list, the last state or the aux concat depending on the pipeline:
formats are told apart by their file names, then by their keys and shapes, not by that key alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from h5feed.errors import SourceError
from h5feed.formats.base import Detected, Detection, SampleShape, SourceFormat
from h5feed.formats.discovery import Discovery, SkippedEntry, SourceFile, check_root, nothing_readable
from h5feed.formats.safe_load import gz_head_dict, load_torch_dict
from h5feed.store.layout import LastStateNorm

__all__ = ["FORMATS", "detect_format", "last_state_norm_of", "register_format", "unregister_format"]

F = TypeVar("F", bound=type[SourceFormat])

FORMATS: dict[str, SourceFormat] = {}  # by name, in the order the formats' modules registered them


def register_format(cls: F) -> F:
    """Make a format known by its name: `@register_format` on its class, in its module (its shared instance is the
    registry's).  Its `detection` says how `detect_format` tells its sources."""
    if not isinstance(getattr(cls, "detection", None), Detection):
        raise TypeError(f"{cls.__name__} declares no detection: say how its sources are told from the others' "
                        "(h5feed.formats.base.Detection)")
    fmt = cls.shared()
    if fmt.name in FORMATS:
        raise ValueError(f"a format named {fmt.name!r} is registered already")
    FORMATS[fmt.name] = fmt
    return cls


def unregister_format(name: str) -> None:
    """Forget the format of that name (one registered for a while, as a test's own)."""
    if FORMATS.pop(name, None) is None:
        raise ValueError(f"no format named {name!r} is registered")


def _asked(stage: Detected) -> list[SourceFormat]:
    """The formats detected at `stage`, in the order they registered."""
    return [fmt for fmt in FORMATS.values() if fmt.detection.stage == stage]


def _listed(words: list[str], conjunction: str, serial_comma: bool = False) -> str:
    """``a, b and c``, or with `serial_comma` ``a, b, and c``."""
    if len(words) < 2:
        return "".join(words)
    return f"{', '.join(words[:-1])}{',' if serial_comma else ''} {conjunction} {words[-1]}"


def _detect_by_keys(root: Path, found: Discovery, group: str, skip_bad: bool) -> SourceFormat:
    """The format of a key group's sample files by the keys of the first one that loads (each format's `claims`).

    A bad file is passed over (probing reports it, or skips it with skip_bad); when
    none of the first 8 loads, the first one's error is raised.  With skip_bad every
    file is tried, and when none loads the error lists what was wrong.
    """
    members = [fmt for fmt in FORMATS.values() if fmt.detection.key_group == group]
    asked = sorted(members, key=lambda fmt: fmt.detection.asked_last)
    expected = _listed([words for fmt in members for words in fmt.detection.keys], "nor")
    failed: list[SkippedEntry] = []
    for source in found.files if skip_bad else found.files[:8]:
        path = source.path
        try:
            head = gz_head_dict(path) if path.name.endswith(".gz") else None
            d = head if head is not None else load_torch_dict(path)
        except SourceError as exc:
            failed.append(SkippedEntry(path, source.relpath, exc.problem))
            continue
        claimant = next((fmt for fmt in asked if fmt.claims(d)), None)
        if claimant is not None:
            return claimant
        problem = f"keys ({', '.join(repr(k) for k in d) or 'none'}) match neither {expected}"
        if not skip_bad:
            raise SourceError(path, problem)
        failed.append(SkippedEntry(path, source.relpath, problem))
    if not skip_bad:
        raise failed[0].error()
    raise nothing_readable(root, sorted(found.skipped + failed, key=lambda s: s.relpath))


def _of_files(fmt: SourceFormat, root: Path, found: Discovery, skip_bad: bool) -> SourceFormat:
    """The format of files `fmt` found: by their keys when its key group shares their names, else `fmt`."""
    group = fmt.detection.key_group
    return _detect_by_keys(root, found, group, skip_bad) if group else fmt


def _nothing_known(root: Path) -> SourceError:
    """What a source with no sample file of any format is told to hold: the file names first, then the sources
    known by other means, each from the broadest search to the narrowest (the reverse of the order they are asked)."""
    named: list[str] = []
    other: list[str] = []
    for stage in reversed(Detected):
        for fmt in _asked(stage):
            words = other if stage not in (Detected.BY_NAME, Detected.BY_FOLDER) else named
            if fmt.detection.sought not in words:
                words.append(fmt.detection.sought)
    also = f" (or {_listed(other, 'or', serial_comma=True)})" if other else ""
    return SourceError(root, f"no sample files of any known format found: expected {_listed(named, 'or')}{also}")


def detect_format(root: Path, skip_bad: bool = False) -> SourceFormat:
    """The format of the sample files under root, asking every registered format stage by stage (`Detected`): by
    the source's layout, by a folder of the format's own, by the files' names (then the keys of the first file
    that loads, where formats share those names), by their extension alone, then by the files the others passed
    over as misnamed.

    Entries that cannot be sample files are the chosen format's ``scan``'s business; here
    they count only when no sample file is found at all (then the first is an error, or
    with skip_bad the error lists them).
    """
    root = check_root(Path(root))
    for fmt in _asked(Detected.BY_LAYOUT):
        if fmt.recognizes(root):
            return fmt
    in_folders = [(fmt, fmt.search(root)) for fmt in _asked(Detected.BY_FOLDER)]
    groups: dict[str, SourceFormat] = {}  # a key group (or a format of names its own) -> the format whose search finds its files
    for fmt in _asked(Detected.BY_NAME):
        groups.setdefault(fmt.detection.key_group or fmt.name, fmt)
    by_name = [(fmt.detection.key_group or fmt.detection.sought, fmt, fmt.search(root)) for fmt in groups.values()]
    for fmt, found in in_folders:
        if found.files:
            return fmt
    named = [(group, fmt, found) for group, fmt, found in by_name if found.files]
    if not named:
        for fmt in _asked(Detected.BY_EXTENSION):
            found = fmt.search(root)
            if found.files:
                fmt.confirm(root, found)
                return fmt
    if len(named) > 1:
        counts = [f"{group} ({len(found.files)})" for group, _, found in named]
        raise SourceError(root, f"holds {'both ' if len(counts) == 2 else ''}{_listed(counts, 'and')} files; "
                          "convert each set from its own folder")
    if named:
        _, fmt, found = named[0]
        return _of_files(fmt, root, found, skip_bad)
    searched = [found for _, found in in_folders] + [found for _, _, found in by_name]
    skipped = sorted({s.relpath: s for found in searched for s in found.skipped}.values(), key=lambda s: s.relpath)
    for fmt in _asked(Detected.BY_LEFTOVERS):
        found = fmt.search(root)
        its_own = {f.relpath for f in found.files}
        if found.files and all(s.relpath in its_own for s in skipped):
            return _of_files(fmt, root, found, skip_bad)
    if skipped:
        raise nothing_readable(root, skipped) if skip_bad else skipped[0].error()
    raise _nothing_known(root)


def last_state_norm_of(
    fmt: SourceFormat, root: Path, shapes: list[tuple[SourceFile, SampleShape]], given: LastStateNorm | None
) -> LastStateNorm | None:
    """The norm of the store's last state: the format's, else what the files say, else what the user
    states (`given`); never a guess.  A file that says otherwise than the user, or than another file,
    is refused, naming it; so is a file that says nothing when the user said nothing."""
    if given not in (None, "pre", "post"):
        raise ValueError(f"last_state_norm must be 'pre' or 'post', not {given!r}")
    if not fmt.has_last_state:
        if given is not None:
            raise SourceError(root, f"--last-state-norm {given} was given, but {fmt.name} stores no last hidden state")
        return None
    if fmt.last_state_norm is None and given is not None and given not in fmt.stated_norms:
        raise SourceError(root, f"--last-state-norm {given} was given, but {fmt.name} files cannot hold the "
                          f"{given}-norm last hidden state ({fmt.norm_hint})")
    if fmt.last_state_norm is not None:
        if given is not None and given != fmt.last_state_norm:
            raise SourceError(root, f"{fmt.name} files hold the {fmt.last_state_norm}-norm last hidden state; "
                              f"--last-state-norm {given} contradicts them")
        return fmt.last_state_norm
    stated: tuple[SourceFile, LastStateNorm] | None = None
    unstated: SourceFile | None = None
    for source, shape in shapes:
        norm = shape.last_state_norm
        if norm is None:
            unstated = unstated or source
        elif given is not None and norm != given:
            raise SourceError(source.path, f"says its last hidden state is {norm}-norm, but --last-state-norm "
                              f"{given} was given")
        elif stated is not None and norm != stated[1]:
            raise SourceError(source.path, f"says its last hidden state is {norm}-norm, but {stated[0].relpath} says "
                              f"{stated[1]}-norm: convert each set into its own store")
        else:
            stated = stated or (source, norm)
    if given is not None:
        return given
    if unstated is not None:
        raise SourceError(unstated.path, "does not say whether its last hidden state is taken before or after the "
                          f"verifier's final norm ({fmt.norm_hint}): state it with --last-state-norm pre|post "
                          "(Python: last_state_norm='pre' or 'post')")
    assert stated is not None
    return stated[1]
