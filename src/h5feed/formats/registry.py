"""Every format by name, telling a source's format from its files, and the norm of its last state.

The key ``hidden_states`` means a list, the last state or the aux concat depending on the
pipeline: formats are told apart by their file names, then by their companion keys and shapes,
not by that key alone.
"""

from __future__ import annotations

from pathlib import Path

from h5feed.errors import SourceError
from h5feed.formats.angelslim import AngelSlimCkpt
from h5feed.formats.base import FormatName, SampleShape, SourceFormat
from h5feed.formats.discovery import Discovery, SkippedEntry, SourceFile, check_root, nothing_readable
from h5feed.formats.modelopt import ModelOptPt
from h5feed.formats.nemo import NemoEagle3Cache
from h5feed.formats.safe_load import gz_head_dict, load_torch_dict
from h5feed.formats.safetensors_file import open_safetensors
from h5feed.formats.specforge import DSPARK_KEYS, EAGLE3_KEYS, SpecForgeCkpt, SpecForgeDFlashCkpt
from h5feed.formats.speculators import SpeculatorsLegacyPt, SpeculatorsV0Pt
from h5feed.formats.speculators_safetensors import SpeculatorsSafetensors
from h5feed.formats.vllm import VllmSafetensors
from h5feed.store.layout import HIDDEN_SCALES, LastStateNorm

__all__ = ["FORMATS", "detect_format", "last_state_norm_of"]


FORMATS: dict[FormatName, SourceFormat] = {
    f.name: f
    for f in (cls.shared() for cls in (SpeculatorsLegacyPt, SpeculatorsV0Pt, SpecForgeCkpt, SpecForgeDFlashCkpt,
                                       SpeculatorsSafetensors, ModelOptPt, AngelSlimCkpt, NemoEagle3Cache,
                                       VllmSafetensors))
}


def _format_of_keys(d: dict, extension: str) -> FormatName | None:
    """The format a sample file's keys say (None: no known one).  ``hidden_states`` is a list in speculators
    legacy, the last state in Model-Optimizer and the aux concat in AngelSlim and SpecForge DSpark and DFlash: the
    companions decide (a DFlash-family file has none)."""
    if extension == ".pt":
        if isinstance(d.get("hidden_states"), (list, tuple)):
            return "speculators-legacy-pt"
        if "hidden_state" in d and "target" in d:
            return "speculators-v0-pt"
        if "hidden_states" in d and any(k in d for k in ModelOptPt.aux_keys):
            return "modelopt-pt"
        return None
    if EAGLE3_KEYS[0] in d or DSPARK_KEYS[1] in d:
        return "specforge-ckpt"
    if "target_hiddens" in d:
        return "angelslim-ckpt"
    if "hidden_states" in d:
        return "specforge-dflash-ckpt"
    return None


_KEYS_EXPECTED = {
    ".pt": "speculators legacy ('hidden_states' list), speculators v0 ('hidden_state' + 'target') nor "
           "Model-Optimizer ('hidden_states' + 'aux_hidden_states' or 'hidden_state_features')",
    ".ckpt": "SpecForge EAGLE-3 ('aux_hidden_state' + 'hidden_state'), SpecForge DSpark ('hidden_states' + "
             "'target_last_hidden_states'), SpecForge DFlash/Domino ('hidden_states' alone) nor AngelSlim "
             "('hidden_states' + 'target_hiddens')",
}


def _detect_by_keys(root: Path, found: Discovery, extension: str, skip_bad: bool) -> SourceFormat:
    """The format of sample files by the keys of the first one that loads.

    A bad file is passed over (probing reports it, or skips it with skip_bad); when
    none of the first 8 loads, the first one's error is raised.  With skip_bad every
    file is tried, and when none loads the error lists what was wrong.
    """
    failed: list[SkippedEntry] = []
    for source in found.files if skip_bad else found.files[:8]:
        path = source.path
        try:
            head = gz_head_dict(path) if path.name.endswith(".gz") else None
            d = head if head is not None else load_torch_dict(path)
        except SourceError as exc:
            failed.append(SkippedEntry(path, source.relpath, exc.problem))
            continue
        name = _format_of_keys(d, extension)
        if name is not None:
            return FORMATS[name]
        problem = f"keys ({', '.join(repr(k) for k in d) or 'none'}) match neither {_KEYS_EXPECTED[extension]}"
        if not skip_bad:
            raise SourceError(path, problem)
        failed.append(SkippedEntry(path, source.relpath, problem))
    if not skip_bad:
        raise failed[0].error()
    raise nothing_readable(root, sorted(found.skipped + failed, key=lambda s: s.relpath))


def _detect_vllm(root: Path, found: Discovery) -> SourceFormat:
    """vLLM's files (or hs-connectors' FP8 ones, with their scales), by the keys of the first of them whose header
    reads (one still being written may not).

    speculators' hs_{i}.safetensors hold the same keys: outside the hidden_states/ folder beside their
    Arrow dataset they are refused with where to point instead, since read as vLLM's they lose its loss masks."""
    speculators = FORMATS["speculators-safetensors"]
    if all(speculators.pattern.fullmatch(f.path.name) for f in found.files):
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
            return FORMATS["vllm-safetensors"]
        raise SourceError(source.path, f"keys ({', '.join(map(repr, keys)) or 'none'}) are not those of vLLM's "
                          "hidden-state files ('hidden_states' + 'token_ids')")
    raise failed[0]


def detect_format(root: Path, skip_bad: bool = False) -> SourceFormat:
    """The format of the sample files under root, by their names, then by the keys of the first file that loads.

    Entries that cannot be sample files are the chosen format's ``scan``'s business; here
    they count only when no sample file is found at all (then the first is an error, or
    with skip_bad the error lists them).  ``.pt`` files not named ``data_{i}.pt`` are
    Model-Optimizer's ``<conversation_id>.pt`` when nothing else is amiss.
    """
    root = check_root(Path(root))
    if (root / "manifest.json").is_file() and any(FORMATS["nemo-eagle3-cache"].pattern.fullmatch(p.name)
                                                   for p in root.iterdir()):
        return FORMATS["nemo-eagle3-cache"]
    names: tuple[FormatName, ...] = ("speculators-safetensors", "specforge-ckpt", "speculators-legacy-pt")
    searched = [FORMATS[name].search(root) for name in names]
    safetensors, ckpts, pts = searched
    if safetensors.files:
        return FORMATS["speculators-safetensors"]
    requests = FORMATS["vllm-safetensors"].search(root)
    if requests.files and not (ckpts.files or pts.files):
        return _detect_vllm(root, requests)
    if ckpts.files and pts.files:
        raise SourceError(
            root,
            f"holds both data_{{i}}.pt ({len(pts.files)}) and data_{{i}}.ckpt[.gz] ({len(ckpts.files)}) files; "
            "convert each set from its own folder",
        )
    if ckpts.files:
        return _detect_by_keys(root, ckpts, ".ckpt", skip_bad)
    if pts.files:
        return _detect_by_keys(root, pts, ".pt", skip_bad)
    skipped = sorted({s.relpath: s for found in searched for s in found.skipped}.values(), key=lambda s: s.relpath)
    dumps = FORMATS["modelopt-pt"].search(root)
    dump_names = {f.relpath for f in dumps.files}
    if dumps.files and all(s.relpath in dump_names for s in skipped):  # only .pt files that are not data_{i}.pt
        return _detect_by_keys(root, dumps, ".pt", skip_bad)
    if skipped:
        raise nothing_readable(root, skipped) if skip_bad else skipped[0].error()
    raise SourceError(
        root,
        "no sample files of any known format found: expected data_{i}.pt, data_{i}.ckpt[.gz] or "
        "hidden_states/hs_{i}.safetensors (or Model-Optimizer's <conversation_id>.pt, vLLM's {req_id}.safetensors, "
        "or a NeMo cache: manifest.json + shard-NNNNNN.safetensors)",
    )


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
