"""Write synthetic hidden-state sample files in every input format of FORMATS.md.

Why: tests and benchmarks need files laid out exactly as each trainer writes
them, filled with values that compress like real activations.  Uniform or
constant data makes compression and throughput figures meaningless, so values
are ``N(0, 1) * exp(0.7 * N(0, 1))`` with the log-normal scale fixed per layer
and per hidden column (as real channels have their own magnitude), which gives
a bf16 exponent entropy of about 2.9 bits (DESIGN.md).

Everything is deterministic in ``seed``: the per-column scales and each
sample's values depend only on (seed, sample index), so the same seed gives the
same activations in every format.

    python -m h5feed.synthetic DST --format speculators-legacy-pt \\
        --num-samples 100 --hidden-size 7168 --tokens 1500:1900
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

if TYPE_CHECKING:
    from h5feed.formats import FormatName

FORMAT_NAMES = ("speculators-legacy-pt", "speculators-v0-pt", "specforge-ckpt", "speculators-safetensors")
VOCAB_SIZE = 32000
LOG_SCALE_SIGMA = 0.7
ARROW_BATCH_ROWS = 1000  # datasets' ArrowWriter writes record batches of 1000 rows

__all__ = ["FORMAT_NAMES", "column_scales", "main", "make_sample", "sample_lengths", "write_synthetic"]


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
    fmt: FormatName,
    num_samples: int,
    hidden_size: int,
    num_aux_layers: int = 3,
    lengths: Sequence[int] | tuple[int, int] = (64, 128),
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    layout: Literal["flat", "rows"] = "flat",
    compress: bool = False,
    rows_per_folder: int = 2000,
    loss_mask: bool = True,
    *,
    arrow_shards: int = 1,
) -> list[Path]:
    """Write ``num_samples`` samples under root in format ``fmt``; returns the sample files in index order.

    ``lengths``: a 2-tuple is an inclusive token range, any other sequence one
    length per sample.  ``layout="rows"`` puts ``.pt``/``.ckpt`` files in
    ``rows_{g}-{g+rows_per_folder}/`` folders (SpecForge, in-house pipelines).
    ``compress`` (SpecForge only) writes ``.ckpt.gz``.  ``loss_mask=False``
    leaves the mask out (no key; no Arrow column for safetensors).
    ``arrow_shards`` splits the safetensors format's Arrow dataset in shards.
    """
    if fmt not in FORMAT_NAMES:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMAT_NAMES)}")
    if layout not in ("flat", "rows"):
        raise ValueError(f"layout must be 'flat' or 'rows', got {layout!r}")
    if compress and fmt != "specforge-ckpt":
        raise ValueError("compress=True exists only for specforge-ckpt (.ckpt.gz)")
    if layout == "rows" and fmt == "speculators-safetensors":
        raise ValueError("speculators-safetensors has a fixed hidden_states/ layout; use layout='flat'")
    if num_aux_layers < 1 or hidden_size < 1 or num_samples < 0:
        raise ValueError("need num_aux_layers >= 1, hidden_size >= 1, num_samples >= 0")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    lens = sample_lengths(num_samples, lengths, seed)
    scales = column_scales(hidden_size, num_aux_layers + 1, seed)
    written: list[Path] = []
    all_ids: list[torch.Tensor] = []
    all_masks: list[torch.Tensor | None] = []
    if fmt == "speculators-safetensors":
        from safetensors.torch import save_file

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
            path = root / "hidden_states" / f"hs_{i}.safetensors"
            save_file({"hidden_states": hs, "token_ids": ids}, str(path))
            all_ids.append(ids)
            all_masks.append(mask)
        written.append(path)

    if fmt in ("speculators-legacy-pt", "speculators-v0-pt"):
        # speculators' generator writes exact lengths beside the files
        (root / "sample_lengths.json").write_text(json.dumps({str(i): t for i, t in enumerate(lens)}))
    if fmt == "speculators-safetensors":
        write_arrow_dataset(root, all_ids, all_masks if loss_mask else None, shards=arrow_shards)
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
    a = p.parse_args(argv)
    try:
        files = write_synthetic(
            a.dst,
            a.format,
            a.num_samples,
            a.hidden_size,
            a.aux_layers,
            a.tokens,
            a.seed,
            _DTYPES[a.dtype],
            a.layout,
            a.compress,
            a.rows_per_folder,
            not a.no_loss_mask,
            arrow_shards=a.arrow_shards,
        )
    except ValueError as e:
        p.error(str(e))
    total = sum(os.path.getsize(f) for f in files)
    print(f"wrote {len(files)} {a.format} samples to {a.dst} ({total / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
