"""Readers of every input format h5feed converts (the README's format tables), behind one interface.

Each trainer wrote its hidden states its own way: a list of
per-layer tensors in a ``.pt`` (speculators legacy), pre-concatenated tensors
(speculators v0), tensors with a leading batch dim in a possibly gzipped
``.ckpt`` (SpecForge), ``[T, K+1, H]`` safetensors beside an Arrow dataset
(speculators 0.5+; in FP8 with per-token scales from hs-connectors' fp8 backend),
``<conversation_id>.pt`` dumps (NVIDIA Model-Optimizer),
``rank_*/rows_*/data_{i}.ckpt`` with optional per-token extras (Tencent
AngelSlim), or fixed-length safetensors shards of padded, pre-shifted samples
with the draft-vocab target distribution and no last state (NVIDIA NeMo
Automodel's EAGLE-3 cache), or ``{req_id}.safetensors`` written under a lock by vLLM's
hidden-states connector.

The converter should not care: every format (one module per pipeline) implements
`SourceFormat` (``base``), finds its files through ``discovery``, reads pickles only
through ``safe_load`` and checks keys and shapes with ``checks``, and registers itself
(``registry``: `register_format`), declaring the file names and keys that tell its sources
from the others' (`Detection`); ``registry`` lists them by name and tells a source's format
by asking them all.

Trust: nothing under a source is passed over in silence.  An entry that may hide
samples (an unreadable folder, a broken or looping link, a link out of the
source, a misnamed ``*.pt``) is an error naming it, or with ``skip_bad`` a
recorded skip.

Safety: pickles are only ever read with ``torch.load(weights_only=True)``; a
file that needs code to unpickle is refused, never executed.
"""

# each module registers its formats when imported: this is the order they are listed in (and asked, within a stage)
# isort: off
from h5feed.formats import speculators, specforge, speculators_safetensors, modelopt, angelslim, nemo, vllm  # noqa: F401
# isort: on
from h5feed.formats.angelslim import position_ids_from_rows, position_ids_to_rows
from h5feed.formats.base import (
    DEFAULT_LOCK_TIMEOUT_S,
    Companion,
    Detected,
    Detection,
    ExtraArray,
    SampleShape,
    SourceFormat,
    SourceSample,
)
from h5feed.formats.discovery import Discovery, SkippedEntry, SourceFile
from h5feed.formats.registry import FORMATS, detect_format, last_state_norm_of, register_format, unregister_format

__all__ = [
    "DEFAULT_LOCK_TIMEOUT_S", "FORMATS", "Companion", "Detected", "Detection", "Discovery", "ExtraArray", "SampleShape",
    "SkippedEntry", "SourceFile", "SourceFormat", "SourceSample", "detect_format", "last_state_norm_of",
    "position_ids_from_rows", "position_ids_to_rows", "register_format", "unregister_format",
]
