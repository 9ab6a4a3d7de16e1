"""NVIDIA NeMo Automodel's EAGLE-3 cache: ``manifest.json`` and fixed-length ``shard-NNNNNN.safetensors`` shards."""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from h5feed.errors import SourceError
from h5feed.formats.base import Companion, Detected, Detection, ExtraArray, SampleShape, SourceFormat, SourceSample
from h5feed.formats.checks import fmt_shape, require_keys
from h5feed.formats.discovery import Discovery, SkippedEntry, SourceFile, check_root
from h5feed.formats.registry import register_format
from h5feed.formats.safetensors_file import open_safetensors, tensor_meta
from h5feed.io.paths import regular_file
from h5feed.store.layout import LastStateNorm, dtype_name

__all__ = ["NemoEagle3Cache"]


@dataclass(frozen=True)
class _NemoManifest:
    seq_length: int
    draft_vocab_size: int
    num_samples: int
    shard_size: int
    topk: int  # 0: target_probs stored in full
    hidden_size: int
    num_aux_layers: int
    dtype: torch.dtype
    format_version: int

    @property
    def prob_keys(self) -> tuple[str, ...]:
        return ("target_probs_values", "target_probs_indices") if self.topk else ("target_probs",)


@register_format
class NemoEagle3Cache(SourceFormat):
    """G: NeMo Automodel's EAGLE-3 cache: ``manifest.json`` and ``shard-NNNNNN.safetensors``, each holding
    ``shard_size`` samples padded to ``seq_length`` S: ``input_ids``, ``loss_mask`` (both shifted left by one
    with a zero fill: token 0 is gone), ``attention_mask``, ``aux_hidden_states`` [S, K*H], ``position_mask``
    [S, 1] and the draft-vocab target distribution, full (``target_probs`` [S, Vd]) or top-k
    (``target_probs_values``, ``target_probs_indices`` [S, k]).  No last hidden state.

    A sample is ``shard-NNNNNN.safetensors#o`` (row o of that shard); its index is its place in the cache.
    Only its real tokens are kept (the right padding NeMo's dataloader added, whose rows the trainer masks
    out): the padding must be exactly what the precompute writes, or the sample is refused.
    """

    name = "nemo-eagle3-cache"
    detection = Detection(Detected.BY_LAYOUT, "a NeMo cache: manifest.json + shard-NNNNNN.safetensors")
    last_state_norm: LastStateNorm | None = None
    has_last_state = False
    ids_shifted = True
    pattern = re.compile(r"shard-(\d{6})\.safetensors")
    what = "shard-NNNNNN.safetensors"
    extensions = (".safetensors",)
    _common_keys = ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "position_mask")

    def __init__(self) -> None:
        self._manifests: dict[tuple[str, int], tuple[_NemoManifest, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    # --- the cache ------------------------------------------------------------------------------
    def recognizes(self, root: Path) -> bool:
        """A manifest.json beside shard files at the top of the source."""
        return (root / "manifest.json").is_file() and any(self.pattern.fullmatch(p.name) for p in root.iterdir())

    def _manifest(self, root: Path) -> tuple[_NemoManifest, dict[str, Any]]:
        path = Path(os.path.abspath(root)) / "manifest.json"
        try:
            stamp = path.stat().st_mtime_ns
        except OSError as exc:
            raise SourceError(path, "missing: a NeMo Automodel EAGLE-3 cache has a manifest.json beside its shards") from exc
        with self._lock:
            cached = self._manifests.get((str(path), stamp))
        if cached is None:
            cached = (self._parse_manifest(path), json.loads(path.read_text()))
            with self._lock:
                self._manifests[(str(path), stamp)] = cached
        return cached

    def _parse_manifest(self, path: Path) -> _NemoManifest:
        try:
            m = json.loads(path.read_text())
            version = m.get("format_version")
            if version not in (1, 2):
                raise SourceError(path, f"format_version {version!r} is not a NeMo EAGLE-3 cache version h5feed reads (1, 2)")
            aux_layers = len(m["aux_layer_ids"])
            aux_dim = int(m["aux_hidden_dim"])
            if aux_layers < 1 or aux_dim % aux_layers:
                raise SourceError(path, f"aux_hidden_dim {aux_dim} is not a multiple of the {aux_layers} aux_layer_ids")
            draft_vocab = int(m["draft_vocab_size"])
            topk = int(m.get("target_probs_topk") or 0)
            manifest = _NemoManifest(
                seq_length=int(m["seq_length"]), draft_vocab_size=draft_vocab, num_samples=int(m["num_samples"]),
                shard_size=int(m["shard_size"]), topk=topk if 0 < topk < draft_vocab else 0,
                hidden_size=aux_dim // aux_layers, num_aux_layers=aux_layers, dtype=_NEMO_DTYPES[m["dtype"]],
                format_version=version,
            )
        except SourceError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SourceError(path, f"not a readable NeMo EAGLE-3 cache manifest ({type(exc).__name__}: {exc})") from exc
        if min(manifest.seq_length, manifest.shard_size, manifest.num_samples, manifest.draft_vocab_size) < 1:
            raise SourceError(path, "seq_length, shard_size, num_samples and draft_vocab_size must all be positive")
        return manifest

    def scan(self, root: Path, skip_bad: bool = False, lock_timeout: float = 0.0) -> Discovery:
        root = Path(os.path.abspath(check_root(root)))
        manifest, _ = self._manifest(root)
        shards: dict[int, str] = {}
        skipped: list[SkippedEntry] = []
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            m = self.pattern.fullmatch(entry.name)
            if m:
                shards[int(m.group(1))] = regular_file(entry.path).name  # a FIFO would block its reader for ever
            elif entry.name.endswith(".safetensors") and entry.name != _NEMO_EMBEDDINGS:
                skipped.append(SkippedEntry(Path(entry.path), entry.name,
                                            f"has a sample file's extension but its name does not match {self.what}"))
        if skipped and not skip_bad:
            raise skipped[0].error()
        count = -(-manifest.num_samples // manifest.shard_size)
        if sorted(shards) != list(range(count)):
            missing = [f"shard-{s:06d}.safetensors" for s in range(count) if s not in shards]
            extra = [shards[s] for s in sorted(shards) if s >= count]
            raise SourceError(root, f"manifest.json declares {manifest.num_samples} samples in {count} shard(s) of "
                              f"{manifest.shard_size}, but " + (f"{', '.join(missing[:3])} is missing" if missing else
                              f"{', '.join(extra[:3])} is past them") + ": the cache is incomplete or mixed "
                              "(NeMo's reader refuses it too)")
        files = []
        for sample in range(manifest.num_samples):
            member = f"{shards[sample // manifest.shard_size]}#{sample % manifest.shard_size}"
            files.append(SourceFile(root / member, sample, member))
        return Discovery(files, skipped)

    def search(self, root: Path) -> Discovery:
        absroot = Path(os.path.abspath(root))
        if not (absroot / "manifest.json").is_file():
            return Discovery([], [])
        return self.scan(absroot, skip_bad=True)

    @staticmethod
    def _member(source: SourceFile) -> tuple[Path, int]:
        """(the shard file, the sample's row in it) of ``shard-NNNNNN.safetensors#o``."""
        name, _, row = source.path.name.partition("#")
        if not row.isdigit():
            raise SourceError(source.path, "not a sample of a NeMo cache (expected shard-NNNNNN.safetensors#ROW)")
        return source.path.with_name(name), int(row)

    def _root(self, source: SourceFile) -> Path:
        return source.path.parent

    # --- one sample ------------------------------------------------------------------------------
    def _rows(self, f: Any, path: Path, manifest: _NemoManifest, shard_rows: int) -> None:
        """Checks the shard's keys, dtypes and shapes against the manifest, from its header alone."""
        keys = self._common_keys + manifest.prob_keys
        require_keys(path, list(f.keys()), keys, self.name)
        s, k = manifest.seq_length, manifest.topk
        want = {"input_ids": ((s,), (torch.int64,)), "attention_mask": ((s,), (torch.int64,)),
                "loss_mask": ((s,), (torch.int64,)),
                "aux_hidden_states": ((s, manifest.hidden_size * manifest.num_aux_layers), (manifest.dtype,)),
                "position_mask": ((s, 1), (torch.bool,)), "target_probs": ((s, manifest.draft_vocab_size), (manifest.dtype,)),
                "target_probs_values": ((s, k), (manifest.dtype,)), "target_probs_indices": ((s, k), (torch.int32,))}
        for key in keys:
            meta = tensor_meta(f, key)
            shape, dtypes = want[key]
            if tuple(meta.shape) != (shard_rows, *shape) or meta.dtype not in dtypes:
                raise SourceError(path, f"{key!r} is {fmt_shape(meta)} {meta.dtype}; the manifest says "
                                  f"[{shard_rows}, {', '.join(map(str, shape))}] {dtypes[0]}")

    def _open(self, source: SourceFile) -> tuple[_NemoManifest, Path, int, int]:
        manifest, _ = self._manifest(self._root(source))
        shard, row = self._member(source)
        rows = min(manifest.shard_size, manifest.num_samples - source.sample_index // manifest.shard_size * manifest.shard_size)
        if not 0 <= row < rows or row != source.sample_index % manifest.shard_size:
            raise SourceError(shard, f"has no sample {row} for sample {source.sample_index} of the cache "
                              f"(it holds {rows} of {manifest.shard_size} per shard)")
        return manifest, shard, row, rows

    def probe(self, source: SourceFile) -> SampleShape:
        manifest, shard, row, rows = self._open(source)
        with open_safetensors(shard) as f:
            self._rows(f, shard, manifest, rows)
            t = self._real_length(shard, row, f.get_slice("attention_mask")[row])
        return self._shape(manifest, t)

    def load(self, source: SourceFile) -> SourceSample:
        manifest, shard, row, rows = self._open(source)
        with open_safetensors(shard) as f:
            self._rows(f, shard, manifest, rows)
            d = {key: f.get_slice(key)[row] for key in self._common_keys + manifest.prob_keys}
        t = self._real_length(shard, row, d["attention_mask"])
        self._check_padding(shard, row, d, t, manifest.seq_length)
        extras = {"position_mask": d["position_mask"][:t, 0].contiguous()}
        extras.update({key: d[key][:t].contiguous() for key in manifest.prob_keys})
        return SourceSample(
            input_ids=d["input_ids"][:t].contiguous(), loss_mask=d["loss_mask"][:t].contiguous(),
            aux_parts=[d["aux_hidden_states"][:t].contiguous()], last_hidden_state=None, extras=extras,
            hidden_size=manifest.hidden_size,
        )

    def _shape(self, manifest: _NemoManifest, t: int) -> SampleShape:
        probs = ((ExtraArray("target_probs_values", dtype_name(manifest.dtype), manifest.topk),
                  ExtraArray("target_probs_indices", "int32", manifest.topk)) if manifest.topk else
                 (ExtraArray("target_probs", dtype_name(manifest.dtype), manifest.draft_vocab_size),))
        return SampleShape(t, manifest.hidden_size, manifest.num_aux_layers, manifest.dtype,
                           (ExtraArray("position_mask", "bool", 1), *probs))

    @staticmethod
    def _real_length(shard: Path, row: int, attention_mask: torch.Tensor) -> int:
        """T: the sample's real tokens, from its attention mask (ones, then the right padding's zeros)."""
        t = int(attention_mask.sum())
        if t == 0:
            raise SourceError(shard, f"sample {row} is empty: its attention_mask has no token")
        expected = torch.zeros_like(attention_mask)
        expected[:t] = 1
        if not torch.equal(attention_mask, expected):
            raise SourceError(shard, f"sample {row}'s attention_mask is not {t} ones then zeros (the right padding "
                              "NeMo's precompute writes): h5feed keeps the real tokens only and cannot tell them here")
        return t

    @staticmethod
    def _check_padding(shard: Path, row: int, d: dict[str, torch.Tensor], t: int, s: int) -> None:
        """The dropped rows must be padding the trainer never sees: no loss, no supervised position, and ids
        that the flavor rebuilds exactly (the pad id shifted left by one, then the shift's zero fill)."""
        problems = []
        if bool(d["loss_mask"][t:].any()):
            problems.append("loss_mask is not 0 there")
        if bool(d["position_mask"][t:].any()):
            problems.append("position_mask is not False there")
        ids = d["input_ids"]
        if t < s and (int(ids[s - 1]) != 0 or not bool((ids[t : s - 1] == ids[t - 1]).all())):
            problems.append("input_ids are not the pad id shifted left by one (then 0)")
        if problems:
            raise SourceError(shard, f"sample {row}'s padding (rows {t} to {s}) is not what NeMo's precompute writes: "
                              f"{'; '.join(problems)}; h5feed drops padding only when nothing in it is lost")

    def source_info(self, root: Path) -> dict[str, Any]:
        manifest, raw = self._manifest(root)
        return {"seq_length": manifest.seq_length, "draft_vocab_size": manifest.draft_vocab_size,
                "target_probs_topk": manifest.topk, "manifest_format_version": manifest.format_version,
                "aux_layer_ids": list(raw["aux_layer_ids"])}

    def companions(self, root: Path) -> list[Companion]:
        root = Path(os.path.abspath(root))
        kept = [Companion(root / "manifest.json", "manifest.json", copy=True)]
        if (root / _NEMO_EMBEDDINGS).is_file():  # the target's embedding table, [V, H] fp32: recorded, not copied
            kept.append(Companion(root / _NEMO_EMBEDDINGS, _NEMO_EMBEDDINGS, copy=False))
        return kept

    def source_nbytes(self, source: SourceFile) -> int:
        _, shard, _, rows = self._open(source)
        return shard.stat().st_size // rows


_NEMO_EMBEDDINGS = "target_embeddings.safetensors"
_NEMO_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
