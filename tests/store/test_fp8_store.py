"""FP8 stores: hidden states kept as hs-connectors' fp8 backend keeps them, read back as its FP8Transfer returns them.

The expected values come from the released hs-connectors (its `quantize_tensor_to_fp8`, its safetensors files
written as `FP8HiddenStatesConnector` writes them, read back by `FP8Transfer`), never from h5feed's own copy of
the arithmetic.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_batch_loader
from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor, quantize_tensor_to_fp8
from hs_connectors.transfer import FP8Transfer
from numcodecs import Blosc
from s3_server import bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)
from safetensors.torch import save_file

import h5feed
from h5feed import BatchLoader, HiddenStatesDataset, StoreError, StoreSettings
from h5feed.errors import CorruptSampleError
from h5feed.flavors import FLAVORS, get_flavor
from h5feed.loading.backends.fp8_crossing import DeviceDequantization
from h5feed.loading.datasets import HiddenStatesStream
from h5feed.store import HIDDEN_ARRAYS, Store, plain_allocator
from h5feed.store import layout as store_layout
from h5feed.store.fp8 import CPU_BLOCK_VALUES, MAX_SCALE, MIN_SCALE, dequantize_into, quantize, token_scales
from h5feed.testing.synthetic import write_synthetic
from h5feed.verify import describe_store, verify_store

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

H = 32
K = 3
LENGTHS = [1, 5, 16, 17, 40, 3, 33]  # one token, whole chunks, cut chunks, several chunks
N = len(LENGTHS)
# each flavor, from a source format whose store it serves (the norm of its last state, a NeMo cache's layout)
FLAVOR_SOURCES = {
    "speculators-legacy": "speculators-safetensors", "speculators": "speculators-safetensors",
    "modelopt": "speculators-safetensors", "modelopt-answer-only": "speculators-safetensors",
    "specforge": "specforge-ckpt", "specforge-shifted": "specforge-ckpt", "modelopt-0.45": "specforge-ckpt",
    "angelslim": "angelslim-ckpt", "nemo-eagle3": "nemo-eagle3-cache",
}


@dataclasses.dataclass(frozen=True)
class Pair:
    """One source folder converted twice: exactly, and to FP8; and hs-connectors' FP8 files of its samples."""

    src: Path
    exact: Path
    fp8: Path
    fp8_files: Path  # hs_{i}.safetensors for store index i, as FP8HiddenStatesConnector writes them


def _write_fp8_files(exact: Store, folder: Path) -> None:
    """Each sample's layers [T, K(+1), H], quantized by hs-connectors and saved as its fp8 connector saves them."""
    folder.mkdir()
    for i in range(len(exact)):
        raw = exact.read_sample(i)
        t = raw.num_tokens
        layers = raw.aux_hidden_states.view(t, -1, exact.info.hidden_size)
        if raw.last_hidden_state is not None:
            layers = torch.cat([layers, raw.last_hidden_state[:, None]], dim=1)
        fp8, scales = quantize_tensor_to_fp8(layers)
        save_file({"hidden_states": fp8, SCALES_KEY: scales, "token_ids": raw.input_ids},
                  str(folder / f"hs_{i}.safetensors"))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    made: dict[str, Pair] = {}

    def make(fmt: str) -> Pair:
        if fmt not in made:
            root = tmp_path_factory.mktemp(fmt)
            write_synthetic(root / "src", fmt, N, H, K, lengths=LENGTHS, seed=11)
            for name, precision in (("exact", "exact"), ("fp8", "fp8")):
                h5feed.convert(root / "src", root / name, workers=0, progress=False,
                               settings=h5feed.StoreSettings(chunk_tokens=16, precision=precision))
            _write_fp8_files(Store(root / "exact"), root / "fp8_files")
            made[fmt] = Pair(root / "src", root / "exact", root / "fp8", root / "fp8_files")
        return made[fmt]

    return make


def fp8transfer_item(pair: Pair, i: int, flavor: str, max_len: int | None = None) -> dict:
    """The flavor's item for store index i, its hidden states what FP8Transfer returns for the sample's FP8 file
    (everything else from the exact store, which the other tests check against each trainer's own reading)."""
    exact = Store(pair.exact)
    spec = get_flavor(flavor)
    t = spec.tokens_to_read(int(exact.sample_lengths[i]), max_len)
    raw = exact.read_sample(i, t, extras=spec.extras(exact.info))
    restored = FP8Transfer(pair.fp8_files).get_cached(i)["hidden_states"][:t]
    assert restored.dtype == torch.bfloat16
    aux = restored[:, :K].reshape(t, K * H)
    last = restored[:, K] if raw.last_hidden_state is not None else None
    raw = dataclasses.replace(raw, aux_hidden_states=aux, last_hidden_state=last)
    return spec.build(raw, exact.info, spec.default_hidden_states_dtype, None, plain_allocator)


def flat(batch: dict) -> dict:
    """A batch with its nested dicts (Model-Optimizer's base_model_outputs) spread into dotted keys, copied out of
    its slot."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in flat(value).items()})
        else:
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


# =========================================================================== quantization


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_equals_hs_connectors_bit_for_bit(dtype):
    """Per token over aux layers and last state together: the same fp8 bits and the same float32 scales."""
    g = torch.Generator().manual_seed(0)
    layers = (torch.randn(64, K + 1, H, generator=g) * torch.logspace(-6, 4, 64)[:, None, None]).to(dtype)
    layers[3] = 0  # an all-zero token: the scale's floor
    layers[4, 1, 7] = -0.0
    layers[5, 2, 0] = torch.finfo(dtype).max  # the largest value the dtype holds
    layers[6, 0, 0] = torch.finfo(dtype).tiny
    want_fp8, want_scales = quantize_tensor_to_fp8(layers)

    aux, last = layers[:, :K].reshape(64, K * H), layers[:, K]
    scales = token_scales([aux, last])
    assert scales.dtype == torch.float32 and torch.equal(scales, want_scales.reshape(64))
    assert float(scales[3]) == np.float32(1e-12)
    got = torch.cat([quantize(aux, scales).view(64, K, H), quantize(last, scales)[:, None]], dim=1)
    assert got.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), want_fp8.view(torch.uint8))
    # quantizing part of a sample's rows (a chunk) with their scales gives those rows' bits
    assert torch.equal(quantize(aux[10:26], scales[10:26]).view(torch.uint8),
                       want_fp8[10:26, :K].reshape(16, K * H).view(torch.uint8))


def test_dequantize_equals_hs_connectors_for_every_fp8_value():
    """All 256 float8_e4m3fn codes (NaN, +-0, subnormals, +-448) times scales from the floor to large ones: the
    bits of hs-connectors' dequantize_fp8_tensor, into bfloat16 and, cast from it, into float32."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(6, 1).view(torch.float8_e4m3fn)
    scales = torch.tensor([1e-12, 3e-7, 1 / 448, 0.0123, 1.0, 771.5], dtype=torch.float32)
    want = dequantize_fp8_tensor(codes, scales[:, None])
    got = dequantize_into(codes, scales, torch.empty(6, 256, dtype=torch.bfloat16))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    wide = dequantize_into(codes, scales, torch.empty(6, 256, dtype=torch.float32))
    assert torch.equal(wide.view(torch.int32), want.float().view(torch.int32))


# Scales the CPU's arithmetic takes (scale*256 finite: subnormal, zero and negative ones too) and those the formula
# itself is left to (scale*256 beyond float32, infinite, NaN), each set with several per block of tokens.
ORDINARY_SCALES = [MIN_SCALE, 3e-7, 1 / 448, 0.0123, 1.0, 771.5, MAX_SCALE, 2.0**119, 1e-40, 0.0, -0.0, -2.5]
UNUSUAL_SCALES = [2.0**121, torch.finfo(torch.float32).max, float("inf"), float("-inf"), float("nan"), 1.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nan_codes", [False, True], ids=["no-nan-codes", "nan-codes"])
@pytest.mark.parametrize("scale_set", [ORDINARY_SCALES, UNUSUAL_SCALES], ids=["ordinary", "unusual"])
@pytest.mark.parametrize("tokens, width", [(0, 300), (1, 1), (1, 256), (3, 13), (300, 1000),
                                           (2, CPU_BLOCK_VALUES + 7)])
def test_cpu_dequantization_is_the_formula_bit_for_bit(dtype, nan_codes, scale_set, tokens, width):
    """On the CPU, every code (all 256, or all but the NaNs, which send a block to the formula itself) times
    every scale gives the bits of `fp8.to(bfloat16) * scale.to(bfloat16)` (cast into float32), for shapes from
    none to blocks of one token, widths off any vector or block size.  The formula's NaNs take torch's vector
    lanes' bits (0xFFFF) or, in a row's scalar tail, its scalar code's (0x7FC0): dequantize_into gives 0xFFFF for
    every one, as the table of 256 products it used before did."""
    g = torch.Generator().manual_seed(tokens * 7919 + width)
    codes = torch.randint(0, 256, (tokens, width), dtype=torch.uint8, generator=g)
    every = torch.arange(256, dtype=torch.uint8)[: codes.numel()]
    codes.view(-1)[: every.numel()] = every
    if not nan_codes:
        codes[(codes & 0x7F) == 0x7F] = 0x7E
    fp8 = codes.view(torch.float8_e4m3fn)
    scales = torch.tensor(scale_set, dtype=torch.float32).repeat(-(-tokens // len(scale_set)))[:tokens]
    want = (fp8.to(torch.bfloat16) * scales.to(torch.bfloat16)[:, None]).to(dtype)
    got = dequantize_into(fp8, scales, torch.full((tokens, width), 7, dtype=dtype))
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])
    canonical_nan = -1 if dtype == torch.bfloat16 else -65536  # bfloat16 0xFFFF, and as float32 0xFFFF0000
    assert bool((got.view(bits)[nan] == canonical_nan).all())


# =========================================================================== the store


def test_fp8_store_holds_hs_connectors_bytes_and_scales(pairs, source_sample):
    """From bf16 files, --precision fp8 stores exactly quantize_tensor_to_fp8's bytes and scales, as uint8 and
    float32 arrays any Zarr reader sees (never expanded), in a format older readers refuse."""
    import zarr

    pair = pairs("speculators-safetensors")
    store = Store(pair.fp8)
    info = store.info
    assert (info.precision, info.quantized_from, info.dtype, info.format_version) == ("fp8", "bfloat16", "bfloat16", 4)
    group = zarr.open_group(pair.fp8, mode="r")
    assert {name: str(group[name].dtype) for name in info.array_names} == {
        "aux_hidden_states": "uint8", "last_hidden_states": "uint8", "input_ids": "int64", "loss_mask": "int64",
        "hidden_states_scales": "uint32"}
    for i in range(N):
        source = source_sample("speculators-safetensors", pair.src, store.source_paths[i], int(store.source_indices[i]))
        want_fp8, want_scales = quantize_tensor_to_fp8(torch.cat([source["aux"].view(-1, K, H),
                                                                  source["last"][:, None]], dim=1))
        t = len(source["input_ids"])
        rows = slice(int(store.sample_starts[i]), int(store.sample_starts[i]) + t)
        assert torch.equal(torch.from_numpy(group["aux_hidden_states"][rows]),
                           want_fp8[:, :K].reshape(t, K * H).view(torch.uint8))
        assert torch.equal(torch.from_numpy(group["last_hidden_states"][rows]), want_fp8[:, K].view(torch.uint8))
        assert torch.equal(torch.from_numpy(group["hidden_states_scales"][rows].view(np.float32)),
                           want_scales.reshape(t))
        raw = store.read_sample(i)
        assert raw.aux_hidden_states.dtype == torch.float8_e4m3fn and raw.hidden_scales.dtype == torch.float32
        assert torch.equal(raw.input_ids, source["input_ids"])
    report = verify_store(pair.fp8, pair.src, progress=False)
    assert report.ok and report.samples_checked == N, report.mismatches


def test_fp8_store_is_smaller_than_the_exact_one(pairs):
    """One byte a value instead of two, plus 4 bytes a token of scales.  (How much smaller it is stored, with the
    codec, depends on the values and on H: at these tiny shapes the chunks' own overheads weigh, and synthetic values
    are not real activations; the README's figures are measured at real shapes.)"""
    pair = pairs("speculators-safetensors")
    exact, fp8 = Store(pair.exact), Store(pair.fp8)
    assert fp8.token_nbytes == exact.token_nbytes - (K + 1) * H + 4
    assert fp8.stored_nbytes() < exact.stored_nbytes()


def test_an_older_reader_refuses_an_fp8_store_by_its_version(pairs, monkeypatch):
    """A reader of formats 1-3 (as h5feed before FP8 stores) says what to do, instead of reading uint8 as bf16."""
    monkeypatch.setattr(store_layout, "READABLE_FORMAT_VERSIONS", (1, 2, 3))
    with pytest.raises(StoreError) as refused:
        Store(pairs("speculators-safetensors").fp8)
    assert refused.value.problem == ("store format version 4 is not one this h5feed reads (1, 2, 3); upgrade h5feed "
                                     "or reconvert the store")


def test_fp8_attributes_that_do_not_go_together_are_refused(pairs, tmp_path):
    import shutil

    path = tmp_path / "edited"
    shutil.copytree(pairs("speculators-safetensors").fp8, path)
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"]["h5feed"]["dtype"] = "float32"  # would size reads as float32
    (path / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError) as refused:
        Store(path)
    assert "precision 'fp8', format 4, dtype float32 and quantized_from 'bfloat16' do not go together" in str(
        refused.value)


# =========================================================================== reading


@pytest.mark.parametrize("flavor", list(FLAVOR_SOURCES))
def test_every_flavors_items_equal_fp8transfers(pairs, assert_same_batch, flavor):
    """HiddenStatesDataset (in this process and in DataLoader workers) and HiddenStatesStream: each item's hidden
    states are FP8Transfer's dequantization (bf16, then the trainer's own cast), everything else as exact."""
    # SpecForge's DFlash family refuses LENGTHS' one-token sample: tests/flavors/test_specforge_flavors.py holds its FP8 items
    assert set(FLAVOR_SOURCES) == set(FLAVORS) - {"specforge-dflash", "specforge-dspark"}
    pair = pairs(FLAVOR_SOURCES[flavor])
    want = [fp8transfer_item(pair, i, flavor) for i in range(N)]
    dataset = HiddenStatesDataset(pair.fp8, flavor)
    for i in range(N):
        assert_same_batch(dataset[i], want[i])
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    for got, expected in zip(loader, want, strict=True):
        assert_same_batch(got, expected)
    for got, expected in zip(HiddenStatesStream(pair.fp8, flavor, schedule=h5feed.ScheduleOptions(shuffle=False), reading=h5feed.ReadOptions(threads=2)),
                             want, strict=True):
        assert_same_batch(got, expected)


def test_a_window_of_max_len_dequantizes_only_its_rows(pairs, assert_same_batch):
    pair = pairs("speculators-safetensors")
    dataset = HiddenStatesDataset(pair.fp8, "speculators", max_len=10)
    for i in range(N):
        assert_same_batch(dataset[i], fp8transfer_item(pair, i, "speculators", max_len=10))


@pytest.mark.parametrize("decode", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("flavor", "num_workers", "max_len"), [
    ("speculators", 0, 24), ("speculators-legacy", 2, 24), ("specforge", 0, 20), ("specforge-shifted", 2, 64),
    ("modelopt", 0, 32), ("modelopt-answer-only", 2, 32), ("angelslim", 2, None), ("nemo-eagle3", 0, None),
])
def test_batch_loader_batches_equal_fp8transfers(pairs, assert_same_batch, decode, flavor, num_workers, max_len):
    """Threads and worker processes (decode="cpu") decode FP8 rows and their scales straight into the batch, and
    the GPU backend decodes both on the GPU and dequantizes there: the trainer's collate of FP8Transfer's items,
    bit for bit."""
    pair = pairs(FLAVOR_SOURCES[flavor])
    workers = {"num_workers": num_workers} if decode == "cpu" else {}
    loader = make_batch_loader(pair.fp8, flavor=flavor, max_len=max_len, batch_size=2, decode=decode, threads=2,
                               shuffle=False, **workers)
    assert loader.backend.name == ("cuda" if decode == "cuda" else "workers" if num_workers else "threads")
    got = [{key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in flat(batch).items()}
           for batch in loader]
    collate = h5feed.trainer_collate(flavor, max_len,
                                     hidden_states_dtype=get_flavor(flavor).default_hidden_states_dtype)
    items = [fp8transfer_item(pair, i, flavor, max_len) for i in range(N)]
    want = [flat(collate(items[j : j + 2])) for j in range(0, N, 2)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same_batch(g, w)


@pytest.mark.gpu(nvcomp=False)
@pytest.mark.parametrize(("flavor", "num_workers", "max_len"), [
    ("speculators-legacy", 2, 24), ("specforge-shifted", 0, 24), ("modelopt", 2, 24), ("nemo-eagle3", 0, None)])
def test_cpu_backends_send_fp8_to_the_gpu_and_dequantize_there(pairs, assert_same_batch, flavor, num_workers,
                                                               max_len):
    """With device="cuda", threads and worker processes leave an FP8 store's hidden states as stored (codes and
    scales) and the GPU dequantizes them: the same batches, bit for bit, through the ring's reused slots."""
    pair = pairs(FLAVOR_SOURCES[flavor])
    loader = make_batch_loader(pair.fp8, flavor=flavor, max_len=max_len, batch_size=2, threads=2,
                               num_workers=num_workers, shuffle=False, device="cuda")
    assert loader.backend.writer.crossing.keys
    collate = h5feed.trainer_collate(flavor, max_len,
                                     hidden_states_dtype=get_flavor(flavor).default_hidden_states_dtype)
    items = [fp8transfer_item(pair, i, flavor, max_len) for i in range(N)]
    want = [flat(collate(items[j : j + 2])) for j in range(0, N, 2)]
    for _ in range(2):  # the second pass reuses slots whose pads the first dirtied
        got = [{key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in flat(batch).items()}
               for batch in loader]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_batch(g, w)


@pytest.mark.parametrize(("flavor", "max_len"), [("speculators-legacy", 24), ("speculators", 24),
                                               ("specforge-shifted", 24), ("modelopt", 24), ("angelslim", None),
                                               ("nemo-eagle3", None)])
def test_fp8_codes_and_scales_in_a_batch_dequantize_to_the_batch(pairs, assert_same_batch, flavor, max_len):
    """What the CPU backends hand the GPU for an FP8 store (codes as bytes, a scale row key per hidden key) is
    dequantized by `DeviceDequantization` into the batch the CPU's own dequantization makes; run here on the CPU,
    which computes the same bits (the GPU run is the test above)."""
    pair = pairs(FLAVOR_SOURCES[flavor])
    loader = BatchLoader(pair.fp8, flavor=flavor, max_len=max_len, batch_size=3,
                         schedule=h5feed.ScheduleOptions(shuffle=False), decode=h5feed.ThreadsOptions(threads=1))
    writer = loader.backend.writer
    crossing = DeviceDequantization.of(writer.collate)
    assert [sk.key for sk in crossing.keys] == [rk.key for rk in writer.collate.row_keys
                                                if rk.array in HIDDEN_ARRAYS]
    crossed = dataclasses.replace(writer, trailing=crossing.trailing(writer.trailing), crossing=crossing)
    for start in range(0, N, 3):
        indices = list(range(start, min(start + 3, N)))
        as_stored = crossed.write(indices, None).batch
        assert all(as_stored[sk.key].dtype == torch.uint8 for sk in crossing.keys)
        want = writer.write(indices, None).batch
        assert_same_batch(flat(writer.collate.finish(crossing.dequantized(as_stored))),
                          flat(writer.collate.finish(want)))
    loader.close()


def test_the_compressed_frames_of_an_fp8_store_are_its_fp8_bytes(pairs):
    """What the GPU backend reads: an FP8 store's hidden-state frames decode (here with numcodecs, as the GPU
    decodes them) to the FP8 bytes the rows hold, and the scales' frames to their float32 scales."""
    path = pairs("speculators-safetensors").fp8
    store = Store(path)
    buffer = np.empty(1 << 20, dtype=np.uint8)
    for array, dtype in (("aux_hidden_states", torch.float8_e4m3fn), ("hidden_states_scales", torch.float32)):
        rows = int(store.sample_lengths[4])
        want = torch.empty((rows, store.info.width(array)) if store.info.is_matrix(array) else (rows,),
                           dtype=store.info.storage_dtype(array))
        store.read_rows_into(4, array, 0, rows, want)
        placed = store.copy_frames_into(4, array, rows, buffer)
        decoded = b"".join(bytes(Blosc().decode(buffer[offset : offset + length])) for _, offset, length in placed)
        assert decoded[: want.numel() * want.element_size()] == want.numpy().tobytes()
        assert want.view(dtype).dtype == dtype


# =========================================================================== damage


def test_a_damaged_scale_is_never_delivered(pairs, tmp_path, flip_byte, assert_same_batch):
    """A flipped byte in a token's scale fails its chunk's checksum: an error naming the sample, or with
    on_corrupt="skip" a counted skip, the other batches exact."""
    import shutil

    pair = pairs("speculators-safetensors")
    path = tmp_path / "damaged"
    shutil.copytree(pair.fp8, path)
    flip_byte(path, 4, "hidden_states_scales", chunk=1, at=20)  # sample 4: 40 tokens, its second chunk
    with pytest.raises(CorruptSampleError) as damaged:
        HiddenStatesDataset(path, "speculators")[4]
    assert damaged.value.sample == 4 and "hidden_states_scales" in damaged.value.path
    for num_workers in (0, 2):
        loader = BatchLoader(HiddenStatesStream(path, "speculators", 64, on_corrupt="skip",
                                                schedule=h5feed.ScheduleOptions(shuffle=False)),
                             batch_size=2, num_workers=num_workers)
        got = [flat(b) for b in loader]
        collate = h5feed.trainer_collate("speculators", 64)
        items = [fp8transfer_item(pair, i, "speculators", 64) for i in range(N)]
        want = [collate(items[0:2]), collate(items[2:4]), collate(items[5:6]), collate(items[6:7])]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_batch(g, w)
        assert loader.dataset.counters.snapshot().total("corrupt") == 1


# =========================================================================== convert and inspect


def test_the_cli_says_fp8_is_lossy_and_inspect_names_it(tmp_path, cli, capsys):
    from h5feed.cli import main

    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    assert "fp8: LOSSY, quantized to float8_e4m3fn" in " ".join(capsys.readouterr().out.split())
    write_synthetic(tmp_path / "src", "speculators-safetensors", 3, H, K, lengths=(4, 20), seed=2)
    converted = cli("convert", tmp_path / "src", tmp_path / "fp8", "--precision", "fp8", "--workers", "0")
    assert converted.status == 0
    assert (f"{tmp_path / 'fp8'}: the hidden states were quantized to FP8 (lossy: float8_e4m3fn with one scale per "
            "token, as hs-connectors' fp8 backend stores them); reads give them back in bfloat16, approximately"
            ) in converted.output
    summary = json.loads(cli("inspect", tmp_path / "fp8", "--json").stdout)
    assert summary["precision"] == "fp8 (float8_e4m3fn, one float32 scale per token), read as bfloat16"
    assert summary["lossy"] == "yes: quantized from bfloat16 by `h5feed convert --precision fp8`"
    assert summary == describe_store(tmp_path / "fp8") and summary["format_version"] == 4
    assert "precision" not in describe_store(h5feed.convert(tmp_path / "src", tmp_path / "exact", workers=0,
                                                            progress=False).store)


def test_bench_runs_no_baseline_on_a_lossy_store(tmp_path):
    """The speculators 0.4 baseline reads the bf16 files: its batches cannot equal an FP8 store's, and are not
    compared; h5feed's loaders are, with each other."""
    from h5feed.bench import Passes, run_bench
    from h5feed.bench.loaders import BASELINE

    write_synthetic(tmp_path / "src", "speculators-legacy-pt", 3, H, K, lengths=(20, 40), seed=5)
    h5feed.convert(tmp_path / "src", tmp_path / "fp8", workers=0, progress=False,
                   settings=h5feed.StoreSettings(precision="fp8"))
    result = run_bench(tmp_path / "fp8", workers=0, max_len=32,
                       passes=Passes([BASELINE, "BatchLoader-threads", "StreamLoader"], cold=False), progress=False)
    assert result.checks == {"BatchLoader-threads": "reference", "StreamLoader": "equal"}
    assert ("no baseline: this store's hidden states were quantized to FP8 (lossy), so its batches are not the "
            "source files'; h5feed benched alone") in result.notes


def test_a_rerun_must_ask_for_the_same_precision_and_an_append_is_quantized_too(tmp_path):
    src = tmp_path / "src"
    write_synthetic(src, "speculators-legacy-pt", 6, H, K, lengths=(4, 20), seed=3)
    (tmp_path / "later").mkdir()
    for i in (4, 5):  # files SRC gets after the first conversion
        (src / f"data_{i}.pt").rename(tmp_path / "later" / f"data_{i}.pt")
    h5feed.convert(src, tmp_path / "fp8", workers=0, progress=False, settings=h5feed.StoreSettings(precision="fp8"))
    with pytest.raises(StoreError) as refused:
        h5feed.convert(src, tmp_path / "fp8", workers=0, progress=False)
    assert "converted with precision fp8, not precision exact: " in refused.value.problem
    assert "pass --overwrite" in refused.value.problem
    for i in (4, 5):
        (tmp_path / "later" / f"data_{i}.pt").rename(src / f"data_{i}.pt")
    report = h5feed.convert(src, tmp_path / "fp8", workers=0, progress=False,
                            settings=h5feed.StoreSettings(precision="fp8"))
    assert (report.num_samples, report.converted_now) == (6, 2)
    assert verify_store(tmp_path / "fp8", src, progress=False).ok


def test_an_interrupted_fp8_conversion_resumes_to_the_same_bytes(tmp_path, interrupted_convert, assert_same_tree):
    src = tmp_path / "src"
    write_synthetic(src, "speculators-safetensors", 5, H, K, lengths=(4, 40), seed=4)
    h5feed.convert(src, tmp_path / "ref", workers=0, progress=False, settings=h5feed.StoreSettings(precision="fp8"))
    assert sorted(interrupted_convert(src, tmp_path / "store", after=2, settings=StoreSettings(precision="fp8"))) == [0, 1]
    with pytest.raises(StoreError) as refused:  # resuming asks for the same precision
        h5feed.convert(src, tmp_path / "store", workers=0, progress=False)
    assert refused.value.problem == ("was started with precision fp8, not precision exact: repeat that command to "
                                     "resume, or pass --overwrite")
    h5feed.convert(src, tmp_path / "store", workers=0, progress=False, settings=h5feed.StoreSettings(precision="fp8"))
    assert_same_tree(tmp_path / "ref", tmp_path / "store")


def test_an_fp8_store_in_a_bucket_reads_as_the_local_one(pairs, s3, bucket, tmp_path, assert_same_batch):
    """Converted into a bucket (published object by object) and read back through its clients, in worker processes
    and through the node cache: the batches of the local FP8 store, which equal FP8Transfer's."""
    pair = pairs("speculators-safetensors")
    url = f"s3://{bucket}/fp8.zarr"
    h5feed.convert(pair.src, url, workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=16, precision="fp8"),
                   bucket=h5feed.BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "staging"))
    want = [flat(b) for b in BatchLoader(pair.fp8, flavor="speculators", max_len=64, batch_size=2, schedule=h5feed.ScheduleOptions(shuffle=False))]
    for cache in (None, tmp_path / "cache"):
        loader = BatchLoader(h5feed.StoreOptions(url, storage_options=s3.storage_options, cache_dir=cache),
                             flavor="speculators", max_len=64, batch_size=2, num_workers=2,
                             schedule=h5feed.ScheduleOptions(shuffle=False))
        got = [flat(b) for b in loader]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_batch(g, w)
# =========================================================================== speculators' FP8 files


@pytest.fixture(scope="module")
def fp8_files(tmp_path_factory):
    """speculators' layout written by hs-connectors' fp8 backend (hs_{i}.safetensors: fp8 hidden_states,
    hidden_states_scales, token_ids, as FP8HiddenStatesConnector saves them, beside the Arrow dataset), from the
    bf16 files of the same samples; both converted."""
    import shutil

    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("fp8_files")
    write_synthetic(root / "bf16", "speculators-safetensors", N, H, K, lengths=LENGTHS, seed=12)
    shutil.copytree(root / "bf16", root / "fp8")
    for path in sorted((root / "fp8" / "hidden_states").glob("hs_*.safetensors")):
        tensors = load_file(str(path))
        fp8, scales = quantize_tensor_to_fp8(tensors["hidden_states"])
        save_file({**tensors, "hidden_states": fp8, SCALES_KEY: scales}, str(path))
    h5feed.convert(root / "bf16", root / "from_bf16", workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=16, precision="fp8"))
    h5feed.convert(root / "fp8", root / "from_fp8", workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=16))
    return root


def test_fp8_files_convert_to_the_store_a_bf16_conversion_to_fp8_makes(fp8_files, assert_same_tree):
    """FP8 sources stay FP8: their bytes and scales kept as they are (not lossy again), byte for byte the arrays
    and index of the store converted from the bf16 files of the same samples with --precision fp8."""
    store = Store(fp8_files / "from_fp8")
    assert (store.info.precision, store.info.quantized_from, store.info.format_version) == ("fp8", "", 4)
    assert not store.info.lossy
    assert describe_store(store.path)["lossy"] == "no: the source files' FP8 bytes and scales, kept as they were"
    for name in (*store.info.array_names, "index"):
        assert_same_tree(fp8_files / "from_bf16" / name, fp8_files / "from_fp8" / name)
    report = verify_store(store.path, fp8_files / "fp8", progress=False)
    assert report.ok and report.samples_checked == N, report.mismatches
    for precision in ("exact", "fp8"):  # an FP8 source's store is FP8 whichever was asked: a rerun has nothing to do
        rerun = h5feed.convert(fp8_files / "fp8", store.path, workers=0, progress=False,
                               settings=h5feed.StoreSettings(chunk_tokens=16, precision=precision))
        assert (rerun.num_samples, rerun.converted_now) == (N, 0)


@pytest.mark.parametrize("flavor", ["speculators", "speculators-legacy", "modelopt"])
def test_items_from_fp8_files_equal_fp8transfers(fp8_files, assert_same_batch, flavor):
    """What speculators' fp8 backend would hand its ArrowDataset, for every sample: FP8Transfer on the files."""
    store = Store(fp8_files / "from_fp8")
    transfer = FP8Transfer(fp8_files / "fp8" / "hidden_states")
    dataset = HiddenStatesDataset(store, flavor)
    spec = get_flavor(flavor)
    for i in range(N):
        restored = transfer.get_cached(int(store.source_indices[i]))["hidden_states"]
        raw = dataclasses.replace(store.read_sample(i), aux_hidden_states=restored[:, :K].reshape(-1, K * H),
                                  last_hidden_state=restored[:, K], hidden_scales=None)
        assert_same_batch(dataset[i], spec.build(raw, store.info, spec.default_hidden_states_dtype, None,
                                                 plain_allocator))


def test_an_fp8_file_without_its_scales_is_refused(fp8_files, tmp_path):
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(fp8_files / "fp8", tmp_path / "src")
    path = tmp_path / "src" / "hidden_states" / "hs_2.safetensors"
    tensors = load_file(str(path))
    del tensors[SCALES_KEY]
    save_file(tensors, str(path))
    with pytest.raises(h5feed.SourceError) as refused:
        h5feed.convert(tmp_path / "src", tmp_path / "store", workers=0, progress=False)
    assert refused.value.path == str(path)
    assert refused.value.problem == ("'hidden_states' is float8_e4m3fn without its 'hidden_states_scales': "
                                     "hs-connectors' fp8 backend writes both; the file is incomplete or was written "
                                     "otherwise")


@pytest.mark.parametrize("store_name", ["from_fp8", "from_bf16"])
def test_speculators_h5feed_backend_on_an_fp8_store_returns_fp8transfers_samples(fp8_files, store_name):
    """speculators' `--hidden-states-backend h5feed` on an FP8 store (of FP8 files, or --precision fp8 of the bf16
    ones): each get_cached(i) is what its fp8 backend's FP8Transfer returns for hs_{i}.safetensors, bit for bit."""
    from h5feed.integrations.speculators import StoreTransfer

    served = StoreTransfer(Store(fp8_files / store_name))
    files = FP8Transfer(fp8_files / "fp8" / "hidden_states")
    for i in range(N):
        got, want = served.get_cached(i), files.get_cached(i)
        assert list(got) == list(want) == ["token_ids", "hidden_states"]
        assert got["hidden_states"].dtype == want["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(got["hidden_states"].view(torch.int16), want["hidden_states"].view(torch.int16))
        assert torch.equal(got["token_ids"], want["token_ids"])


def test_vllm_files_of_the_fp8_connector_convert_to_an_fp8_store(tmp_path, assert_same_batch):
    """hs-connectors' FP8HiddenStatesConnector writes vLLM's {req_id}.safetensors (under their locks) with FP8
    hidden_states and their scales: kept as they are; every item's hidden states are FP8Transfer's for that file."""
    from safetensors.torch import load_file

    files = write_synthetic(tmp_path / "src", "vllm-safetensors", N, H, K, lengths=LENGTHS, seed=13)
    for path in files:
        tensors = load_file(str(path))
        fp8, scales = quantize_tensor_to_fp8(tensors["hidden_states"])
        save_file({**tensors, "hidden_states": fp8, SCALES_KEY: scales}, str(path))
    h5feed.convert(tmp_path / "src", tmp_path / "store", workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=16, last_state_norm="pre"))
    store = Store(tmp_path / "store")
    assert (store.info.source_format, store.info.num_aux_layers, store.info.precision, store.info.lossy) == (
        "vllm-safetensors", K, "fp8", False)
    assert verify_store(store.path, tmp_path / "src", progress=False).ok
    dataset = HiddenStatesDataset(store, "speculators")
    transfer = FP8Transfer(tmp_path / "src")
    for i in range(N):
        want = transfer.get_generated({"handle": str(tmp_path / "src" / store.source_paths[i])})["hidden_states"]
        item = dataset[i]
        assert torch.equal(item["hidden_states"].view(torch.int16), want[:, :K].reshape(-1, K * H).view(torch.int16))
        assert torch.equal(item["verifier_last_hidden_states"].view(torch.int16), want[:, K].view(torch.int16))


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan"), float("inf"), float("-inf"), 1e-40, 1e-13, 3e38, 1e36])
def test_an_fp8_file_with_a_scale_no_fp8_writer_makes_is_refused(fp8_files, tmp_path, scale):
    """hs-connectors' scale is max(amax / 448, 1e-12) of finite states: zero, negative, non-finite, subnormal or
    tiny scales, and scales above the largest float32 / 448, would be read back as zeros, flipped signs, NaN or
    Inf; they are refused, naming the file (the sample) and the token, before anything is written."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(fp8_files / "fp8", tmp_path / "src")
    path = tmp_path / "src" / "hidden_states" / "hs_4.safetensors"  # 40 tokens
    tensors = load_file(str(path))
    tensors[SCALES_KEY][7] = scale
    save_file(tensors, str(path))
    with pytest.raises(h5feed.SourceError) as refused:
        h5feed.convert(tmp_path / "src", tmp_path / "store", workers=0, progress=False)
    assert refused.value.path == str(path)
    stored = torch.tensor(scale).item()  # as float32
    assert refused.value.problem.startswith(f"token 7 has the scale {stored:g} in 'hidden_states_scales': ")
    assert "between 1e-12 and 7.6e+35" in refused.value.problem
    assert not (tmp_path / "store" / "zarr.json").exists()


def test_the_extreme_scales_an_fp8_writer_makes_are_accepted(tmp_path):
    """A token of zeros (scale 1e-12) and one whose amax is the largest float32 (scale float32 max / 448) convert."""
    from safetensors.torch import load_file

    files = write_synthetic(tmp_path / "src", "vllm-safetensors", 1, H, K, lengths=[3], seed=13)
    tensors = load_file(str(files[0]))
    layers = tensors["hidden_states"].float()
    layers[0] = 0
    layers[1, 0, 0] = torch.finfo(torch.float32).max
    fp8, scales = quantize_tensor_to_fp8(layers)
    assert scales[0].item() == np.float32(1e-12) and scales[1].item() == np.float32(3.4028234663852886e38 / 448)
    save_file({**tensors, "hidden_states": fp8, SCALES_KEY: scales}, str(files[0]))
    h5feed.convert(tmp_path / "src", tmp_path / "store", workers=0, progress=False,
                   settings=h5feed.StoreSettings(last_state_norm="pre"))
    assert verify_store(tmp_path / "store", tmp_path / "src", progress=False).ok


@pytest.mark.parametrize(("value", "layer", "place"), [(float("nan"), 1, "aux layer 1 of 3"),
                                                       (float("inf"), K, "the last hidden state")])
def test_a_token_holding_nan_or_inf_is_refused_by_an_fp8_conversion_and_kept_by_an_exact_one(tmp_path, value, layer,
                                                                                             place):
    """Quantized, one NaN or Inf makes the token's scale NaN or Inf and every value of it NaN: refused, naming the
    file, the token and the layer; an exact conversion keeps the file's bits, NaN and Inf included."""
    files = write_synthetic(tmp_path / "src", "speculators-legacy-pt", 4, H, K, lengths=(8, 20), seed=5)
    d = torch.load(files[2], weights_only=True)
    d["hidden_states"][layer][3, 5] = value
    torch.save(d, files[2])
    with pytest.raises(h5feed.SourceError) as refused:
        h5feed.convert(tmp_path / "src", tmp_path / "fp8", workers=0, progress=False,
                       settings=h5feed.StoreSettings(precision="fp8"))
    assert refused.value.path == str(files[2])
    assert refused.value.problem.startswith(f"token 3 holds {value} in {place} (value 5 of {H}), and quantized to "
                                            "FP8 every value of that token would be NaN")
    skipped = h5feed.convert(tmp_path / "src", tmp_path / "fp8", workers=0, progress=False, overwrite=True,
                             settings=h5feed.StoreSettings(precision="fp8"), skips=h5feed.SkipPolicy(skip_bad=True))
    assert (skipped.num_samples, Store(tmp_path / "fp8").info.skipped[0].path) == (3, "data_2.pt")
    h5feed.convert(tmp_path / "src", tmp_path / "exact", workers=0, progress=False)
    assert verify_store(tmp_path / "exact", tmp_path / "src", progress=False).ok


@pytest.mark.parametrize("write_behind", [0, 2])
def test_an_fp8_writer_refuses_a_token_holding_nan_or_inf_and_keeps_the_others(tmp_path, write_behind):
    files = write_synthetic(tmp_path / "src", "speculators-legacy-pt", 3, H, K, lengths=(8, 20), seed=6)
    samples = [torch.load(f, weights_only=True) for f in files]
    samples[1]["hidden_states"][0][2, 7] = float("-inf")
    with h5feed.open_writer(tmp_path / "w", settings=h5feed.StoreSettings(precision="fp8", chunk_tokens=16),
                            writing=h5feed.WriteOptions(write_behind=write_behind)) as writer:
        writer.append(samples[0], name="data_0.pt")
        with pytest.raises(h5feed.SourceError) as refused:
            writer.append(samples[1], name="data_1.pt")
        writer.append(samples[2], name="data_2.pt")
    assert refused.value.path == str(tmp_path / "w" / "data_1.pt")
    assert refused.value.problem.startswith(f"token 2 holds -inf in aux layer 0 of 3 (value 7 of {H}), and quantized")
    assert Store(tmp_path / "w").source_paths == ["data_0.pt", "data_2.pt"]
    assert verify_store(tmp_path / "w", progress=False).ok
