"""Write synthetic hidden-state sample files in every input format h5feed reads.

Why: tests and benchmarks need files laid out exactly as each trainer writes
them, filled with values that compress like real activations.  Uniform or
constant data makes compression and throughput figures meaningless, so values
are ``N(0, 1) * exp(0.7 * N(0, 1))`` with the log-normal scale fixed per layer
and per hidden column (as real channels have their own magnitude), which gives
a bf16 exponent entropy of about 2.9 bits, as real activations have.

Everything is deterministic in ``seed``: the per-column scales and each
sample's values depend only on (seed, sample index), so the same seed gives the
same activations in every format.

NeMo Automodel caches also hold the draft-vocab target distribution: a bf16
softmax of logits drawn as ``N(0, 2^2) - log(rank)`` (a Zipf prior over the
draft vocabulary, which is sorted by token frequency) with one token per
position lifted by U(4, 14) (a peaked next-token distribution: top-1 ~0.4 on
average).

    python -m h5feed.testing.synthetic DST --format speculators-legacy-pt \\
        --num-samples 100 --hidden-size 7168 --tokens 1500:1900
"""

from __future__ import annotations

import argparse
import fcntl
import gzip
import io
import json
import os
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

FORMAT_NAMES = ("speculators-legacy-pt", "speculators-v0-pt", "specforge-ckpt", "speculators-safetensors",
                "modelopt-pt", "angelslim-ckpt", "nemo-eagle3-cache", "vllm-safetensors")
VARIANTS = {"modelopt-pt": ("hf", "vllm", "trtllm"), "angelslim-ckpt": ("hf", "vllm"),
            "nemo-eagle3-cache": ("full", "topk")}
VOCAB_SIZE = 32000
PAD_ID = VOCAB_SIZE - 1  # the pad id of the synthetic NeMo cache
LOG_SCALE_SIGMA = 0.7
ARROW_BATCH_ROWS = 1000  # datasets' ArrowWriter writes record batches of 1000 rows

__all__ = ["FORMAT_NAMES", "VARIANTS", "FileOptions", "PipelineOptions", "column_scales", "draft_probs", "main",
           "make_sample", "sample_lengths", "write_synthetic"]


@dataclass(frozen=True)
class FileOptions:
    """How the sample files lie and what they hold beside the hidden states.

    layout: "rows" puts ``.pt``/``.ckpt`` files in ``rows_{g}-{g+rows_per_folder}/`` folders (SpecForge, in-house
        pipelines); "flat" (the default) all in the root.
    compress: SpecForge only: ``.ckpt.gz``.
    loss_mask: False leaves the mask out (no key; no Arrow column for safetensors).
    arrow_shards: the shards of the safetensors format's Arrow dataset.
    """

    layout: Literal["flat", "rows"] = "flat"
    rows_per_folder: int = 2000
    compress: bool = False
    loss_mask: bool = True
    arrow_shards: int = 1

    def __post_init__(self) -> None:
        if self.layout not in ("flat", "rows"):
            raise ValueError(f"layout must be 'flat' or 'rows', got {self.layout!r}")


@dataclass(frozen=True)
class PipelineOptions:
    """What the other pipelines' writers choose (Model-Optimizer, AngelSlim, NeMo Automodel).

    variant: the writer (see ``VARIANTS``; None: the first).  modelopt-pt: Model-Optimizer's HF, vLLM or TRT-LLM
        dumper; angelslim-ckpt: AngelSlim's HF or vLLM backend; nemo-eagle3-cache: the target distribution in full
        or as its top ``topk``.
    ranks: angelslim-ckpt: its generator ranks (``rank_<r>`` folders).
    prenorm_flag: modelopt-pt: the ``hidden_states_prenorm`` flag to write (None: none).
    seq_length: nemo-eagle3-cache: S, the length every sample is padded to (None: the longest sample).
    draft_vocab_size: angelslim-ckpt and nemo-eagle3-cache: the draft vocabulary.
    topk, shard_size: nemo-eagle3-cache: k of the top-k variant, samples per shard.
    """

    variant: str | None = None
    ranks: int = 2
    prenorm_flag: bool | None = None
    seq_length: int | None = None
    draft_vocab_size: int = 64
    topk: int = 8
    shard_size: int = 4


def _seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers, so nearby (seed, i) give unrelated streams."""
    return int(
        np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint32).view(np.uint64)[0]
        >> 1
    )


def sample_lengths(num_samples: int, lengths: Sequence[int] | tuple[int, int], seed: int = 0) -> list[int]:
    """Token counts of the samples: a 2-tuple is an inclusive (lo, hi) range, any other sequence is per sample."""
    if isinstance(lengths, tuple) and len(lengths) == 2:
        lo, hi = int(lengths[0]), int(lengths[1])
        if not 1 <= lo <= hi:
            raise ValueError(f"lengths range must satisfy 1 <= lo <= hi, got {lengths}")
        rng = np.random.default_rng(_seed(seed, 0x1E46))
        return [int(x) for x in rng.integers(lo, hi + 1, size=num_samples)]
    out = [int(x) for x in lengths]
    if len(out) != num_samples:
        raise ValueError(f"got {len(out)} lengths for {num_samples} samples (pass a (lo, hi) tuple for a range)")
    if any(x < 1 for x in out):
        raise ValueError("every length must be >= 1")
    return out


def column_scales(hidden_size: int, num_layers: int, seed: int = 0) -> torch.Tensor:
    """float32 [num_layers, H]: exp(0.7 * N(0,1)) per layer and hidden column, fixed for a seed."""
    g = torch.Generator().manual_seed(_seed(seed, 0x5CA1E))
    return torch.exp(LOG_SCALE_SIGMA * torch.randn(num_layers, hidden_size, generator=g))


def make_sample(
    index: int,
    num_tokens: int,
    scales: torch.Tensor,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    with_loss_mask: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """(input_ids [T] int64, loss_mask [T] int64 | None, K+1 layers each [T, H] in dtype) of one sample."""
    g = torch.Generator().manual_seed(_seed(seed, 0xDA7A, index))
    num_layers, hidden = scales.shape
    input_ids = torch.randint(0, VOCAB_SIZE, (num_tokens,), generator=g, dtype=torch.int64)
    loss_mask = None
    if with_loss_mask:
        # A chat sample: the prompt (a prefix) is masked out, the answer is trained on.
        prompt = int(torch.randint(1, max(2, num_tokens // 3) + 1, (1,), generator=g))
        loss_mask = torch.ones(num_tokens, dtype=torch.int64)
        loss_mask[: min(prompt, num_tokens - 1) if num_tokens > 1 else 0] = 0
    layers = []
    for layer in range(num_layers):
        x = torch.randn(num_tokens, hidden, generator=g)
        x.mul_(scales[layer])
        layers.append(x.to(dtype))
    return input_ids, loss_mask, layers


def _folder(root: Path, index: int, layout: str, rows_per_folder: int) -> Path:
    if layout == "flat":
        return root
    g = (index // rows_per_folder) * rows_per_folder
    return root / f"rows_{g}-{g + rows_per_folder}"


def _hf_features(with_loss_mask: bool) -> dict:
    """datasets (>= 4) Features JSON of speculators' preprocessed dataset."""
    seq = {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"}
    feats = {"input_ids": dict(seq)}
    if with_loss_mask:
        feats["loss_mask"] = dict(seq)
    feats["seq_len"] = {"dtype": "int64", "_type": "Value"}
    return feats


def write_arrow_dataset(
    root: Path,
    input_ids: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor | None] | None,
    shards: int = 1,
) -> list[Path]:
    """Write what ``datasets.Dataset.save_to_disk`` writes for speculators' dataset, with pyarrow only.

    Columns ``input_ids`` list<int64>, ``loss_mask`` list<int64>, ``seq_len``
    int64 (speculators ``_append_row``), row i <-> ``hidden_states/hs_{i}``;
    ``data-XXXXX-of-YYYYY.arrow`` Arrow IPC *stream* shards with the HF
    schema metadata, ``state.json`` (format "torch", as speculators'
    ``set_format(type="torch")``) and ``dataset_info.json``.
    """
    import pyarrow as pa

    with_mask = loss_masks is not None
    features = _hf_features(with_mask)
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    fields = [pa.field("input_ids", pa.list_(pa.int64()))]
    if with_mask:
        fields.append(pa.field("loss_mask", pa.list_(pa.int64())))
    fields.append(pa.field("seq_len", pa.int64()))
    schema = pa.schema(fields, metadata=meta)

    def list_array(tensors: Sequence[torch.Tensor]) -> pa.Array:
        lens = np.array([t.shape[0] for t in tensors], dtype=np.int32)
        offsets = np.zeros(len(tensors) + 1, dtype=np.int32)
        np.cumsum(lens, out=offsets[1:])
        values = torch.cat(list(tensors)).numpy() if tensors else np.zeros(0, np.int64)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int64()))

    n = len(input_ids)
    shards = max(1, min(shards, n)) if n else 1
    bounds = [n * s // shards for s in range(shards + 1)]
    files = []
    root.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        name = f"data-{s:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(root / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for b in range(bounds[s], bounds[s + 1], ARROW_BATCH_ROWS):
                e = min(b + ARROW_BATCH_ROWS, bounds[s + 1])
                cols = [list_array(input_ids[b:e])]
                if with_mask:
                    assert loss_masks is not None
                    if any(m is None for m in loss_masks[b:e]):
                        raise ValueError("loss_masks must all be tensors or be None as a whole")
                    cols.append(list_array(loss_masks[b:e]))  # type: ignore[arg-type]
                cols.append(pa.array([int(t.shape[0]) for t in input_ids[b:e]], type=pa.int64()))
                writer.write_batch(pa.record_batch(cols, schema=schema))
        files.append(name)
    state = {
        "_data_files": [{"filename": f} for f in files],
        "_fingerprint": secrets.token_hex(8),
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": "torch",
        "_output_all_columns": False,
        "_split": None,
    }
    (root / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    info = {"citation": "", "description": "", "features": features, "homepage": "", "license": ""}
    (root / "dataset_info.json").write_text(json.dumps(info, indent=2, sort_keys=True))
    return [root / f for f in files]


def write_synthetic(
    root: Path,
    fmt: str,
    num_samples: int,
    hidden_size: int,
    num_aux_layers: int = 3,
    lengths: Sequence[int] | tuple[int, int] = (64, 128),
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    *,
    files: FileOptions = FileOptions(),
    pipeline: PipelineOptions = PipelineOptions(),
) -> list[Path]:
    """Write ``num_samples`` samples under root in format ``fmt``; returns the sample files in index order.

    ``lengths``: a 2-tuple is an inclusive token range, any other sequence one
    length per sample.  `files`: how the files lie and what they hold beside the states (`FileOptions`).
    ``vllm-safetensors`` writes ``req-{i:06d}.safetensors`` as vLLM's connector does (under a released
    ``.lock``), with speculators' Arrow dataset beside them for the loss masks (none without a loss mask).

    The other pipelines (Model-Optimizer, AngelSlim, NeMo Automodel) take the choices of their writers in
    `pipeline` (`PipelineOptions`): ``modelopt-pt`` writes ``conv_{i:06d}.pt`` as Model-Optimizer's HF, vLLM or
    TRT-LLM dumper does; ``angelslim-ckpt`` writes ``rank_<r>/rows_0-5000/data_<i>.ckpt`` for its generator ranks
    (i counts within a rank) and ``vocab_mapping.pt``, from its HF backend or its vLLM backend (``inputs_embeds``,
    ``position_ids``); ``nemo-eagle3-cache`` writes NeMo Automodel's cache: samples padded to ``seq_length``,
    shifted, ``shard_size`` per shard, with the draft-vocab target distribution in full or as its top k.  For
    those, the returned paths are the samples' source files as ``FORMATS[fmt].discover`` lists them
    (``shard-NNNNNN.safetensors#row`` for NeMo).
    """
    layout, compress, rows_per_folder, loss_mask = files.layout, files.compress, files.rows_per_folder, files.loss_mask
    variant = pipeline.variant
    if fmt not in FORMAT_NAMES:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMAT_NAMES)}")
    if variant is not None and variant not in VARIANTS.get(fmt, ()):
        raise ValueError(f"{fmt} has no variant {variant!r} (variants: {', '.join(VARIANTS.get(fmt, ())) or 'none'})")
    if compress and fmt != "specforge-ckpt":
        raise ValueError("compress=True exists only for specforge-ckpt (.ckpt.gz)")
    if layout == "rows" and fmt in ("speculators-safetensors", "vllm-safetensors"):
        raise ValueError(f"{fmt} has a fixed layout; use layout='flat'")
    if fmt in VARIANTS and (layout != "flat" or rows_per_folder != 2000):
        raise ValueError(f"{fmt} has its own folder layout; leave layout and rows_per_folder as they are")
    if num_aux_layers < 1 or hidden_size < 1 or num_samples < 0:
        raise ValueError("need num_aux_layers >= 1, hidden_size >= 1, num_samples >= 0")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    lens = sample_lengths(num_samples, lengths, seed)
    if fmt in VARIANTS:
        variant = variant or VARIANTS[fmt][0]
        if fmt == "modelopt-pt":
            return _write_modelopt(root, lens, hidden_size, num_aux_layers, seed, dtype, loss_mask, variant,
                                   pipeline.prenorm_flag)
        if fmt == "angelslim-ckpt":
            return _write_angelslim(root, lens, hidden_size, num_aux_layers, seed, dtype, variant, pipeline.ranks,
                                    pipeline.draft_vocab_size)
        return _write_nemo_cache(root, lens, hidden_size, num_aux_layers, seed, dtype, variant,
                                 pipeline.seq_length or max(lens, default=1), pipeline.draft_vocab_size, pipeline.topk,
                                 pipeline.shard_size)
    scales = column_scales(hidden_size, num_aux_layers + 1, seed)
    written: list[Path] = []
    all_ids: list[torch.Tensor] = []
    all_masks: list[torch.Tensor | None] = []
    if fmt in ("speculators-safetensors", "vllm-safetensors"):
        from safetensors.torch import save_file
    if fmt == "speculators-safetensors":
        (root / "hidden_states").mkdir(exist_ok=True)

    for i, t in enumerate(lens):
        ids, mask, layers = make_sample(i, t, scales, seed, dtype, loss_mask)
        folder = _folder(root, i, layout, rows_per_folder)
        folder.mkdir(parents=True, exist_ok=True)
        if fmt == "speculators-legacy-pt":
            d: dict = {"input_ids": ids, "hidden_states": layers}
            if mask is not None:
                d["loss_mask"] = mask
            path = folder / f"data_{i}.pt"
            torch.save(d, path)
        elif fmt == "speculators-v0-pt":
            d = {"input_ids": ids, "hidden_state": torch.cat(layers[:-1], dim=-1), "target": layers[-1]}
            if mask is not None:
                d["loss_mask"] = mask
            path = folder / f"data_{i}.pt"
            torch.save(d, path)
        elif fmt == "specforge-ckpt":
            d = {"input_ids": ids}
            if mask is not None:
                d["loss_mask"] = mask
            d["hidden_state"] = layers[-1].unsqueeze(0)
            d["aux_hidden_state"] = torch.cat(layers[:-1], dim=-1).unsqueeze(0)
            if compress:
                path = folder / f"data_{i}.ckpt.gz"
                buf = io.BytesIO()
                torch.save(d, buf)
                with gzip.open(path, "wb", compresslevel=1) as f:
                    f.write(buf.getbuffer())
            else:
                path = folder / f"data_{i}.ckpt"
                torch.save(d, path)
        else:
            hs = torch.stack(layers, dim=1)  # [T, K+1, H]
            if fmt == "vllm-safetensors":
                path = root / f"req-{i:06d}.safetensors"
                lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock, fcntl.LOCK_EX)  # as vLLM's connector: held while the file is written
                try:
                    save_file({"hidden_states": hs, "token_ids": ids}, str(path))
                finally:
                    os.close(lock)
            else:
                path = root / "hidden_states" / f"hs_{i}.safetensors"
                save_file({"hidden_states": hs, "token_ids": ids}, str(path))
            all_ids.append(ids)
            all_masks.append(mask)
        written.append(path)

    if fmt in ("speculators-legacy-pt", "speculators-v0-pt"):
        # speculators' generator writes exact lengths beside the files
        (root / "sample_lengths.json").write_text(json.dumps({str(i): t for i, t in enumerate(lens)}))
    if fmt == "speculators-safetensors" or (fmt == "vllm-safetensors" and loss_mask):
        write_arrow_dataset(root, all_ids, all_masks if loss_mask else None, shards=files.arrow_shards)
    return written


def _write_modelopt(root: Path, lens: list[int], hidden: int, k: int, seed: int, dtype: torch.dtype,
                    with_loss_mask: bool, dumper: str, prenorm_flag: bool | None) -> list[Path]:
    """Model-Optimizer's ``collect_hidden_states`` dumps: one ``<conversation_id>.pt`` per conversation.

    hf / vllm: ``input_ids``, ``hidden_states`` (the last state), ``aux_hidden_states``, ``loss_mask``,
    ``conversation_id`` (the vLLM dump's last state is pre-norm, the HF one's post-norm: the files look
    alike); trtllm: TensorRT-LLM's ``hidden_state_features`` for the aux states and no loss mask."""
    scales = column_scales(hidden, k + 1, seed)
    written = []
    for i, t in enumerate(lens):
        ids, mask, layers = make_sample(i, t, scales, seed, dtype, with_loss_mask and dumper != "trtllm")
        conversation_id = f"conv_{i:06d}"
        d: dict = {"input_ids": ids, "hidden_states": layers[-1]}
        d["hidden_state_features" if dumper == "trtllm" else "aux_hidden_states"] = torch.cat(layers[:-1], dim=-1)
        if mask is not None:
            d["loss_mask"] = mask
        d["conversation_id"] = conversation_id
        if prenorm_flag is not None:
            d["hidden_states_prenorm"] = prenorm_flag
        path = root / f"{conversation_id}.pt"
        torch.save(d, path)
        written.append(path)
    return written


def _write_angelslim(root: Path, lens: list[int], hidden: int, k: int, seed: int, dtype: torch.dtype,
                     backend: str, ranks: int, draft_vocab_size: int) -> list[Path]:
    """AngelSlim's ``generate_hidden_for_draft_model.py``: the dataset split into ``ranks`` contiguous blocks,
    rank r writing ``rank_r/rows_0-5000/data_<i>.ckpt`` with i counting its own samples, then
    ``vocab_mapping.pt`` (``d2t`` [Vd] int64, ``t2d`` [V] bool) at the top."""
    scales = column_scales(hidden, k + 2, seed)  # one more "layer": the vLLM backend's inputs_embeds
    written = []
    bounds = [len(lens) * r // max(ranks, 1) for r in range(max(ranks, 1) + 1)]
    counts: dict[int, int] = {}
    for r in range(max(ranks, 1)):
        for i, g in enumerate(range(bounds[r], bounds[r + 1])):
            ids, mask, layers = make_sample(g, lens[g], scales, seed, dtype)
            assert mask is not None
            d: dict = {"input_ids": ids[None], "loss_mask": mask[None],
                       "hidden_states": torch.cat(layers[:k], dim=-1)[None], "target_hiddens": layers[k][None]}
            if backend == "vllm":
                d["inputs_embeds"] = layers[k + 1][None]
                d["position_ids"] = torch.arange(lens[g], dtype=torch.int64)  # vLLM's flattened positions
            folder = root / f"rank_{r}" / f"rows_{i // 5000 * 5000}-{i // 5000 * 5000 + 5000}"
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(d, folder / f"data_{i}.ckpt")
            written.append(folder / f"data_{i}.ckpt")
            for token in ids[mask == 1].tolist():
                counts[token] = counts.get(token, 0) + 1
    frequent = sorted(counts, key=lambda tok: (-counts[tok], tok))[:draft_vocab_size]
    d2t = torch.zeros(draft_vocab_size, dtype=torch.int64)
    d2t[: len(frequent)] = torch.tensor(sorted(frequent), dtype=torch.int64) - torch.arange(len(frequent))
    t2d = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    t2d[sorted(frequent)] = True
    torch.save({"d2t": d2t, "t2d": t2d}, root / "vocab_mapping.pt")
    return sorted(written, key=lambda p: (int(p.stem.split("_")[1]), p.relative_to(root).as_posix()))


def draft_probs(g: torch.Generator, rows: int, vocab: int, sigma: float = 2.0) -> torch.Tensor:
    """float32 [rows, vocab]: next-token distributions over a frequency-sorted draft vocabulary (module docstring);
    `sigma` is the logits' spread."""
    z = torch.randn(rows, vocab, generator=g) * sigma - torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    peak = torch.randint(0, vocab, (rows,), generator=g)
    z[torch.arange(rows), peak] += 4 + 10 * torch.rand(rows, generator=g)
    return torch.softmax(z, dim=-1)


def _shift_left_with_zero(t: torch.Tensor) -> torch.Tensor:
    """NeMo's `_shift_left_with_zero` on one sample: drop position 0, zero-fill the last."""
    return torch.cat((t[1:], torch.zeros_like(t[:1])))


def _write_nemo_cache(root: Path, lens: list[int], hidden: int, k: int, seed: int, dtype: torch.dtype, variant: str,
                      seq_length: int, draft_vocab_size: int, topk: int, shard_size: int) -> list[Path]:
    """NeMo Automodel's ``precompute_eagle3`` cache: every sample right-padded to ``seq_length`` with the pad id,
    run through the target (the pad tokens get activations and distributions too), then ``input_ids``,
    ``loss_mask`` and the logits shifted left with a zero fill; ``position_mask`` = the target's top token is
    in the draft vocabulary (here: 9 times in 10) and the shifted loss mask is set."""
    from safetensors.torch import save_file

    if any(t > seq_length for t in lens):
        raise ValueError(f"a sample of {max(lens)} tokens does not fit seq_length {seq_length}")
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    scales = column_scales(hidden, k + 1, seed)
    samples = []
    for i, t in enumerate(lens):
        ids, mask, layers = make_sample(i, t, scales, seed, dtype)
        assert mask is not None
        pad = seq_length - t
        _, _, pad_layers = make_sample(10**6 + i, max(pad, 1), scales, seed, dtype, with_loss_mask=False)
        g = torch.Generator().manual_seed(_seed(seed, 0x9E0, i))
        probs = draft_probs(g, seq_length, draft_vocab_size)
        probs[-1] = torch.softmax(torch.zeros(draft_vocab_size), dim=-1)  # the shift's zero-filled logits
        loss = _shift_left_with_zero(torch.cat((mask, torch.zeros(pad, dtype=torch.int64))))
        sample = {
            "input_ids": _shift_left_with_zero(torch.cat((ids, torch.full((pad,), PAD_ID, dtype=torch.int64)))),
            "attention_mask": torch.cat((torch.ones(t, dtype=torch.int64), torch.zeros(pad, dtype=torch.int64))),
            "loss_mask": loss,
            "aux_hidden_states": torch.cat((torch.cat(layers[:k], -1), torch.cat(pad_layers[:k], -1)[:pad])),
            "position_mask": ((torch.rand(seq_length, generator=g) < 0.9) & loss.bool())[:, None],
        }
        if variant == "topk":
            kk = min(topk, draft_vocab_size)
            values, indices = torch.topk(probs, kk, dim=-1)
            values = values / values.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
            sample["target_probs_values"], sample["target_probs_indices"] = values.to(dtype), indices.to(torch.int32)
        else:
            sample["target_probs"] = probs.to(dtype)
        samples.append(sample)
    written = []
    for s in range(-(-len(lens) // shard_size)):
        block = samples[s * shard_size : (s + 1) * shard_size]
        name = f"shard-{s:06d}.safetensors"
        save_file({key: torch.stack([b[key] for b in block]).contiguous() for key in block[0]}, str(root / name))
        written += [root / f"{name}#{row}" for row in range(len(block))]
    manifest = {
        "format_version": 2, "target_model": "synthetic", "target_vocab_size": VOCAB_SIZE,
        "draft_vocab_size": draft_vocab_size, "seq_length": seq_length, "dtype": names[dtype],
        "num_samples": len(lens), "shard_size": shard_size, "target_probs_topk": topk if variant == "topk" else 0,
        "aux_hidden_dim": k * hidden, "aux_layer_ids": list(range(1, k + 1)),
        "selected_token_ids": list(range(draft_vocab_size)), "input_data": "synthetic", "split": None,
        "shuffle_seed": seed,
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    # A stand-in for the target's input-embedding table (NeMo stores [V, H] fp32); 256 rows keep it small.
    save_file({"weight": torch.randn(256, hidden, generator=torch.Generator().manual_seed(seed))},
              str(root / "target_embeddings.safetensors"))
    return written


def _parse_tokens(text: str) -> Sequence[int] | tuple[int, int]:
    if ":" in text:
        lo, hi = text.split(":", 1)
        return (int(lo), int(hi))
    if "," in text:
        return [int(x) for x in text.split(",")]
    return (int(text), int(text))


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: write a synthetic source folder."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("dst", type=Path, help="folder to write into (created)")
    p.add_argument("--format", required=True, choices=FORMAT_NAMES)
    p.add_argument("--num-samples", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--aux-layers", type=int, default=3, help="K, the number of auxiliary layers (default 3)")
    p.add_argument(
        "--tokens", type=_parse_tokens, default=(64, 128), help="LO:HI range, N, or N1,N2,... (default 64:128)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    p.add_argument("--layout", choices=("flat", "rows"), default="flat")
    p.add_argument("--rows-per-folder", type=int, default=2000)
    p.add_argument("--compress", action="store_true", help="specforge-ckpt only: write .ckpt.gz")
    p.add_argument("--no-loss-mask", action="store_true", help="leave the loss mask out")
    p.add_argument("--arrow-shards", type=int, default=1, help="speculators-safetensors: Arrow shards")
    p.add_argument("--variant", help="modelopt-pt: hf, vllm, trtllm; angelslim-ckpt: hf, vllm; "
                   "nemo-eagle3-cache: full, topk (default: the first)")
    p.add_argument("--ranks", type=int, default=2, help="angelslim-ckpt: generator ranks (rank_<r> folders)")
    p.add_argument("--prenorm-flag", choices=("true", "false"), help="modelopt-pt: write hidden_states_prenorm")
    p.add_argument("--seq-length", type=int, help="nemo-eagle3-cache: S (default: the longest sample)")
    p.add_argument("--draft-vocab-size", type=int, default=64, help="angelslim-ckpt, nemo-eagle3-cache (default 64)")
    p.add_argument("--topk", type=int, default=8, help="nemo-eagle3-cache --variant topk: k (default 8)")
    p.add_argument("--shard-size", type=int, default=4, help="nemo-eagle3-cache: samples per shard (default 4)")
    a = p.parse_args(argv)
    try:
        written = write_synthetic(
            a.dst, a.format, a.num_samples, a.hidden_size, a.aux_layers, a.tokens, a.seed, _DTYPES[a.dtype],
            files=FileOptions(a.layout, a.rows_per_folder, a.compress, not a.no_loss_mask, a.arrow_shards),
            pipeline=PipelineOptions(a.variant, a.ranks, None if a.prenorm_flag is None else a.prenorm_flag == "true",
                                     a.seq_length, a.draft_vocab_size, a.topk, a.shard_size),
        )
    except ValueError as e:
        p.error(str(e))
    total = sum(f.stat().st_size for f in {f.with_name(f.name.partition("#")[0]) for f in written})
    print(f"wrote {len(written)} {a.format} samples to {a.dst} ({total / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
