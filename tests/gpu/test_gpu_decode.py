"""h5feed.gpu: the Blosc1 parser, the decode plan and the GPU unshuffle, checked bit for bit against numcodecs.

On the CPU (CI) `reference_decode_into` runs the GPU path's algorithm with
numcodecs' zstd per stream; on a GPU box with nvCOMP the same frames go through
`decode_into_cuda`.  Every case asserts the frame has the structure it is meant
to cover (raw blocks, memcpyed, leftover, split), so a codec change that stops
producing it fails here rather than silently covering less.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from numcodecs import Blosc, blosc

from h5feed.gpu import (
    DamagedFrame,
    FrameError,
    FramePlacement,
    UnsupportedFrame,
    nvcomp,
    parse_frame,
    parse_frames,
    reference_decode_into,
    reference_decode_placed,
)
from h5feed.gpu import frames as frame_parser
from h5feed.store.layout import chunk_codec, frame_encoder
from h5feed.testing.synthetic import column_scales, make_sample

MIB = 1 << 20


def encode(a: np.ndarray, **kw) -> bytes:
    """A frame as the store writes it (zstd-1, byte shuffle, 1 MiB blocks), with overrides."""
    config = {"cname": "zstd", "clevel": 1, "shuffle": Blosc.SHUFFLE, "blocksize": MIB, "typesize": a.dtype.itemsize}
    config |= kw
    return bytes(Blosc(**config).encode(a))


def activations(tokens: int, hidden: int, layers: int = 3, index: int = 0) -> torch.Tensor:
    """Realistic bf16 activations [tokens, layers * hidden], as a stored hidden-states chunk holds them."""
    _, _, parts = make_sample(index, tokens, column_scales(hidden, layers), with_loss_mask=False)
    return torch.cat(parts, dim=-1)


def header(frame: bytes) -> tuple[int, ...]:
    return struct.unpack_from("<BBBBiii", frame)


_rng = np.random.default_rng(1)
_noise = _rng.integers(0, 2**16, 3 * 2048, dtype=np.uint16)
_half_noise = np.zeros(3 * 2048, np.uint16)
_half_noise[2048:4096] = _noise[:2048]

# name -> (array, encoder overrides, what the frame must show: memcpyed, raw streams, number of streams)
CASES = {
    "one uint16 (memcpyed)": (np.array([7], np.uint16), {}, (True, 1, 1)),
    "one int64 row (memcpyed)": (np.array([12345], np.int64), {}, (True, 1, 1)),
    "exactly one block": ((np.arange(MIB // 2) % 1000).astype(np.uint16), {}, (False, 0, 1)),
    "one block and one element": ((np.arange(MIB // 2 + 1) % 1000).astype(np.uint16), {}, (False, 1, 2)),
    "blocks and a leftover": ((np.arange(1_500_000) % 977).astype(np.uint16), {}, (False, 0, 3)),
    "int64 blocks and a leftover": ((np.arange(300_000) % 32000).astype(np.int64), {}, (False, 0, 3)),
    "odd byte count, typesize 2": ((np.arange(100_001) % 7).astype(np.uint8), {"typesize": 2}, (False, 1, 2)),
    "odd byte count, typesize 8": ((np.arange(100_005) % 7).astype(np.uint8), {"typesize": 8}, (False, 1, 2)),
    "random bytes (memcpyed)": (_noise, {}, (True, 1, 1)),
    "a raw block between zstd blocks": (_half_noise, {"blocksize": 4096}, (False, 1, 3)),
    "all zeros": (np.zeros(2_000_000, np.uint16), {}, (False, 0, 4)),
    "int64 all zeros": (np.zeros(200_000, np.int64), {}, (False, 0, 2)),
    "no shuffle": ((np.arange(100_000) % 1000).astype(np.uint16), {"shuffle": Blosc.NOSHUFFLE}, (False, 0, 1)),
    "blocks of 999 bytes, typesize 3": (
        (np.arange(3000) % 5).astype(np.uint8),
        {"blocksize": 1001, "typesize": 3},
        (False, 1, 4),
    ),
    "small blocks": ((np.arange(50_000) % 300).astype(np.int64), {"blocksize": 4096}, (False, 0, 98)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_numcodecs(name):
    array, overrides, (memcpyed, raw, streams) = CASES[name]
    frame = encode(array, **overrides)
    parsed = parse_frame(frame)
    assert (bool(header(frame)[2] & 0x02), sum(s.raw for s in parsed.streams), len(parsed.streams)) == (
        memcpyed,
        raw,
        streams,
    )
    out = torch.empty(array.nbytes, dtype=torch.uint8)
    reference_decode_into([frame], [out])
    assert out.numpy().tobytes() == bytes(blosc.decompress(frame)) == array.tobytes()


def test_store_chunks_in_a_batch():
    """Realistic activations and token ids, encoded by the store's own encoder, decoded into rows of a batch."""
    chunks = [activations(256, 64, index=i) for i in range(3)] + [activations(100, 64, index=3)]
    encode_hidden = frame_encoder(chunk_codec("zstd"), 2)
    frames = [encode_hidden(c.view(torch.uint16).numpy()) for c in chunks]
    ids = torch.randint(0, 32000, (256,), generator=torch.Generator().manual_seed(0))
    frames.append(frame_encoder(chunk_codec("zstd"), 8)(ids.numpy()))
    batch = torch.full((4, 256, 3 * 64), float("nan"), dtype=torch.bfloat16)
    outs = [batch[i] for i in range(3)] + [batch[3, :100], torch.empty(256, dtype=torch.int64)]
    reference_decode_into(frames, outs)
    for chunk, out in zip(chunks, outs):
        assert torch.equal(out.view(torch.uint16), chunk.view(torch.uint16))
    assert torch.equal(outs[-1], ids)
    assert batch[3, 100:].isnan().all()  # rows beyond the short chunk are not touched


def split_frame() -> bytes:
    """A frame whose blocks are split into one stream per byte plane (BLOSC_SPLITMODE=ALWAYS)."""
    script = textwrap.dedent("""
        import sys, numpy as np
        from numcodecs import Blosc
        a = (np.arange(200_001) % 251).astype(np.uint16)
        sys.stdout.buffer.write(Blosc("zstd", 1, Blosc.SHUFFLE, blocksize=1 << 16, typesize=2).encode(a))
    """)
    env = os.environ | {"BLOSC_SPLITMODE": "ALWAYS"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=True).stdout


def test_split_blocks():
    """Blocks split into one stream per byte plane (BLOSC_SPLITMODE=ALWAYS) decode as numcodecs decodes them."""
    frame = split_frame()
    parsed = parse_frame(frame)
    assert not header(frame)[2] & 0x10  # split
    blocks, leftover = divmod(parsed.nbytes, parsed.blocksize)
    assert blocks >= 2 and leftover > 0
    assert len(parsed.streams) == 2 * blocks + 1  # two byte planes per full block, one stream for the leftover
    out = torch.empty(parsed.nbytes, dtype=torch.uint8)
    reference_decode_into([frame], [out])
    assert (
        out.numpy().tobytes()
        == bytes(blosc.decompress(frame))
        == ((np.arange(200_001) % 251).astype(np.uint16)).tobytes()
    )


# =========================================================================== the bulk parser


def pack(frames: list[bytes], gap: int = 3) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The frames one after another in one buffer, each after `gap` bytes of 0xEE (as a loader's slot holds them)."""
    buffer = np.full(sum(len(f) + gap for f in frames) + gap, 0xEE, np.uint8)
    spans, at = [], gap
    for frame in frames:
        buffer[at : at + len(frame)] = np.frombuffer(frame, np.uint8)
        spans.append((at, len(frame)))
        at += len(frame) + gap
    return buffer, spans


def store_frames() -> list[bytes]:
    """Frames as the store writes them: bf16-like activations of odd token counts (leftover blocks), token ids."""
    rng = np.random.default_rng(3)
    encode_hidden = frame_encoder(dataclasses.replace(chunk_codec("zstd"), blocksize=1 << 14), 2)
    frames = [encode_hidden(activations(t, 48, index=t).view(torch.uint16).numpy()) for t in (256, 255, 77, 3, 1)]
    frames += [encode(rng.integers(0, 32000, n).astype(np.int64), blocksize=1 << 12) for n in (256, 1000, 7)]
    frames += [encode(rng.normal(size=n).astype(np.float32)) for n in (10, 70_001)]
    return frames


def test_bulk_parser_equals_the_frame_parser(monkeypatch):
    """Every frame of a mixed batch parsed in bulk equals parse_frame's view of it; only the unusual ones
    (memcpyed, split, empty) take the per-frame path."""
    frames = store_frames() + [encode(a, **kw) for a, kw, _ in CASES.values()] + [split_frame()]
    frames.append(encode(np.zeros(0, np.uint16)))
    calls = []
    monkeypatch.setattr(frame_parser, "parse_frame", lambda f: calls.append(bytes(f)) or parse_frame(f))
    buffer, spans = pack(frames)
    table = parse_frames(buffer, spans)
    assert [table.frame(i) for i in range(len(frames))] == [parse_frame(f) for f in frames]
    one_by_one = [f for f in frames if header(f)[2] & 0x02 or header(f)[4] == 0 or not header(f)[2] & 0x10]
    assert calls == one_by_one and len(one_by_one) == 8  # 6 memcpyed frames, the split one, the empty one
    assert table.stream_src.size == sum(len(parse_frame(f).streams) for f in frames) == 155


def test_bulk_parser_refuses_what_the_frame_parser_refuses():
    """Hundreds of random byte mutations of headers, block offsets, stream sizes and zstd headers of a batch:
    the bulk parser raises the frame parser's first error (type, message, frame), or parses what it parses."""
    frames = store_frames()[:4] + [encode((np.arange(30_000) % 300).astype(np.int64), blocksize=16384)]
    metadata = []  # (frame, byte) of every header, block offset, stream size and zstd header byte
    for i, f in enumerate(frames):
        streams = parse_frame(f).streams
        metadata += [(i, b) for b in range(16 + 4 * len(streams))]
        metadata += [(i, s.src + k) for s in streams for k in range(-4, 14)]
    rng = np.random.default_rng(11)
    outcomes = {"refused": 0, "parsed": 0}
    for _ in range(400):
        damaged = [bytearray(f) for f in frames]
        for pick in rng.choice(len(metadata), size=int(rng.integers(1, 4))):
            i, at = metadata[pick]
            damaged[i][at] = int(rng.integers(0, 256))
        expected: list | FrameError = []
        for i, f in enumerate(damaged):
            try:
                expected.append(parse_frame(bytes(f)))
            except FrameError as e:
                expected = e
                index = i
                break
        buffer, spans = pack([bytes(f) for f in damaged])
        if isinstance(expected, FrameError):
            with pytest.raises(type(expected)) as info:
                parse_frames(buffer, spans)
            assert (info.value.problem, info.value.index) == (expected.problem, index)
            outcomes["refused"] += 1
        else:
            table = parse_frames(buffer, spans)
            assert [table.frame(i) for i in range(len(frames))] == expected
            outcomes["parsed"] += 1
    assert outcomes["refused"] > 200 and outcomes["parsed"] > 20


def test_hostile_sizes_are_refused_without_huge_allocations():
    """A header claiming 2 GB in blocks of 1 byte, or a negative size, is refused before any table is built."""
    good = encode((np.arange(1_500_000) % 977).astype(np.uint16))
    for patched, message in [
        (_patch(_patch(good, 4, "<i", 2**31 - 1), 8, "<i", 1), "2147483647 block offsets do not fit"),
        (_patch(good, 4, "<i", -7), "impossible header: nbytes -7"),
        (_patch(good, 8, "<i", -1), "impossible block size -1"),
        (_patch(good, 3, "<B", 0), "impossible header: nbytes 3000000, typesize 0"),
    ]:
        with pytest.raises(DamagedFrame, match=f"^frame 0 of the batch: {message}"):
            parse_frames(*pack([patched]))
    with pytest.raises(ValueError, match=r"span 0 \(0, 99\) lies outside the buffer's 10 bytes"):
        parse_frames(np.zeros(10, np.uint8), [(0, 99)])


# =========================================================================== straight into rows of a batch


def test_placements_write_row_ranges_of_a_batch():
    """Chunks of two samples placed into rows of one batch with the first row dropped (a shifted key) and the
    last chunk cut at the sample's end; blocks of 16 KiB, so placements start and end inside blocks."""
    width, c = 3 * 48, 256
    encode_hidden = frame_encoder(dataclasses.replace(chunk_codec("zstd"), blocksize=1 << 14), 2)
    samples = [activations(3 * c, 48, index=0), activations(2 * c, 48, index=1)]
    lengths = [700, 300]
    frames = [encode_hidden(s[k * c : (k + 1) * c].view(torch.uint16).numpy()) for s in samples
              for k in range(len(s) // c)]
    batch = torch.full((2, 720, width), float("nan"), dtype=torch.bfloat16)
    placements, frame, row_bytes = [], 0, width * 2
    for n, (sample, length) in enumerate(zip(samples, lengths)):
        for k in range(len(sample) // c):
            first, last = max(k * c, 1), min((k + 1) * c, length)  # rows [1, length) of the sample
            if first < last:
                out = batch[n, first - 1 : last - 1]
                placements.append(FramePlacement(frame, (first - k * c) * row_bytes, out))
            frame += 1
    reference_decode_placed(frames, placements)
    for n, (sample, length) in enumerate(zip(samples, lengths)):
        assert torch.equal(batch[n, : length - 1].view(torch.uint16), sample[1:length].view(torch.uint16))
        assert batch[n, length - 1 :].isnan().all()  # pads are the caller's: never written
    with pytest.raises(ValueError, match=r"frame 4 of the batch decodes to 73728 bytes: bytes 288..74016"):
        reference_decode_placed(frames, [FramePlacement(4, 288, torch.empty(73728, dtype=torch.uint8))])
    with pytest.raises(ValueError, match="a placement names frame 5; the batch has 5"):
        reference_decode_placed(frames, [FramePlacement(5, 0, torch.empty(8, dtype=torch.uint8))])


# =========================================================================== what is refused


def _patch(frame: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(frame)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


_multi = encode((np.arange(1_500_000) % 977).astype(np.uint16))  # 3 zstd blocks
_bstart1 = struct.unpack_from("<i", _multi, 20)[0]


@pytest.mark.parametrize(
    "frame, error, message",
    [
        (_multi[:10], DamagedFrame, "10 bytes cannot hold the 16-byte Blosc header"),
        (_multi[:-1], DamagedFrame, f"header says {len(_multi)} bytes, the frame has {len(_multi) - 1}"),
        (_patch(_multi[:-1], 12, "<i", len(_multi) - 1), DamagedFrame, "do not fit in"),
        (_patch(_multi, 20, "<i", len(_multi) - 2), DamagedFrame, "block 1 stream 0 starts at byte"),
        (_patch(_multi, 20, "<i", 8), DamagedFrame, "block 1 stream 0 starts at byte 8, outside 28.."),
        (_patch(_multi, _bstart1, "<i", 2**30), DamagedFrame, f"block 1 stream 0: {2**30} bytes"),
        (_patch(_multi, _bstart1, "<i", -5), DamagedFrame, "block 1 stream 0: -5 bytes"),
        (_patch(_multi, _bstart1 + 4, "<I", 0x12345678), DamagedFrame, "is not a zstd frame"),
        (_patch(_multi, 4, "<i", 3_000_002), DamagedFrame, "block 2 stream 0 decodes to 902848 bytes, expected 902850"),
        (_patch(_multi, 8, "<i", 0), DamagedFrame, "impossible block size 0"),
        (_patch(_multi, 8, "<i", 16), DamagedFrame, "187500 block offsets do not fit"),
        (
            _patch(_patch(_multi, 2, "<B", _multi[2] & ~0x10), 8, "<i", MIB - 1),
            DamagedFrame,
            "block 0 of 1048575 bytes cannot be split in 2 equal streams",
        ),
        (_patch(_multi, 0, "<B", 3), UnsupportedFrame, "Blosc format version 3, expected 2"),
        (_patch(_multi, 2, "<B", _multi[2] | 0x08), UnsupportedFrame, "unknown Blosc flags"),
        (encode(np.arange(10**5, dtype=np.uint16), cname="lz4"), UnsupportedFrame, "Blosc codec 1"),
        (encode(np.arange(10**5, dtype=np.uint16), shuffle=Blosc.BITSHUFFLE), UnsupportedFrame, "bitshuffle"),
        (
            _patch(encode(np.array([1, 2], np.uint16)), 12, "<i", 24),
            DamagedFrame,
            "header says 24 bytes, the frame has 20",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_frames_are_refused(frame, error, message):
    pattern = message.replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(error, match=pattern):
        parse_frame(frame)
    good = encode(np.arange(1000, dtype=np.uint16))
    buffer, spans = pack([good, frame, good])
    with pytest.raises(error, match="^frame 1 of the batch: .*" + pattern) as info:  # the bulk parser says the same
        parse_frames(buffer, spans)
    assert info.value.index == 1


def test_memcpyed_size_mismatch_is_refused():
    frame = encode(np.array([1, 2], np.uint16))
    bad = _patch(frame + b"\0\0", 12, "<i", len(frame) + 2)
    with pytest.raises(DamagedFrame, match="memcpyed frame of 4 bytes must be 20 bytes long, not 22"):
        parse_frame(bad)


def test_corrupt_headers_never_point_outside_the_frame():
    """Random damage to header, block offsets and stream sizes: refused, or every stream lies inside the frame."""
    frame = encode((np.arange(100_000) % 300).astype(np.int64), blocksize=16384)  # 49 blocks
    rng = np.random.default_rng(7)
    metadata = list(range(16 + 4 * 49)) + [s.src - 4 + k for s in parse_frame(frame).streams for k in range(4)]
    refused = 0
    for _ in range(2000):
        b = bytearray(frame)
        for pos in rng.choice(metadata, size=int(rng.integers(1, 4))):
            b[pos] = int(rng.integers(0, 256))
        try:
            parsed = parse_frame(bytes(b))
        except FrameError:
            refused += 1
            continue
        for s in parsed.streams:
            assert 0 < s.src and s.src + s.csize <= len(b) and 0 <= s.dst and s.dst + s.size <= parsed.nbytes
    assert refused > 1000


def test_batch_errors_name_the_frame():
    good = encode(np.arange(1000, dtype=np.uint16))
    outs = [torch.empty(2000, dtype=torch.uint8), torch.empty(2000, dtype=torch.uint8)]
    with pytest.raises(DamagedFrame, match="^frame 1 of the batch: header says") as info:
        reference_decode_into([good, good[:-3]], outs)
    assert info.value.index == 1
    with pytest.raises(ValueError, match="frame 0 of the batch decodes to 2000 bytes, its output holds 1999"):
        reference_decode_into([good], [torch.empty(1999, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="is not contiguous"):
        reference_decode_into([good], [torch.empty(2000, 2, dtype=torch.uint8)[:, 0]])


def test_empty_batch_is_refused():
    with pytest.raises(ValueError, match="0 frames and 0 output tensors: need as many, at least one"):
        reference_decode_into([], [])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_without_cuda_gpu_decode_says_why():
    assert not nvcomp.available()
    assert nvcomp.why_unavailable() == "no CUDA device is visible to torch"
    with pytest.raises(RuntimeError, match="GPU decode is not available: no CUDA device"):
        nvcomp.CudaBloscDecoder()
    with pytest.raises(ValueError, match="outputs must be CUDA tensors, got cpu"):
        nvcomp.decode_into_cuda([encode(np.arange(4, dtype=np.uint16))], [torch.empty(8, dtype=torch.uint8)])


# =========================================================================== on the GPU


def _case_frames() -> list[tuple[bytes, bytes]]:
    """(frame, decoded bytes) of every CPU case."""
    return [(encode(a, **kw), a.tobytes()) for a, kw, _ in CASES.values()]


@pytest.mark.gpu
@pytest.mark.parametrize("sync_free, unshuffle", [(True, "triton"), (False, "triton"), (True, "torch")])
def test_gpu_equals_numcodecs(sync_free, unshuffle):
    """Every CPU case plus Kimi-shaped bf16 chunks (256 x 3 x 7168), in one batch, bit for bit."""
    decoder = nvcomp.CudaBloscDecoder(sync_free=sync_free, unshuffle=unshuffle)
    assert decoder.unshuffle == unshuffle
    encode_hidden = frame_encoder(chunk_codec("zstd"), 2)
    kimi = [activations(256, 7168, index=i) for i in range(3)] + [activations(77, 7168, index=3)]
    cases = _case_frames() + [
        (encode_hidden(c.view(torch.uint16).numpy()), c.view(torch.uint16).numpy().tobytes()) for c in kimi
    ]
    frames = [f for f, _ in cases]
    outs = [torch.full((len(expected),), 0xA5, dtype=torch.uint8, device="cuda") for _, expected in cases]
    timing = decoder.decode(frames, outs)
    times = timing.gpu_times()
    for (frame, expected), out in zip(cases, outs):
        assert out.cpu().numpy().tobytes() == expected == bytes(blosc.decompress(frame))
    assert timing.decoded_bytes == sum(len(e) for _, e in cases) and timing.frames == len(cases)
    assert min(times) > 0 and times.total_ms >= times.decode_ms


@pytest.mark.gpu
def test_gpu_rows_of_a_batch_and_buffer_reuse():
    """Decoding into rows of one bf16 batch tensor, then a larger and a smaller batch with the same buffers."""
    encode_hidden = frame_encoder(chunk_codec("zstd"), 2)
    chunks = [activations(256, 512, index=i) for i in range(6)]
    frames = [encode_hidden(c.view(torch.uint16).numpy()) for c in chunks]
    side = torch.cuda.Stream()
    for count, stream in ((2, None), (6, side), (3, None)):
        batch = torch.zeros(count, 256, 3 * 512, dtype=torch.bfloat16, device="cuda")
        nvcomp.decode_into_cuda(frames[:count], list(batch), stream=stream).gpu_times()
        for i in range(count):
            assert torch.equal(batch[i].cpu().view(torch.uint16), chunks[i].view(torch.uint16))


@pytest.mark.gpu
def test_gpu_from_pinned_memory():
    """Frames at odd offsets of one pinned buffer, with gaps between them, as a loader reads chunk files into it."""
    cases = _case_frames()
    offsets, end = [], 3
    for frame, _ in cases:
        offsets.append(end)
        end += len(frame) + 5
    source = torch.zeros(end, dtype=torch.uint8).pin_memory()
    for (frame, _), offset in zip(cases, offsets):
        source[offset : offset + len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    outs = [torch.empty(len(expected), dtype=torch.uint8, device="cuda") for _, expected in cases]
    decoder = nvcomp.CudaBloscDecoder()
    timing = decoder.decode_from_pinned(source, [(o, len(f)) for (f, _), o in zip(cases, offsets)], outs)
    timing.copy_done.synchronize()
    source.fill_(0)  # the bytes are on the GPU: the source may be reused while the decode runs
    timing.gpu_times()
    assert [out.cpu().numpy().tobytes() for out in outs] == [expected for _, expected in cases]
    assert timing.compressed_bytes == end - 5 - 3 and timing.stage_s == 0.0
    with pytest.raises(ValueError, match=r"span 0 \(0, 10\) lies outside the source's 4 bytes"):
        decoder.decode_from_pinned(torch.zeros(4, dtype=torch.uint8).pin_memory(), [(0, 10)], outs[:1])
    with pytest.raises(ValueError, match="source must be a 1-D pinned uint8 CPU tensor"):
        decoder.decode_from_pinned(torch.zeros(4, dtype=torch.uint8), [(0, 4)], outs[:1])


@pytest.mark.gpu
def test_gpu_refuses_damage_before_touching_outputs():
    good = encode((np.arange(1_500_000) % 977).astype(np.uint16))
    outs = [torch.full((3_000_000,), 7, dtype=torch.uint8, device="cuda") for _ in range(2)]
    with pytest.raises(DamagedFrame, match="^frame 1 of the batch"):
        nvcomp.decode_into_cuda([good, _patch(good, 20, "<i", len(good) - 2)], outs)
    torch.cuda.synchronize()
    assert all(bool((out == 7).all()) for out in outs)


@pytest.mark.gpu
@pytest.mark.parametrize("unshuffle", ["triton", "torch"])
def test_gpu_placements_into_rows_of_a_batch(unshuffle):
    """decode_placed writes row ranges of chunks straight into a CUDA batch (a shifted key, cut last chunks, an
    int64 key beside it), equal to the CPU reference, pads untouched, from one pinned slot."""
    c, width = 256, 3 * 512
    encode_hidden = frame_encoder(chunk_codec("zstd"), 2)
    encode_ids = frame_encoder(chunk_codec("zstd"), 8)
    samples = [activations(3 * c, 512, index=0), activations(2 * c, 512, index=1)]
    ids = [torch.randint(0, 32000, (len(s),), generator=torch.Generator().manual_seed(n)) for n, s in enumerate(samples)]
    lengths = [700, 300]
    frames, placements = [], []
    cpu = {"h": torch.full((2, 720, width), float("nan"), dtype=torch.bfloat16), "i": torch.full((2, 720), -1)}
    gpu_batch = {key: value.cuda() for key, value in cpu.items()}
    for n, length in enumerate(lengths):
        for k in range(len(samples[n]) // c):
            for key, frame in (("h", encode_hidden(samples[n][k * c : (k + 1) * c].view(torch.uint16).numpy())),
                               ("i", encode_ids(ids[n][k * c : (k + 1) * c].numpy()))):
                first, last = max(k * c, 1), min((k + 1) * c, length)
                if first < last:
                    row_bytes = width * 2 if key == "h" else 8
                    placements.append((len(frames), (first - k * c) * row_bytes, key, n, first - 1, last - 1))
                frames.append(frame)
    reference_decode_placed(frames, [FramePlacement(f, skip, cpu[key][n, a:b]) for f, skip, key, n, a, b in placements])
    source = torch.zeros(sum(map(len, frames)) + 7 * len(frames), dtype=torch.uint8).pin_memory()
    spans, at = [], 5
    for frame in frames:
        source[at : at + len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        spans.append((at, len(frame)))
        at += len(frame) + 7
    decoder = nvcomp.CudaBloscDecoder(stream=torch.cuda.Stream(), unshuffle=unshuffle)
    timing = decoder.decode_placed(
        source, spans, [FramePlacement(f, skip, gpu_batch[key][n, a:b]) for f, skip, key, n, a, b in placements])
    timing.gpu_times()
    for key, expected in cpu.items():
        bits = torch.int16 if key == "h" else torch.int64
        assert torch.equal(gpu_batch[key].cpu().view(bits), expected.view(bits))
    for n, length in enumerate(lengths):
        assert torch.equal(cpu["h"][n, : length - 1].view(torch.uint16), samples[n][1:length].view(torch.uint16))
        assert torch.equal(cpu["i"][n, : length - 1], ids[n][1:length]) and bool((cpu["i"][n, length - 1 :] == -1).all())


@pytest.mark.gpu
def test_gpu_call_returns_before_the_gpu_has_decoded():
    """The launching thread only queues work: with the decoder's stream held busy, the call returns while its
    decode is still to run, and the outputs are right once it has."""
    encode_hidden = frame_encoder(chunk_codec("zstd"), 2)
    chunks = [activations(256, 512, index=i) for i in range(4)]
    frames = [encode_hidden(c.view(torch.uint16).numpy()) for c in chunks]
    decoder = nvcomp.CudaBloscDecoder(stream=torch.cuda.Stream())
    outs = [torch.empty(256, 3 * 512, dtype=torch.bfloat16, device="cuda") for _ in chunks]
    decoder.decode(frames, outs).gpu_times()  # warm-up: buffers, nvCOMP, the kernel
    for _ in range(3):  # the second and third calls free the arrays of the ones before
        with torch.cuda.stream(decoder.stream):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles queued ahead of the decode
        start = time.perf_counter()
        timing = decoder.decode(frames, outs)
        took = time.perf_counter() - start
        assert took < 0.05 and not timing.events[2].query()  # it did not wait for the stream: decode still to run
        timing.gpu_times()
    for chunk, out in zip(chunks, outs):
        assert torch.equal(out.cpu().view(torch.uint16), chunk.view(torch.uint16))
