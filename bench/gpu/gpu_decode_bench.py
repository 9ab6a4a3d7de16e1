"""GPU decode throughput of the store's chunks (Blosc1 zstd-1, byte shuffle, 1 MiB blocks) with nvCOMP.

Kimi-shaped hidden-state chunks (256 tokens x 3 x 7168 bf16 = 10.5 MiB each) of
realistic activations (h5feed.testing.synthetic), encoded by the store's own encoder,
are decoded in batches of 16, 64 and 256 chunks into rows of one CUDA batch
tensor.  Per batch size it reports the CPU time to parse and to stage the
compressed bytes into pinned memory (or none, for frames a loader has already
read into pinned memory), the GPU time (CUDA events) of the host-to-device
copy, the zstd decode and the unshuffle, GB/s decoded, and checks every chunk
bit for bit against numcodecs.  The store's 1 MiB Blosc blocks are compared
with 256 KiB ones (more, smaller zstd streams for nvCOMP to spread over the
GPU).  `--distinct` chunks are generated and repeated to fill large batches.

`--group-samples` adds the loader's case: a group of Kimi-shaped samples
(`--sample-tokens` rows of 3 x 7168 aux and 7168 last-layer bf16 states, and
int64 token ids, in 256-token chunks), read into one pinned slot, decoded
straight into the rows of the trainer's batch tensors (`decode_placed`).  With
`--baseline FILE` (an older h5feed/gpu_decode.py) the same frames also go through
that module as the loader used it: decoded into temporaries, then one placement
`copy_` per sample and array; both batches are checked equal, bit for bit.

    python bench/gpu/gpu_decode_bench.py --out gpu_decode.json
    python bench/gpu/gpu_decode_bench.py --batches --group-samples 4 16 --baseline old_gpu_decode.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from numcodecs import blosc

from h5feed import gpu
from h5feed.bench import format_ruled_table
from h5feed.store.layout import chunk_codec, frame_encoder
from h5feed.testing.synthetic import column_scales, make_sample


@dataclass
class Row:
    blocksize: int  # Blosc block size of the chunks (the store writes 1 MiB)
    source: str  # "staged": frames copied into the decoder's pinned buffer; "pinned": frames already in pinned memory
    config: str  # nvCOMP told the sizes by the Blosc headers ("sync-free") or reading them on the GPU ("header")
    batch: int
    decoded_mib: float
    compressed_mib: float
    streams: int
    parse_ms: float  # CPU, median of the repeats
    stage_ms: float  # CPU: copy of the frames into the pinned buffer
    h2d_ms: float  # GPU events from here on
    decode_ms: float
    unshuffle_ms: float
    gpu_total_ms: float
    wall_ms: float  # one call, from its start until its GPU work is done
    h2d_gbps: float
    decode_gbps: float  # decoded bytes / (zstd decode + unshuffle)
    gpu_gbps: float  # decoded bytes / all GPU time including the copy in
    bit_exact: bool


def make_chunks(count: int, tokens: int, hidden: int, layers: int) -> torch.Tensor:
    """The bits of `count` chunks of realistic activations, int16 [count, tokens, layers * hidden]."""
    scales = column_scales(hidden, layers)
    bits = torch.empty(count, tokens, layers * hidden, dtype=torch.int16)
    for i in range(count):
        _, _, parts = make_sample(i, tokens, scales, with_loss_mask=False)
        bits[i] = torch.cat(parts, dim=-1).view(torch.int16)
    return bits


def encode_chunks(bits: torch.Tensor, blocksize: int) -> list[bytes]:
    """Each chunk encoded as the store encodes it, with the given Blosc block size."""
    encode = frame_encoder(replace(chunk_codec("zstd"), blocksize=blocksize), 2)
    return [encode(chunk.numpy()) for chunk in bits]


def cpu_decode_gbps(frames: list[bytes], nbytes: int) -> float:
    """numcodecs' Blosc decode on one thread, the CPU path's rate per core."""
    out = np.empty(nbytes, np.uint8)
    blosc.set_nthreads(1)
    start = time.perf_counter()
    for frame in frames:
        blosc.decompress(frame, out)
    return len(frames) * nbytes / (time.perf_counter() - start) / 1e9


def run(
    decoder: gpu.CudaBloscDecoder,
    frames: list[bytes],
    bits_gpu: torch.Tensor,
    batch: int,
    repeats: int,
    source: str,
    labels: dict,
) -> Row:
    distinct = bits_gpu.shape[0]
    batch_frames = [frames[i % distinct] for i in range(batch)]
    out = torch.empty(batch, *bits_gpu.shape[1:], dtype=torch.bfloat16, device=decoder.device)
    if source == "pinned":  # as a loader that reads the chunk files into one pinned slot would hold them
        spans, end = [], 0
        for frame in batch_frames:
            spans.append((end, len(frame)))
            end += len(frame)
        slot = torch.empty(end, dtype=torch.uint8, pin_memory=True)
        for frame, (offset, length) in zip(batch_frames, spans):
            slot[offset : offset + length] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)

        def call() -> gpu.CudaDecodeTiming:
            return decoder.decode_from_pinned(slot, spans, list(out))
    else:

        def call() -> gpu.CudaDecodeTiming:
            return decoder.decode(batch_frames, list(out))

    call().gpu_times()  # warm-up: buffers grow, nvCOMP initialises
    samples = []
    for _ in range(repeats):
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        start = time.perf_counter()
        timing = call()
        times = timing.gpu_times()
        samples.append((timing, times, time.perf_counter() - start))
    exact = all(torch.equal(out[i].view(torch.int16), bits_gpu[i % distinct]) for i in range(batch))
    med = statistics.median
    timing = samples[0][0]
    decode_ms = med(t.decode_ms + t.unshuffle_ms for _, t, _ in samples)
    gpu_ms = med(t.total_ms for _, t, _ in samples)
    h2d_ms = med(t.h2d_ms for _, t, _ in samples)
    return Row(
        **labels,
        source=source,
        batch=batch,
        decoded_mib=timing.decoded_bytes / 2**20,
        compressed_mib=timing.compressed_bytes / 2**20,
        streams=timing.streams,
        parse_ms=med(t.parse_s for t, _, _ in samples) * 1e3,
        stage_ms=med(t.stage_s for t, _, _ in samples) * 1e3,
        h2d_ms=h2d_ms,
        decode_ms=med(t.decode_ms for _, t, _ in samples),
        unshuffle_ms=med(t.unshuffle_ms for _, t, _ in samples),
        gpu_total_ms=gpu_ms,
        wall_ms=med(w for _, _, w in samples) * 1e3,
        h2d_gbps=timing.compressed_bytes / h2d_ms / 1e6,
        decode_gbps=timing.decoded_bytes / decode_ms / 1e6,
        gpu_gbps=timing.decoded_bytes / gpu_ms / 1e6,
        bit_exact=exact,
    )


@dataclass
class GroupRow:
    decoder: str  # "placed": decode_placed into the batch rows; "baseline": the given module, then copy_ per array
    samples: int
    decoded_mib: float
    launch_ms: float  # CPU on the launching thread: parse, layout, queueing every kernel (median)
    h2d_ms: float  # GPU (CUDA events), per group
    zstd_ms: float
    unshuffle_ms: float
    place_ms: float  # the baseline's device-to-device placement copies; 0 when decoded in place
    gpu_ms_per_sample: float  # all of the above GPU time, divided by the samples
    bit_exact: bool


def load_baseline(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_gpu_decode", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


def group_frames(bits: torch.Tensor, samples: int, tokens: int, chunk: int, hidden: int) -> tuple[list, list]:
    """Frames of `samples` samples (aux, last layer, ids chunk by chunk) and (sample, array, chunk) of each."""
    encode_aux, encode_ids = frame_encoder(chunk_codec("zstd"), 2), frame_encoder(chunk_codec("zstd"), 8)
    distinct = bits.shape[0]
    ids = torch.randint(0, 160_000, (distinct, chunk), generator=torch.Generator().manual_seed(0))
    cache: dict[tuple[str, int], bytes] = {}

    def frame(array: str, k: int) -> bytes:
        if (array, k) not in cache:
            data = {"aux": bits[k], "last": bits[k][:, :hidden].contiguous(), "ids": ids[k]}[array]
            cache[array, k] = (encode_ids if array == "ids" else encode_aux)(data.numpy())
        return cache[array, k]

    frames, where, chunks = [], [], -(-tokens // chunk)
    for n in range(samples):
        for array in ("aux", "last", "ids"):
            for c in range(chunks):
                frames.append(frame(array, (n * chunks + c) % distinct))
                where.append((n, array, c))
    return frames, where


def run_group(decode_module: ModuleType, label: str, bits: torch.Tensor, samples: int, tokens: int, chunk: int,
              hidden: int, repeats: int) -> GroupRow:
    frames, where = group_frames(bits, samples, tokens, chunk, hidden)
    spans, end = [], 0
    for f in frames:
        spans.append((end, len(f)))
        end += -(-len(f) // 64) * 64
    slot = torch.empty(end, dtype=torch.uint8, pin_memory=True)
    for f, (offset, length) in zip(frames, spans):
        slot[offset : offset + length] = torch.frombuffer(bytearray(f), dtype=torch.uint8)
    widths = {"aux": bits.shape[2], "last": hidden}
    batch = {a: torch.empty(samples, tokens, w, dtype=torch.bfloat16, device="cuda") for a, w in widths.items()}
    batch["ids"] = torch.empty(samples, tokens, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    decoder = decode_module.CudaBloscDecoder(stream=side)
    rounded = -(-tokens // chunk) * chunk
    if label == "placed":
        placements = [decode_module.FramePlacement(i, 0, batch[a][n, c * chunk : min((c + 1) * chunk, tokens)])
                      for i, (n, a, c) in enumerate(where)]

        def call() -> tuple[object, tuple[torch.cuda.Event, torch.cuda.Event] | None]:
            return decoder.decode_placed(slot, spans, placements), None
    else:
        temporaries = {(n, a): torch.empty((rounded, *batch[a].shape[2:]), dtype=batch[a].dtype, device="cuda")
                       for n in range(samples) for a in batch}
        outs = [temporaries[n, a][c * chunk : (c + 1) * chunk] for n, a, c in where]
        placed = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

        def call() -> tuple[object, tuple[torch.cuda.Event, torch.cuda.Event] | None]:
            timing = decoder.decode_from_pinned(slot, spans, outs)
            with torch.cuda.stream(side):  # as CudaBatchLoader._place: one copy per sample and array
                placed[0].record()
                for (n, a), rows in temporaries.items():
                    batch[a][n].copy_(rows[:tokens])
                placed[1].record()
            return timing, placed

    call()[0].gpu_times()  # warm-up: buffers grow, nvCOMP and the kernel initialise
    measured = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        timing, placed = call()
        launch = time.perf_counter() - start
        times = timing.gpu_times()
        if placed is not None:
            placed[1].synchronize()
        place = placed[0].elapsed_time(placed[1]) if placed is not None else 0.0
        measured.append((launch, times, place))
    torch.cuda.synchronize()
    expected = {a: torch.empty_like(t, device="cpu") for a, t in batch.items()}
    for f, (n, a, c) in zip(frames, where):
        rows = torch.frombuffer(bytearray(blosc.decompress(f)), dtype=expected[a].dtype)
        rows = rows.view(-1, *expected[a].shape[2:])[: min(chunk, tokens - c * chunk)]
        expected[a][n, c * chunk : c * chunk + len(rows)] = rows
    bits_of = {torch.bfloat16: torch.int16, torch.int64: torch.int64}
    exact = all(torch.equal(batch[a].cpu().view(bits_of[t.dtype]), t.view(bits_of[t.dtype])) for a, t in expected.items())
    med = statistics.median
    h2d, zstd = med(t.h2d_ms for _, t, _ in measured), med(t.decode_ms for _, t, _ in measured)
    unshuffle, place = med(t.unshuffle_ms for _, t, _ in measured), med(p for _, _, p in measured)
    return GroupRow(label, samples, sum(t.numel() * t.element_size() for t in expected.values()) / 2**20,
                    med(w for w, _, _ in measured) * 1e3, h2d, zstd, unshuffle, place,
                    (h2d + zstd + unshuffle + place) / samples, exact)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="*", default=[16, 64, 256], help="chunks per call")
    p.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--layers", type=int, default=3, help="hidden layers side by side in a chunk")
    p.add_argument("--distinct", type=int, default=32, help="distinct chunks generated, repeated to fill a batch")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--blocksizes", type=int, nargs="+", default=[1 << 20, 1 << 18], help="Blosc block sizes")
    p.add_argument("--sources", nargs="+", choices=("staged", "pinned"), default=["staged", "pinned"])
    p.add_argument("--configs", nargs="+", choices=("sync-free", "header"), default=["sync-free"])
    p.add_argument("--group-samples", type=int, nargs="*", default=[], help="samples per loader group")
    p.add_argument("--sample-tokens", type=int, default=1750, help="tokens of each sample of a loader group")
    p.add_argument("--baseline", type=Path, help="an older gpu_decode.py to compare the loader groups with")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    a = p.parse_args(argv)
    if not gpu.available():
        print(f"GPU decode unavailable: {gpu.why_unavailable()}", file=sys.stderr)
        return 2
    from nvidia import nvcomp

    start = time.perf_counter()
    bits = make_chunks(a.distinct, a.tokens, a.hidden, a.layers)
    chunk_nbytes = bits[0].numel() * 2
    print(
        f"{a.distinct} chunks of {chunk_nbytes / 2**20:.1f} MiB made in {time.perf_counter() - start:.1f} s; "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, nvCOMP {nvcomp.__version__}",
        flush=True,
    )
    bits_gpu = bits.cuda()
    rows, codec = [], {}
    for blocksize in a.blocksizes:
        frames = encode_chunks(bits, blocksize)
        assert all(bytes(blosc.decompress(f)) == bits[i].numpy().tobytes() for i, f in enumerate(frames))
        codec[blocksize] = {
            "ratio": a.distinct * chunk_nbytes / sum(map(len, frames)),
            "cpu_numcodecs_gbps_1_thread": cpu_decode_gbps(frames, chunk_nbytes),
        }
        for config in a.configs:
            decoder = gpu.CudaBloscDecoder(sync_free=config == "sync-free")
            for source in a.sources:
                for batch in a.batches:
                    labels = {"blocksize": blocksize, "config": config}
                    try:
                        rows.append(run(decoder, frames, bits_gpu, batch, a.repeats, source, labels))
                    except RuntimeError as e:  # report and go on: one failing setting should not hide the others
                        print(f"{labels} {source} x {batch}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            del decoder
            torch.cuda.empty_cache()
    header = [
        "block KiB",
        "source",
        "config",
        "batch",
        "decoded MiB",
        "parse ms",
        "stage ms",
        "H2D ms",
        "decode ms",
        "unshuffle ms",
        "GPU ms",
        "wall ms",
        "H2D GB/s",
        "decode GB/s",
        "GPU GB/s",
        "bit-exact",
    ]
    table = [header]
    for r in rows:
        table.append(
            [
                str(r.blocksize // 1024),
                r.source,
                r.config,
                str(r.batch),
                f"{r.decoded_mib:.0f}",
                f"{r.parse_ms:.1f}",
                f"{r.stage_ms:.1f}",
                f"{r.h2d_ms:.2f}",
                f"{r.decode_ms:.2f}",
                f"{r.unshuffle_ms:.2f}",
                f"{r.gpu_total_ms:.2f}",
                f"{r.wall_ms:.1f}",
                f"{r.h2d_gbps:.1f}",
                f"{r.decode_gbps:.1f}",
                f"{r.gpu_gbps:.1f}",
                "yes" if r.bit_exact else "NO",
            ]
        )
    if rows:
        print("\n".join(format_ruled_table(table, right={0, *range(3, 15)})))
    groups = []
    decoders = [("placed", gpu)] + ([("baseline", load_baseline(a.baseline))] if a.baseline else [])
    for samples in a.group_samples:
        for label, module in decoders:
            groups.append(run_group(module, label, bits, samples, a.sample_tokens, a.tokens, a.hidden, a.repeats))
            torch.cuda.empty_cache()
    if groups:
        header = ["decoder", "samples", "decoded MiB", "launch ms (CPU)", "H2D ms", "zstd ms", "unshuffle ms",
                  "place ms", "GPU ms / sample", "bit-exact"]
        table = [header] + [[g.decoder, str(g.samples), f"{g.decoded_mib:.0f}", f"{g.launch_ms:.2f}",
                             f"{g.h2d_ms:.2f}", f"{g.zstd_ms:.2f}", f"{g.unshuffle_ms:.2f}", f"{g.place_ms:.2f}",
                             f"{g.gpu_ms_per_sample:.2f}", "yes" if g.bit_exact else "NO"] for g in groups]
        print("\n".join(format_ruled_table(table, right=set(range(1, 9)))))
    for blocksize, c in codec.items():
        print(
            f"blocks of {blocksize // 1024} KiB: ratio {c['ratio']:.3f}, "
            f"numcodecs on one CPU thread {c['cpu_numcodecs_gbps_1_thread']:.2f} GB/s decoded"
        )
    if a.out:
        a.out.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "nvcomp": nvcomp.__version__,
                    "chunk_bytes": chunk_nbytes,
                    "chunk_shape": [a.tokens, a.layers * a.hidden],
                    "distinct_chunks": a.distinct,
                    "repeats": a.repeats,
                    "codec": codec,
                    "rows": [asdict(r) for r in rows],
                    "groups": [asdict(g) for g in groups],
                },
                indent=2,
            )
        )
    done = rows + groups
    return 0 if done and all(r.bit_exact for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
