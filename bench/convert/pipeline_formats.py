"""Compression of the Model-Optimizer, AngelSlim and NeMo Automodel formats' arrays, and a codec sweep for
NeMo's stored target distribution (bf16 probabilities, not activations).

    python bench/convert/pipeline_formats.py --hidden-size 4096 --samples 4 --tokens 768:1024 --out /tmp/pipeline-bench

1. Writes a synthetic set in each format (h5feed.testing.synthetic: realistic activations; NeMo's target
   distribution a bf16 softmax of realistic logits over a 32000-token draft vocabulary), converts it
   with `--codec zstd` and `--codec lz4`, and prints each array's ratio (raw bytes / stored bytes) and the
   source files' bytes over the store's (a NeMo cache also loses its padding).
2. Encodes the target distribution's chunks (256 tokens) with Blosc codecs one core at a time and
   prints ratio, encode and decode MB/s, for logits of three spreads (the default model is sigma 2).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
import torch

import h5feed
from h5feed.store import Store
from h5feed.testing.synthetic import PipelineOptions, draft_probs, write_synthetic

SETS = (("modelopt-pt", "hf", "post"), ("angelslim-ckpt", "vllm", "post"), ("nemo-eagle3-cache", "full", None),
        ("nemo-eagle3-cache", "topk", None))
SWEEP = (("zstd", 1, "shuffle"), ("zstd", 1, "bitshuffle"), ("zstd", 3, "shuffle"), ("zstd", 1, "noshuffle"),
         ("lz4", 5, "bitshuffle"), ("lz4", 5, "shuffle"), ("lz4hc", 5, "shuffle"))


def array_ratios(store_path: Path) -> dict[str, float]:
    store = Store(store_path)
    tokens = int(store.sample_lengths.sum())
    out = {}
    for name in store.info.array_names:
        stored = sum(f.stat().st_size for f in (store_path / name).rglob("*") if f.is_file())
        out[name] = tokens * store.info.row_nbytes(name) / stored
    return out


def sweep(chunks: list[np.ndarray]) -> list[tuple[str, float, float, float]]:
    from numcodecs import Blosc, blosc

    blosc.set_nthreads(1)
    raw = sum(c.nbytes for c in chunks)
    rows = []
    for cname, level, shuffle in SWEEP:
        codec = Blosc(cname=cname, clevel=level, shuffle={"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[shuffle],
                      blocksize=1 << 20)
        t0 = time.perf_counter()
        encoded = [codec.encode(c) for c in chunks]
        t1 = time.perf_counter()
        for e, c in zip(encoded, chunks):
            codec.decode(e, out=np.empty_like(c))
        t2 = time.perf_counter()
        rows.append((f"{cname}-{level} {shuffle}", raw / sum(len(e) for e in encoded), raw / (t1 - t0) / 1e6,
                     raw / (t2 - t1) / 1e6))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tokens", default="768:1024")
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("/tmp/pipeline-bench"))
    a = p.parse_args()
    lo, hi = (int(x) for x in a.tokens.split(":"))
    shutil.rmtree(a.out, ignore_errors=True)
    print(f"H={a.hidden_size}, K=3, {a.samples} samples of {lo}..{hi} tokens, draft vocab {a.draft_vocab_size}, "
          f"top-k {a.topk}, chunk 256 tokens\n")
    print("| format | codec | array | ratio |\n| --- | --- | --- | --- |")
    for fmt, variant, norm in SETS:
        src = a.out / f"{fmt}-{variant}"
        write_synthetic(src, fmt, a.samples, a.hidden_size, lengths=(lo, hi), seed=0,
                        pipeline=PipelineOptions(variant=variant, draft_vocab_size=a.draft_vocab_size, topk=a.topk,
                                                 seq_length=hi, shard_size=2))
        for codec in ("zstd", "lz4"):
            dst = a.out / f"{fmt}-{variant}.{codec}.zarr"
            report = h5feed.convert(src, dst, workers=0, progress=False,
                                    settings=h5feed.StoreSettings(codec=codec, last_state_norm=norm))
            for name, ratio in array_ratios(dst).items():
                print(f"| {fmt} ({variant}) | {codec} | {name} | {ratio:.3f} |")
            print(f"| {fmt} ({variant}) | {codec} | source files / store | {report.bytes_in / report.bytes_out:.3f} |")
            shutil.rmtree(dst)
        shutil.rmtree(src)
    print("\nNeMo target_probs, bf16 [256, Vd] chunks, one core:\n")
    print("| logits sigma | codec | ratio | encode MB/s | decode MB/s |\n| --- | --- | --- | --- | --- |")
    for sigma in (1.0, 2.0, 3.0):
        g = torch.Generator().manual_seed(0)
        chunks = []
        for _ in range(4):
            probs = draft_probs(g, 256, a.draft_vocab_size, sigma=sigma)
            chunks.append(probs.to(torch.bfloat16).view(torch.uint16).numpy())
        for label, ratio, enc, dec in sweep(chunks):
            print(f"| {sigma} | {label} | {ratio:.3f} | {enc:.0f} | {dec:.0f} |")


if __name__ == "__main__":
    main()
