"""Readers of every input format: exact round trips from the generator's files, and precise errors."""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, NeedsCode, RunsEval, RunsShell, bits

from h5feed.errors import SourceError
from h5feed.formats import (
    FORMATS,
    SampleShape,
    SourceFile,
    SourceSample,
    detect_format,
)
from h5feed.testing.synthetic import (
    FileOptions,
    PipelineOptions,
    column_scales,
    make_sample,
    sample_lengths,
    write_synthetic,
)

H = 48
K = 3
N = 5
LENGTHS = (8, 60)

ALL_FORMATS = ["speculators-legacy-pt", "speculators-v0-pt", "specforge-ckpt", "speculators-safetensors"]


# --------------------------------------------------------------------------- helpers


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two bf16 tensors of one shape, equal bit for bit (NaN-safe, -0 vs 0 distinct)."""
    assert a.shape == b.shape and a.dtype == b.dtype == torch.bfloat16
    assert torch.equal(bits(a), bits(b))


def read_arrow_rows(root: Path) -> dict[str, list]:
    """The Arrow dataset beside hidden_states/, read independently of h5feed."""
    import pyarrow as pa

    state = json.loads((root / "state.json").read_text())
    tables = [pa.ipc.open_stream(pa.OSFile(str(root / f["filename"]))).read_all() for f in state["_data_files"]]
    return pa.concat_tables(tables).to_pydict()


def expected_from_file(
    fmt: str, path: Path, index: int, root: Path | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(input_ids, loss_mask, aux, last) built from the raw file as its trainer reads it."""
    if fmt == "speculators-safetensors":
        from safetensors.torch import load_file

        d = load_file(str(path))
        hs = d["hidden_states"]
        rows = read_arrow_rows(root if root is not None else path.parent.parent)
        mask = rows.get("loss_mask")
        mask_t = torch.tensor(mask[index], dtype=torch.int64) if mask is not None else None
        assert rows["seq_len"][index] == hs.shape[0]
        assert rows["input_ids"][index] == d["token_ids"].tolist()
        return d["token_ids"], mask_t, hs[:, :-1].flatten(1), hs[:, -1]
    if path.name.endswith(".gz"):
        d = torch.load(io.BytesIO(gzip.decompress(path.read_bytes())), weights_only=True)
    else:
        d = torch.load(path, weights_only=True)
    mask = d.get("loss_mask")
    if fmt == "speculators-legacy-pt":
        return d["input_ids"], mask, torch.cat(d["hidden_states"][:-1], dim=-1), d["hidden_states"][-1]
    if fmt == "speculators-v0-pt":
        return d["input_ids"], mask, d["hidden_state"], d["target"]
    assert d["aux_hidden_state"].shape[0] == 1 and d["hidden_state"].shape[0] == 1
    return d["input_ids"], mask, d["aux_hidden_state"][0], d["hidden_state"][0]


def check_sample(s: SourceSample, fmt: str, path: Path, index: int, root: Path | None = None) -> None:
    ids, mask, aux, last = expected_from_file(fmt, path, index, root)
    assert s.input_ids.dtype == torch.int64 and torch.equal(s.input_ids, ids)
    if mask is None:
        assert s.loss_mask is None
    else:
        assert s.loss_mask is not None and s.loss_mask.dtype == torch.int64
        assert torch.equal(s.loss_mask, mask)
    assert_same_bits(s.aux_hidden_states, aux)
    assert_same_bits(s.last_hidden_state, last)
    for t in (s.input_ids, s.aux_hidden_states, s.last_hidden_state):
        assert t.is_contiguous()
    if s.loss_mask is not None:
        assert s.loss_mask.is_contiguous()


def write(tmp_path: Path, fmt: str, files: FileOptions = FileOptions()) -> tuple[Path, list[Path]]:
    root = tmp_path / "src"
    written = write_synthetic(root, fmt, N, H, K, lengths=LENGTHS, seed=7, files=files)
    return root, written


def one_sample_dir(tmp_path: Path, d: dict, name: str = "data_0.pt") -> tuple[Path, Path]:
    root = tmp_path / "bad"
    root.mkdir(exist_ok=True)
    path = root / name
    torch.save(d, path)
    return root, path


def legacy_dict(t: int = 10, layers: int = K + 1, h: int = H) -> dict:
    return {
        "input_ids": torch.arange(t),
        "loss_mask": torch.ones(t, dtype=torch.int64),
        "hidden_states": [torch.randn(t, h).bfloat16() for _ in range(layers)],
    }


def expect_error(fn, path: Path, fragment: str) -> SourceError:
    with pytest.raises(SourceError) as info:
        fn()
    err = info.value
    assert fragment in str(err), str(err)
    assert Path(err.path).name == path.name, (err.path, path)
    assert str(path.name) in str(err)
    return err


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    ("fmt", "layout"),
    [
        (f, lay)
        for f in ALL_FORMATS
        for lay in ("flat", "rows")
        if not (f == "speculators-safetensors" and lay == "rows")
    ],
)
def test_round_trip_exact(tmp_path: Path, fmt: str, layout: str) -> None:
    root, files = write(tmp_path, fmt, FileOptions(layout=layout, rows_per_folder=2))
    f = FORMATS[fmt]
    assert detect_format(root) is f
    found = f.discover(root)
    assert [s.sample_index for s in found] == list(range(N))
    assert [s.path for s in found] == [p.absolute() for p in files]
    for s in found:
        assert s.path.is_absolute()
        assert (root / s.relpath).resolve() == s.path.resolve()
    if layout == "rows":
        assert found[3].relpath == f"rows_2-4/data_3.{'ckpt' if fmt == 'specforge-ckpt' else 'pt'}"
    elif fmt == "speculators-safetensors":
        assert found[3].relpath == "hidden_states/hs_3.safetensors"
    else:
        assert found[3].relpath == found[3].path.name
    lens = sample_lengths(N, LENGTHS, seed=7)
    for s, t in zip(found, lens):
        sample = f.load(s)
        check_sample(sample, fmt, s.path, s.sample_index)
        shape = f.probe(s)
        assert shape == SampleShape(t, H, K, torch.bfloat16)
        assert sample.shape == shape


def test_specforge_gz_round_trip(tmp_path: Path) -> None:
    root, files = write(tmp_path, "specforge-ckpt", FileOptions(compress=True, layout="rows", rows_per_folder=3))
    assert all(p.name.endswith(".ckpt.gz") for p in files)
    f = detect_format(root)
    assert f.name == "specforge-ckpt" and f.last_state_norm == "post"
    found = f.discover(root)
    assert [s.relpath for s in found][:4] == [
        "rows_0-3/data_0.ckpt.gz",
        "rows_0-3/data_1.ckpt.gz",
        "rows_0-3/data_2.ckpt.gz",
        "rows_3-6/data_3.ckpt.gz",
    ]
    for s in found:
        check_sample(f.load(s), "specforge-ckpt", s.path, s.sample_index)
        assert f.probe(s) == f.load(s).shape


def test_all_formats_carry_the_same_activations(tmp_path: Path) -> None:
    """Same seed, same values in every format: the readers agree with each other and with the generator."""
    scales = column_scales(H, K + 1, seed=7)
    lens = sample_lengths(N, LENGTHS, seed=7)
    for fmt in ALL_FORMATS:
        root = tmp_path / fmt
        write_synthetic(root, fmt, N, H, K, lengths=LENGTHS, seed=7)
        f = FORMATS[fmt]
        for s in f.discover(root):
            ids, mask, layers = make_sample(s.sample_index, lens[s.sample_index], scales, seed=7)
            got = f.load(s)
            assert torch.equal(got.input_ids, ids)
            assert got.loss_mask is not None and torch.equal(got.loss_mask, mask)
            assert_same_bits(got.aux_hidden_states, torch.cat(layers[:-1], dim=-1))
            assert_same_bits(got.last_hidden_state, layers[-1])


def test_norm_and_names() -> None:
    assert {n: f.last_state_norm for n, f in FORMATS.items()} == {
        "speculators-legacy-pt": "pre",
        "speculators-v0-pt": "post",
        "specforge-ckpt": "post",
        "specforge-dflash-ckpt": None,  # it stores no last state (tests/formats/test_specforge_formats.py)
        "speculators-safetensors": "pre",
        "modelopt-pt": None,  # the files say it, or the user does (tests/flavors/test_modelopt_angelslim_nemo.py)
        "angelslim-ckpt": None,
        "nemo-eagle3-cache": None,  # it stores no last state
        "vllm-safetensors": None,  # the user states it (tests/formats/test_vllm_files.py)
    }
    for n, f in FORMATS.items():
        assert f.name == n


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_no_loss_mask_gives_none(tmp_path: Path, fmt: str) -> None:
    root, _ = write(tmp_path, fmt, FileOptions(loss_mask=False))
    f = FORMATS[fmt]
    for s in f.discover(root):
        sample = f.load(s)
        assert sample.loss_mask is None
        check_sample(sample, fmt, s.path, s.sample_index)


def test_loss_mask_none_value_and_int32_ids(tmp_path: Path) -> None:
    d = legacy_dict()
    d["loss_mask"] = None
    d["input_ids"] = torch.arange(10, dtype=torch.int32)
    root, _path = one_sample_dir(tmp_path, d)
    f = FORMATS["speculators-legacy-pt"]
    s = f.load(f.discover(root)[0])
    assert s.loss_mask is None
    assert s.input_ids.dtype == torch.int64 and s.input_ids.tolist() == list(range(10))


def test_bool_loss_mask_becomes_int64(tmp_path: Path) -> None:
    d = legacy_dict()
    d["loss_mask"] = torch.tensor([False] * 3 + [True] * 7)
    root, _ = one_sample_dir(tmp_path, d)
    f = FORMATS["speculators-legacy-pt"]
    s = f.load(f.discover(root)[0])
    assert s.loss_mask is not None and s.loss_mask.dtype == torch.int64
    assert s.loss_mask.tolist() == [0] * 3 + [1] * 7


def test_old_non_zip_torch_save_is_read(tmp_path: Path) -> None:
    d = legacy_dict()
    root = tmp_path / "old"
    root.mkdir()
    torch.save(d, root / "data_3.pt", _use_new_zipfile_serialization=False)
    f = detect_format(root)
    s = f.load(f.discover(root)[0])
    assert_same_bits(s.last_hidden_state, d["hidden_states"][-1])
    assert_same_bits(s.aux_hidden_states, torch.cat(d["hidden_states"][:-1], -1))


def test_discover_sorts_by_index_ignores_other_files_and_nests(tmp_path: Path) -> None:
    root = tmp_path / "mixed"
    for rel in ["b/data_10.pt", "a/data_2.pt", "data_1.pt", "a/b/c/data_2.pt"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        torch.save(legacy_dict(), root / rel)
    (root / "sample_lengths.json").write_text("{}")
    (root / "data_config.json").write_text("{}")
    (root / "data_4.pt.tmp").write_bytes(b"")  # not named *.pt: not a sample file under a wrong name
    (root / "data_5.ckpt").write_bytes(b"")  # another format's file
    (root / "notes.txt").write_text("x")
    found = FORMATS["speculators-legacy-pt"].discover(root)
    assert [(s.sample_index, s.relpath) for s in found] == [
        (1, "data_1.pt"),
        (2, "a/b/c/data_2.pt"),
        (2, "a/data_2.pt"),
        (10, "b/data_10.pt"),
    ]


def test_safetensors_sharded_dirs_and_arrow_shards(tmp_path: Path) -> None:
    """Newer speculators shard hidden_states/ into sub-folders; save_to_disk may write several Arrow shards."""
    root = tmp_path / "st"
    write_synthetic(root, "speculators-safetensors", 7, H, K, lengths=LENGTHS, seed=3,
                    files=FileOptions(arrow_shards=3))
    shard = root / "hidden_states" / "0000"
    shard.mkdir()
    for p in list((root / "hidden_states").glob("hs_*.safetensors"))[:4]:
        p.rename(shard / p.name)
    state = json.loads((root / "state.json").read_text())
    assert len(state["_data_files"]) == 3
    f = detect_format(root)
    found = f.discover(root)
    assert [s.sample_index for s in found] == list(range(7))
    for s in found:
        check_sample(f.load(s), "speculators-safetensors", s.path, s.sample_index, root=root)


def test_load_never_unpickles_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = torch.load

    def spy(*a, **kw):
        calls.append(kw)
        if isinstance(a[0], (str, Path)) and str(a[0]).endswith(".pt"):
            assert kw.get("mmap") is True  # zip .pt files are memory-mapped: probe reads no tensor data
        assert kw.get("weights_only") is True
        return real(*a, **kw)

    monkeypatch.setattr(torch, "load", spy)
    for fmt, files in [("speculators-legacy-pt", FileOptions()), ("speculators-v0-pt", FileOptions()),
                       ("specforge-ckpt", FileOptions(compress=True))]:
        root = tmp_path / fmt
        write_synthetic(root, fmt, 2, H, K, lengths=LENGTHS, files=files)
        f = detect_format(root)
        for s in f.discover(root):
            f.probe(s)
            f.load(s)
    assert calls and all(c["weights_only"] is True and c["map_location"] == "cpu" for c in calls)


# --------------------------------------------------------------------------- bad inputs


def test_truncated_pt(tmp_path: Path) -> None:
    root, files = write(tmp_path, "speculators-legacy-pt")
    data = files[2].read_bytes()
    files[2].write_bytes(data[: len(data) // 2])
    f = FORMATS["speculators-legacy-pt"]
    src = f.discover(root)[2]
    expect_error(lambda: f.load(src), files[2], "not a readable torch.save file (truncated or corrupt)")
    expect_error(lambda: f.probe(src), files[2], "not a readable torch.save file (truncated or corrupt)")


def test_empty_pt_file(tmp_path: Path) -> None:
    root = tmp_path / "e"
    root.mkdir()
    (root / "data_0.pt").write_bytes(b"")
    f = FORMATS["speculators-legacy-pt"]
    expect_error(lambda: f.load(f.discover(root)[0]), root / "data_0.pt", "empty file (0 bytes)")


def test_truncated_ckpt_gz(tmp_path: Path) -> None:
    root, files = write(tmp_path, "specforge-ckpt", FileOptions(compress=True))
    data = files[1].read_bytes()
    files[1].write_bytes(data[: len(data) - 100])
    f = FORMATS["specforge-ckpt"]
    src = f.discover(root)[1]
    expect_error(lambda: f.load(src), files[1], "truncated or corrupt gzip file")


def test_random_bytes(tmp_path: Path) -> None:
    root = tmp_path / "r"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name in ["data_0.pt", "data_1.ckpt"]:
        (root / name).write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    expect_error(
        lambda: FORMATS["speculators-legacy-pt"].load(FORMATS["speculators-legacy-pt"].discover(root)[0]),
        root / "data_0.pt",
        "not a readable torch.save file (truncated or corrupt)",
    )
    f = FORMATS["specforge-ckpt"]
    expect_error(lambda: f.load(f.discover(root)[0]), root / "data_1.ckpt", "not a readable torch.save file")
    (root / "data_2.ckpt.gz").write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    gz = next(s for s in f.discover(root) if s.sample_index == 2)
    expect_error(lambda: f.load(gz), root / "data_2.ckpt.gz", "truncated or corrupt gzip file")


def test_pickle_that_needs_code(tmp_path: Path) -> None:
    d = legacy_dict()
    d["extra"] = NeedsCode()
    root, path = one_sample_dir(tmp_path, d)
    f = FORMATS["speculators-legacy-pt"]
    err = expect_error(
        lambda: f.load(f.discover(root)[0]),
        path,
        "refusing to load: the pickle needs code to run (h5feed always loads with weights_only=True)",
    )
    assert "NeedsCode" in str(err)
    # detection reads the first file too, and must refuse it the same way
    expect_error(lambda: detect_format(root), path, "refusing to load: the pickle needs code to run")
    # same inside a gzip
    buf = io.BytesIO()
    torch.save({"input_ids": torch.arange(3), "x": NeedsCode()}, buf)
    gzroot = tmp_path / "gz"
    gzroot.mkdir()
    (gzroot / "data_0.ckpt.gz").write_bytes(gzip.compress(buf.getvalue()))
    c = FORMATS["specforge-ckpt"]
    expect_error(
        lambda: c.load(c.discover(gzroot)[0]), gzroot / "data_0.ckpt.gz", "refusing to load: the pickle needs code"
    )


def test_not_a_dict(tmp_path: Path) -> None:
    root, path = one_sample_dir(tmp_path, [torch.zeros(3)])  # type: ignore[arg-type]
    f = FORMATS["speculators-legacy-pt"]
    expect_error(lambda: f.load(f.discover(root)[0]), path, "not a dict: the file holds a list")


def test_missing_key(tmp_path: Path) -> None:
    d = legacy_dict()
    del d["hidden_states"]
    root, path = one_sample_dir(tmp_path, d)
    f = FORMATS["speculators-legacy-pt"]
    expect_error(lambda: f.load(f.discover(root)[0]), path, "missing key(s) 'hidden_states'")
    expect_error(lambda: f.probe(f.discover(root)[0]), path, "missing key(s) 'hidden_states'")
    expect_error(lambda: detect_format(root), path, "match neither speculators legacy")
    d = {"input_ids": torch.arange(4), "target": torch.zeros(4, H)}
    root, path = one_sample_dir(tmp_path, d, "data_1.pt")
    v0 = FORMATS["speculators-v0-pt"]
    src = next(s for s in v0.discover(root) if s.sample_index == 1)
    expect_error(lambda: v0.load(src), path, "missing key(s) 'hidden_state'")


def test_hidden_states_of_one_tensor(tmp_path: Path) -> None:
    root, path = one_sample_dir(tmp_path, legacy_dict(layers=1))
    f = FORMATS["speculators-legacy-pt"]
    expect_error(
        lambda: f.load(f.discover(root)[0]), path, "'hidden_states' is a list of 1 tensor(s); expected K+1 >= 2"
    )
    expect_error(lambda: f.probe(f.discover(root)[0]), path, "'hidden_states' is a list of 1 tensor(s)")


def test_mismatched_tokens(tmp_path: Path) -> None:
    d = legacy_dict(t=10)
    d["hidden_states"][1] = torch.randn(9, H).bfloat16()
    root, path = one_sample_dir(tmp_path, d)
    f = FORMATS["speculators-legacy-pt"]
    expect_error(lambda: f.probe(f.discover(root)[0]), path, "'hidden_states'[1] has 9 tokens but 'input_ids' has 10")
    d = legacy_dict(t=10)
    d["loss_mask"] = torch.ones(11, dtype=torch.int64)
    root, path = one_sample_dir(tmp_path, d)
    expect_error(lambda: f.load(f.discover(root)[0]), path, "'loss_mask' has 11 entries but the sample has 10 tokens")
    v0 = FORMATS["speculators-v0-pt"]
    bad = {"input_ids": torch.arange(5), "hidden_state": torch.zeros(5, 3 * H), "target": torch.zeros(6, H)}
    root, path = one_sample_dir(tmp_path, bad)
    expect_error(lambda: v0.load(v0.discover(root)[0]), path, "'target' has 6 tokens but 'input_ids' has 5")


def test_wrong_dtypes_and_dims(tmp_path: Path) -> None:
    f = FORMATS["speculators-legacy-pt"]
    d = legacy_dict()
    d["input_ids"] = torch.arange(10, dtype=torch.float32)
    root, path = one_sample_dir(tmp_path, d)
    expect_error(
        lambda: f.load(f.discover(root)[0]),
        path,
        "'input_ids' has dtype torch.float32; token ids must be an integer dtype",
    )
    d = legacy_dict()
    d["input_ids"] = torch.full((10,), 2**63 + 5, dtype=torch.uint64)
    root, path = one_sample_dir(tmp_path, d)
    expect_error(lambda: f.load(f.discover(root)[0]), path, "cannot convert losslessly")
    d = legacy_dict()
    d["input_ids"] = torch.arange(10).unsqueeze(0)
    root, path = one_sample_dir(tmp_path, d)
    expect_error(lambda: f.load(f.discover(root)[0]), path, "'input_ids' must be 1-D [T], got shape [1, 10]")
    d = legacy_dict()
    d["hidden_states"][0] = torch.randn(10, H, 1).bfloat16()
    root, path = one_sample_dir(tmp_path, d)
    expect_error(
        lambda: f.load(f.discover(root)[0]), path, "'hidden_states'[0] must be [T, H] (2-D), got shape [10, 48, 1]"
    )
    d = legacy_dict()
    d["hidden_states"][2] = d["hidden_states"][2].float()
    root, path = one_sample_dir(tmp_path, d)
    expect_error(lambda: f.load(f.discover(root)[0]), path, "every layer must have the same H and dtype")
    d = legacy_dict(t=0)
    root, path = one_sample_dir(tmp_path, d)
    expect_error(lambda: f.probe(f.discover(root)[0]), path, "empty sample: 'input_ids' has 0 tokens")


def test_v0_width_must_divide(tmp_path: Path) -> None:
    v0 = FORMATS["speculators-v0-pt"]
    d = {
        "input_ids": torch.arange(5),
        "hidden_state": torch.zeros(5, 3 * H + 1).bfloat16(),
        "target": torch.zeros(5, H).bfloat16(),
    }
    root, path = one_sample_dir(tmp_path, d)
    expect_error(
        lambda: v0.probe(v0.discover(root)[0]),
        path,
        "'hidden_state' width 145 is not a positive multiple of the hidden size 48",
    )


def test_specforge_batch_dim(tmp_path: Path) -> None:
    c = FORMATS["specforge-ckpt"]
    d = {
        "input_ids": torch.arange(5),
        "loss_mask": torch.ones(5, dtype=torch.int64),
        "aux_hidden_state": torch.zeros(2, 5, 3 * H).bfloat16(),
        "hidden_state": torch.zeros(1, 5, H).bfloat16(),
    }
    root, path = one_sample_dir(tmp_path, d, "data_0.ckpt")
    expect_error(
        lambda: c.load(c.discover(root)[0]), path, "'aux_hidden_state' has a leading batch dim of 2, expected 1"
    )
    d["aux_hidden_state"] = torch.zeros(5, 3 * H).bfloat16()
    root, path = one_sample_dir(tmp_path, d, "data_0.ckpt")
    expect_error(
        lambda: c.load(c.discover(root)[0]), path, "'aux_hidden_state' must be [1, T, K*H] (3-D), got shape [5, 144]"
    )


def _st_root(tmp_path: Path) -> tuple[Path, list[Path]]:
    root = tmp_path / "st"
    return root, write_synthetic(root, "speculators-safetensors", 3, H, K, lengths=LENGTHS, seed=1)


def test_safetensors_bad_files(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    f = FORMATS["speculators-safetensors"]
    root, files = _st_root(tmp_path)
    # truncated
    data = files[0].read_bytes()
    files[0].write_bytes(data[: len(data) - 10])
    for fn in (f.probe, f.load):
        expect_error(lambda fn=fn: fn(f.discover(root)[0]), files[0], "truncated or corrupt safetensors file")
    # not a safetensors file at all
    files[0].write_bytes(b"")
    expect_error(lambda: f.probe(f.discover(root)[0]), files[0], "truncated or corrupt safetensors file")
    files[0].write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    expect_error(lambda: f.load(f.discover(root)[0]), files[0], "truncated or corrupt safetensors file")
    # token_ids of the wrong dtype or dims (0-D too)
    save_file({"token_ids": torch.arange(4.0), "hidden_states": torch.zeros(4, 2, H).bfloat16()}, str(files[1]))
    expect_error(lambda: f.probe(f.discover(root)[1]), files[1], "'token_ids' has dtype torch.float32; token ids must")
    save_file({"token_ids": torch.tensor(3), "hidden_states": torch.zeros(4, 2, H).bfloat16()}, str(files[1]))
    expect_error(lambda: f.probe(f.discover(root)[1]), files[1], "'token_ids' must be 1-D [T], got shape []")
    save_file({"token_ids": torch.arange(4), "hidden_states": torch.zeros(4, 2, H, dtype=torch.int32)}, str(files[1]))
    expect_error(
        lambda: f.probe(f.discover(root)[1]), files[1], "'hidden_states' has dtype torch.int32; hidden states must be"
    )
    # 2-D hidden_states
    save_file({"token_ids": torch.arange(4), "hidden_states": torch.zeros(4, H).bfloat16()}, str(files[1]))
    expect_error(
        lambda: f.load(f.discover(root)[1]), files[1], "'hidden_states' must be [T, K+1, H] (3-D), got shape [4, 48]"
    )
    # only one layer
    save_file({"token_ids": torch.arange(4), "hidden_states": torch.zeros(4, 1, H).bfloat16()}, str(files[1]))
    expect_error(lambda: f.load(f.discover(root)[1]), files[1], "expected K+1 >= 2")
    # missing key
    save_file({"hidden_states": torch.zeros(4, 2, H).bfloat16()}, str(files[1]))
    expect_error(lambda: f.load(f.discover(root)[1]), files[1], "missing key(s) 'token_ids'")
    # T disagrees with the Arrow row's seq_len
    save_file({"token_ids": torch.arange(4), "hidden_states": torch.zeros(4, 2, H).bfloat16()}, str(files[2]))
    expect_error(lambda: f.probe(f.discover(root)[2]), files[2], "row 2 of the Arrow dataset says seq_len=")


def test_torch_formats_do_not_need_safetensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)  # any import of it now fails
    root, _ = write(tmp_path, "speculators-legacy-pt")
    f = detect_format(root)
    for s in f.discover(root):
        assert f.load(s).shape == f.probe(s)


def test_safetensors_token_ids_must_match_arrow_row(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    f = FORMATS["speculators-safetensors"]
    root, files = _st_root(tmp_path)
    d = load_file(str(files[1]))
    d["token_ids"] = d["token_ids"].flip(0).contiguous()
    save_file(d, str(files[1]))
    expect_error(lambda: f.load(f.discover(root)[1]), files[1], "'token_ids' differ from 'input_ids' of row 1")


def test_safetensors_without_arrow_dataset_or_row(tmp_path: Path) -> None:
    f = FORMATS["speculators-safetensors"]
    root, files = _st_root(tmp_path)
    shutil.copy(files[0], files[0].parent / "hs_9.safetensors")
    src = next(s for s in f.discover(root) if s.sample_index == 9)
    expect_error(lambda: f.probe(src), src.path, "no row 9 in the Arrow dataset")
    (root / "state.json").unlink()
    with pytest.raises(SourceError, match="state.json missing") as info:
        f.discover(root)  # the cached Arrow view must notice that the dataset went away
    assert info.value.path == str(root)


def test_empty_directory(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    with pytest.raises(SourceError) as info:
        detect_format(root)
    assert info.value.path == str(root)
    assert "no sample files of any known format found" in str(info.value)
    for name, fragment in [
        ("speculators-legacy-pt", "no data_{i}.pt files found"),
        ("speculators-v0-pt", "no data_{i}.pt files found"),
        ("specforge-ckpt", "no data_{i}.ckpt or data_{i}.ckpt.gz files found"),
        ("speculators-safetensors", "no hidden_states/hs_{i}.safetensors files found"),
    ]:
        with pytest.raises(SourceError) as info:
            FORMATS[name].discover(root)
        assert fragment in str(info.value)
        assert info.value.path == str(root)


def test_not_a_directory(tmp_path: Path) -> None:
    p = tmp_path / "file.pt"
    p.write_bytes(b"x")
    with pytest.raises(SourceError, match="is not a directory"):
        detect_format(p)
    with pytest.raises(SourceError, match="does not exist"):
        detect_format(tmp_path / "nope")


def test_pt_and_ckpt_mixed_is_ambiguous(tmp_path: Path) -> None:
    root = tmp_path / "mix"
    root.mkdir()
    torch.save(legacy_dict(), root / "data_0.pt")
    torch.save(legacy_dict(), root / "data_1.ckpt")
    with pytest.raises(SourceError, match="holds both data_"):
        detect_format(root)


@pytest.mark.parametrize("most, odd", [("speculators-legacy-pt", "speculators-v0-pt"),
                                       ("speculators-v0-pt", "speculators-legacy-pt")])
def test_one_speculators_generation_among_the_other_is_named(tmp_path: Path, most: str, odd: str) -> None:
    """Both generations name their files data_{i}.pt: a file of the other one among them is named for what it is,
    not for the keys it lacks."""
    import h5feed

    src = tmp_path / "src"
    write_synthetic(src, most, 3, H, lengths=(4, 8), seed=1)
    write_synthetic(tmp_path / "other", odd, 1, H, lengths=(4, 8), seed=2)
    shutil.copy(tmp_path / "other" / "data_0.pt", src / "data_3.pt")
    with pytest.raises(SourceError) as err:
        h5feed.convert(src, tmp_path / "store", workers=0, progress=False)
    keys = {"speculators-legacy-pt": "a 'hidden_states' list", "speculators-v0-pt": "'hidden_state' + 'target'"}
    assert str(err.value) == (f"{src / 'data_3.pt'}: is a {odd} file ({keys[odd]}), but this source is read as "
                              f"{most} (its first file's format, or --format): convert the two kinds of file from "
                              "separate folders")


def test_formats_pickle_by_name(tmp_path: Path) -> None:
    """Workers receive formats by pickling; the safetensors one holds a lock and mmapped tables."""
    import pickle

    root, _ = _st_root(tmp_path)
    f = FORMATS["speculators-safetensors"]
    f.probe(f.discover(root)[0])  # fills its cache
    for fmt in FORMATS.values():
        assert pickle.loads(pickle.dumps(fmt)) is fmt
    src = f.discover(root)[0]
    assert pickle.loads(pickle.dumps(src)) == src


def test_source_file_is_frozen() -> None:
    s = SourceFile(Path("/x/data_1.pt"), 1, "data_1.pt")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.sample_index = 2  # type: ignore[misc]
    assert os.fspath(s.path) == "/x/data_1.pt"


def test_gz_probe_reads_the_pickle_at_the_head_only(tmp_path):
    """Probing a .ckpt.gz takes shapes from the pickle at the start of the stream (no 100 MB
    decompression); the data itself is checked when the sample is loaded."""
    from h5feed.formats import FORMATS

    write_synthetic(tmp_path / "src", "specforge-ckpt", 3, 32, lengths=[40, 41, 42], seed=2,
                    files=FileOptions(compress=True))
    fmt = FORMATS["specforge-ckpt"]
    sources = fmt.discover(tmp_path / "src")
    assert [fmt.probe(s) for s in sources] == [fmt.load(s).shape for s in sources]
    path = sources[1].path
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(data[: len(data) // 2]))  # a valid gzip of half the torch.save bytes
    assert fmt.probe(sources[1]).num_tokens == 41
    with pytest.raises(SourceError, match="truncated or corrupt"):
        fmt.load(sources[1])


# --------------------------------------------------------------------------- code in the sources, refused


class RunsPopen(RunsShell):
    """Unpickling it starts a process (subprocess.Popen)."""

    def __reduce__(self):
        return (subprocess.Popen, (["touch", str(self.marker)],))


class RunsSetstate(RunsShell):
    """An instance of a class of ours: unpickling it runs its __setstate__."""

    def __reduce__(self):
        return (RunsSetstate, (self.marker,), {"marker": str(self.marker)})

    def __setstate__(self, state: dict) -> None:
        Path(state["marker"]).touch()


PAYLOADS = {  # what each payload makes torch name: its GLOBAL
    "os.system": (RunsShell, "posix.system"),
    "builtins.eval": (RunsEval, "eval"),
    "subprocess.Popen": (RunsPopen, "commands.Popen"),  # pickle protocol 2 writes subprocess under its Python 2 name
    "custom class": (RunsSetstate, f"{RunsSetstate.__module__}.RunsSetstate"),
}

def v0_dict(t: int = 4) -> dict:
    return {"input_ids": torch.arange(t), "hidden_state": torch.zeros(t, K * H), "target": torch.zeros(t, H)}


def specforge_dict(t: int = 4) -> dict:
    aux, last = torch.zeros(1, t, K * H), torch.zeros(1, t, H)
    return {"input_ids": torch.arange(t), "aux_hidden_state": aux, "hidden_state": last}


def modelopt_dict(t: int = 4) -> dict:
    return {"input_ids": torch.arange(t), "hidden_states": torch.zeros(t, H), "aux_hidden_states": torch.zeros(t, K * H)}


def angelslim_dict(t: int = 4) -> dict:
    return {"input_ids": torch.arange(t)[None], "loss_mask": torch.ones(1, t, dtype=torch.int64),
            "hidden_states": torch.zeros(1, t, K * H), "target_hiddens": torch.zeros(1, t, H)}


# (format, file name, a valid sample of it, torch.save's keyword arguments)
PICKLE_FILES = {
    "legacy .pt": ("speculators-legacy-pt", "data_0.pt", legacy_dict, {}),
    "legacy .pt, pre-1.6 serialization": (
        "speculators-legacy-pt", "data_0.pt", legacy_dict, {"_use_new_zipfile_serialization": False}
    ),
    "v0 .pt": ("speculators-v0-pt", "data_0.pt", v0_dict, {}),
    "specforge .ckpt": ("specforge-ckpt", "data_0.ckpt", specforge_dict, {}),
    "specforge .ckpt.gz": ("specforge-ckpt", "data_0.ckpt.gz", specforge_dict, {}),
    "Model-Optimizer .pt": ("modelopt-pt", "conv_0.pt", modelopt_dict, {}),
    "AngelSlim .ckpt": ("angelslim-ckpt", "rank_0/rows_0-5000/data_0.ckpt", angelslim_dict, {}),
}


def needs_code(what: str) -> str:
    return (
        "refusing to load: the pickle needs code to run (h5feed always loads with weights_only=True): "
        f"{what}; re-save it holding only tensors, lists and dicts"
    )


def save_sample(path: Path, d: dict, **kw) -> None:
    buf = io.BytesIO()
    torch.save(d, buf, **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(buf.getvalue()) if path.name.endswith(".gz") else buf.getvalue())


def assert_refused(fn, path: Path, what: str) -> None:
    with pytest.raises(SourceError) as info:
        fn()
    assert (info.value.path, info.value.problem) == (str(path), needs_code(what))
    assert "False" not in str(info.value)  # never torch's advice to retry with weights_only=False


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("kind", PICKLE_FILES)
def test_code_carrying_pickles_are_refused_by_name_and_never_run(tmp_path: Path, kind: str, payload: str) -> None:
    fmt_name, name, sample, save_kw = PICKLE_FILES[kind]
    cls, global_name = PAYLOADS[payload]
    marker = tmp_path / "ran"
    root = tmp_path / "src"
    d = sample()
    d["meta"] = cls(marker)
    save_sample(root / name, d, **save_kw)
    f = FORMATS[fmt_name]
    source = f.discover(root)[0]
    what = f"it references {global_name}, a class or function that is not a tensor or plain container"
    assert_refused(lambda: f.probe(source), source.path, what)
    assert_refused(lambda: f.load(source), source.path, what)
    assert_refused(lambda: detect_format(root), source.path, what)  # telling formats apart reads the keys
    assert not marker.exists()


@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_code_carrying_angelslim_vocab_mapping_is_refused(tmp_path: Path, payload: str) -> None:
    """AngelSlim's vocab_mapping.pt is a pickle too: the store keeps it only once it loads without code."""
    from h5feed import convert

    cls, global_name = PAYLOADS[payload]
    marker = tmp_path / "ran"
    root = tmp_path / "src"
    write_synthetic(root, "angelslim-ckpt", 2, H, K, lengths=(4, 6), seed=1)
    save_sample(root / "vocab_mapping.pt", {"d2t": torch.zeros(4, dtype=torch.int64), "t2d": cls(marker)})
    what = f"it references {global_name}, a class or function that is not a tensor or plain container"
    assert_refused(lambda: convert(root, tmp_path / "store", workers=0, progress=False), root.resolve() / "vocab_mapping.pt",
                   what)
    assert not marker.exists() and not (tmp_path / "store").exists()


@pytest.mark.parametrize("payload", PAYLOADS)
def test_the_payloads_do_run_when_unpickled_unsafely(tmp_path: Path, payload: str) -> None:
    """The test files above are real attacks: torch.load(weights_only=False) runs them."""
    marker = tmp_path / "ran"
    path = tmp_path / "data_0.pt"
    torch.save({"meta": PAYLOADS[payload][0](marker)}, path)
    loaded = torch.load(path, weights_only=False)["meta"]
    if isinstance(loaded, subprocess.Popen):
        loaded.wait()
    assert marker.exists()


def _unicode(s: str) -> bytes:
    return b"X" + struct.pack("<I", len(s.encode())) + s.encode()  # BINUNICODE


def save_with_pickle(path: Path, pkl: bytes) -> None:
    """A torch.save zip whose data.pkl is ``pkl``: pickles torch.save would never write."""
    buf = io.BytesIO()
    torch.save({}, buf)
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, pkl if info.filename.endswith("/data.pkl") else src.read(info))


EVAL_SOURCE = "open('ran', 'w').close()"
CRAFTED_PICKLES = {  # protocol-2 header, then opcodes torch's weights-only unpickler refuses
    "STACK_GLOBAL eval": (b"\x80\x02" + _unicode("builtins") + _unicode("eval") + b"\x93" + _unicode(EVAL_SOURCE)
                          + b"\x85R.", "it uses the pickle opcode STACK_GLOBAL, which imports a class or function"),
    "INST eval": (b"\x80\x02(" + _unicode(EVAL_SOURCE) + b"ibuiltins\neval\n.",
                  "it uses the pickle opcode INST, which imports a class or function and calls it"),
    "OBJ": (b"\x80\x02(}o.", "it uses the pickle opcode OBJ, which builds an object of a class"),
    "NEWOBJ_EX": (b"\x80\x02})}\x92.", "it uses the pickle opcode NEWOBJ_EX, which builds an object of a class"),
    "REDUCE of a non-allowed callable": (b"\x80\x02ccollections\nOrderedDict\n)R)R.",
                                         "it calls OrderedDict(), not one of torch's tensor builders"),
    "NEWOBJ of a non-allowed class": (b"\x80\x02})\x81.", "it creates an object of {}"),
    "BUILD of a non-allowed object": (b"\x80\x02K\x01}b.", "it sets the state of an object of <class 'int'>"),
}


@pytest.mark.parametrize("kind", CRAFTED_PICKLES)
def test_crafted_pickles_are_refused_as_needing_code(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkl, what = CRAFTED_PICKLES[kind]
    monkeypatch.chdir(tmp_path)  # where the eval payloads would write
    root = tmp_path / "src"
    root.mkdir()
    save_with_pickle(root / "data_0.pt", pkl)
    f = FORMATS["speculators-legacy-pt"]
    assert_refused(lambda: f.load(f.discover(root)[0]), root / "data_0.pt", what)
    assert_refused(lambda: detect_format(root), root / "data_0.pt", what)
    assert not (tmp_path / "ran").exists()


def test_crafted_eval_pickles_do_run_when_unpickled_unsafely(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    monkeypatch.chdir(tmp_path)
    for kind in ("STACK_GLOBAL eval", "INST eval"):
        pickle.loads(CRAFTED_PICKLES[kind][0])
        assert (tmp_path / "ran").exists()
        (tmp_path / "ran").unlink()


def test_pickle_protocol_4_is_named_not_called_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "p4"
    root.mkdir()
    torch.save(legacy_dict(), root / "data_0.pt", pickle_protocol=4)
    f = FORMATS["speculators-legacy-pt"]
    with pytest.warns(UserWarning, match="Detected pickle protocol 4"), pytest.raises(SourceError) as info:
        f.load(f.discover(root)[0])
    assert info.value.problem == (
        "its pickle uses the opcode FRAME of pickle protocol 4, which torch's weights-only loader cannot read; "
        "re-save it with torch.save's default pickle protocol (2)"
    )


def touch_all(root: Path, *relpaths: str) -> None:
    """Empty files: discovery reads names only."""
    for rel in relpaths:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"")


def records(found) -> list[dict[str, str]]:
    return [s.record() for s in found.skipped]


def expect_scan(f, root: Path, files: list[str], skipped: list[tuple[str, str]]) -> None:
    """scan(skip_bad=True) finds exactly these files and skips exactly these entries; discover() raises the first."""
    found = f.scan(root, skip_bad=True)
    assert [s.relpath for s in found.files] == files
    assert records(found) == [{"path": rel, "problem": problem} for rel, problem in skipped]
    assert [s.path for s in found.skipped] == [root.absolute() / rel for rel, _ in skipped]
    with pytest.raises(SourceError) as info:
        f.discover(root)
    assert (info.value.path, info.value.problem) == (str(root.absolute() / skipped[0][0]), skipped[0][1])


MISNAMED = "has a sample file's extension but its name does not match "


def test_misnamed_sample_files_are_errors_or_skips(tmp_path: Path) -> None:
    root = tmp_path / "pt"
    touch_all(root, "data_0.pt", "rows_0-2/data_3.pt", "notes.pt", "data_x.pt", "rows_0-2/data_3.pt.tmp", "x.ckpt")
    expect_scan(FORMATS["speculators-legacy-pt"], root, ["data_0.pt", "rows_0-2/data_3.pt"],
                [("data_x.pt", MISNAMED + "data_{i}.pt"), ("notes.pt", MISNAMED + "data_{i}.pt")])
    root = tmp_path / "ckpt"
    touch_all(root, "data_0.ckpt", "data_1.ckpt.gz", "model.ckpt", "data_2.ckpt.bak", "data_y.ckpt.gz", "notes.pt")
    expect_scan(FORMATS["specforge-ckpt"], root, ["data_0.ckpt", "data_1.ckpt.gz"],
                [("data_y.ckpt.gz", MISNAMED + "data_{i}.ckpt or data_{i}.ckpt.gz"),
                 ("model.ckpt", MISNAMED + "data_{i}.ckpt or data_{i}.ckpt.gz")])
    root, _ = _st_root(tmp_path)
    touch_all(root, "hidden_states/0000/hs_x.safetensors", "model.safetensors")  # the latter: not in hidden_states/
    expect_scan(FORMATS["speculators-safetensors"], root,
                ["hidden_states/hs_0.safetensors", "hidden_states/hs_1.safetensors", "hidden_states/hs_2.safetensors"],
                [("hidden_states/0000/hs_x.safetensors", MISNAMED + "hs_{i}.safetensors")])


def test_links_that_cannot_be_followed_are_errors_or_skips(tmp_path: Path) -> None:
    root = tmp_path / "src"
    touch_all(root, "data_0.pt")
    os.symlink("loop.pt", root / "loop.pt")
    os.symlink("missing.pt", root / "data_1.pt")
    os.symlink("rows_a", root / "rows_b")  # folders that lead to each other
    os.symlink("rows_b", root / "rows_a")
    os.symlink(tmp_path / "gone", root / "rows_c")  # a folder that went away
    touch_all(root, "docs/readme.txt")
    os.symlink("nowhere.txt", root / "docs" / "link.txt")  # any name: a broken link may have been a folder
    expect_scan(FORMATS["speculators-legacy-pt"], root, ["data_0.pt"], [
        ("data_1.pt", "is a broken symbolic link: its target missing.pt does not exist"),
        ("docs/link.txt", "is a broken symbolic link: its target nowhere.txt does not exist"),
        ("loop.pt", "is a symbolic link that loops: not followed"),
        ("rows_a", "is a symbolic link that loops: not followed"),
        ("rows_b", "is a symbolic link that loops: not followed"),
        ("rows_c", f"is a broken symbolic link: its target {tmp_path / 'gone'} does not exist"),
    ])


def test_a_pipe_named_like_a_sample_is_never_opened(tmp_path: Path) -> None:
    root = tmp_path / "src"
    touch_all(root, "data_0.pt")
    os.mkfifo(root / "data_1.pt")  # opening it would wait for a writer forever
    os.symlink("data_1.pt", root / "data_2.pt")
    expect_scan(FORMATS["speculators-legacy-pt"], root, ["data_0.pt"], [
        ("data_1.pt", "is not a regular file (a pipe, socket or device)"),
        ("data_2.pt", f"is a symbolic link to {os.path.realpath(root / 'data_1.pt')}, which is not a regular file"),
    ])


def test_links_out_of_the_source_are_not_followed(tmp_path: Path) -> None:
    """A link to the parent folder used to pull a sibling run's samples into the conversion."""
    family = tmp_path / "family"
    for run in ("run1", "run2"):
        write_synthetic(family / run, "speculators-legacy-pt", 2, H, K, lengths=LENGTHS, seed=1)
    run1 = family / "run1"
    os.symlink("..", run1 / "up")
    os.symlink("../run2/data_0.pt", run1 / "data_7.pt")
    real = os.path.realpath(family)
    expect_scan(FORMATS["speculators-legacy-pt"], run1, ["data_0.pt", "data_1.pt"], [
        ("data_7.pt", f"is a symbolic link to {real}/run2/data_0.pt, outside {run1}: not followed"),
        ("up", f"is a symbolic link to the folder {real}, outside {run1}: not followed"),
    ])
    assert detect_format(run1) is FORMATS["speculators-legacy-pt"]  # detection reads the samples, not the links


def test_links_inside_the_source_are_read_once(tmp_path: Path) -> None:
    root = tmp_path / "src"
    write_synthetic(root, "speculators-legacy-pt", 3, H, K, lengths=LENGTHS, seed=1,
                    files=FileOptions(layout="rows", rows_per_folder=2))
    (root / "blobs").mkdir()
    (root / "rows_2-4" / "data_2.pt").rename(root / "blobs" / "sample.bin")
    os.symlink("../blobs/sample.bin", root / "rows_2-4" / "data_2.pt")  # a sample whose data lies elsewhere in SRC
    os.symlink("rows_0-2", root / "alias")  # a second way into a folder that is walked anyway
    os.symlink(".", root / "itself")
    os.symlink("rows_0-2/data_1.pt", root / "data_5.pt")  # the same file as sample 1
    f = FORMATS["speculators-legacy-pt"]
    expect_scan(f, root, ["rows_0-2/data_0.pt", "rows_0-2/data_1.pt", "rows_2-4/data_2.pt"],
                [("data_5.pt", "is a symbolic link to rows_0-2/data_1.pt, already a sample file")])
    (root / "data_5.pt").unlink()
    found = f.discover(root)
    assert [s.relpath for s in found] == ["rows_0-2/data_0.pt", "rows_0-2/data_1.pt", "rows_2-4/data_2.pt"]
    check_sample(f.load(found[2]), "speculators-legacy-pt", root / "blobs" / "sample.bin", 2)
    os.symlink(root, tmp_path / "src-link")  # the root itself through a link: nothing in it is "outside"
    assert [s.relpath for s in f.discover(tmp_path / "src-link")] == [s.relpath for s in found]


@pytest.fixture
def shared_tmp():
    """A folder the unprivileged user can enter (pytest's tmp_path lies in a folder only its owner may enter)."""
    base = Path(tempfile.mkdtemp(prefix="h5feed-test-"))
    base.chmod(0o755)
    yield base
    for folder, subfolders, _ in os.walk(base):  # top-down: each folder is opened up before it is entered
        for name in subfolders:
            os.chmod(os.path.join(folder, name), 0o755)
    shutil.rmtree(base)


# Root reads a chmod 000 folder regardless, so a child run as root becomes 'nobody' before it
# looks: after its imports, as the interpreter's own files may lie where 'nobody' cannot go.
BECOME_NOBODY = """
import os, pwd
if os.geteuid() == 0:
    nobody = pwd.getpwnam("nobody")
    os.setgroups([])
    os.setgid(nobody.pw_gid)
    os.setuid(nobody.pw_uid)
"""


def run_unprivileged(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run python ``code`` in a child that file permissions bind (see BECOME_NOBODY)."""
    code = code.replace("# BECOME_NOBODY", BECOME_NOBODY)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HOME": str(cwd)}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)


def test_an_unreadable_folder_is_an_error_or_a_skip(shared_tmp: Path) -> None:
    """A real chmod 000 folder, read by a real unprivileged process."""
    src = shared_tmp / "src"
    write_synthetic(src, "speculators-legacy-pt", 4, H, K, lengths=LENGTHS, seed=1,
                    files=FileOptions(layout="rows", rows_per_folder=2))
    out = shared_tmp / "out"
    out.mkdir()
    out.chmod(0o777)
    locked = src / "rows_2-4"
    locked.chmod(0o000)
    problem = "folder cannot be read (Permission denied): the files in it were not searched"
    code = f"""
import json, os
from h5feed.errors import SourceError
from h5feed.formats import FORMATS, detect_format
# BECOME_NOBODY
f = FORMATS["speculators-legacy-pt"]
result = {{"uid": os.geteuid(), "can_list": os.access({str(locked)!r}, os.R_OK)}}
try:
    f.discover({str(src)!r})
except SourceError as exc:
    result["error"] = [exc.path, exc.problem]
found = f.scan({str(src)!r}, skip_bad=True)
result["files"] = [s.relpath for s in found.files]
result["skipped"] = [s.record() for s in found.skipped]
result["detected"] = detect_format({str(src)!r}).name
try:
    f.scan({str(locked)!r}, skip_bad=True)  # the root itself: nothing to skip to
except SourceError as exc:
    result["root_error"] = [exc.path, exc.problem]
print(json.dumps(result))
"""
    r = run_unprivileged(code, cwd=out)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result.pop("uid") != 0
    assert result == {
        "can_list": False,
        "error": [str(locked), problem],
        "files": ["rows_0-2/data_0.pt", "rows_0-2/data_1.pt"],
        "skipped": [{"path": "rows_2-4", "problem": problem}],
        "detected": "speculators-legacy-pt",
        "root_error": [str(locked), "cannot be read (Permission denied)"],
    }
    code = f"""
import sys
from h5feed.cli import build_parser, main
build_parser()  # it imports the commands' modules (h5feed.bench lazily)
# BECOME_NOBODY
sys.exit(main(["-q", "convert", {str(src)!r}, {str(out / "store")!r}, "--workers", "0"]))
"""
    r = run_unprivileged(code, cwd=out)
    assert r.returncode == 1, r.stderr
    assert f"h5feed convert: error: {locked}: {problem}" in r.stderr
    assert not (out / "store").exists()


JUNK = np.random.default_rng(0).bytes(4096)


def test_detection_with_skip_bad_passes_over_junk_and_says_when_all_is_junk(tmp_path: Path) -> None:
    root = tmp_path / "src"
    files = write_synthetic(root, "speculators-v0-pt", 10, H, K, lengths=LENGTHS, seed=1)
    for p in files[:9]:
        p.write_bytes(JUNK)
    os.symlink("missing.pt", root / "data_10.pt")
    corrupt = "not a readable torch.save file (truncated or corrupt): UnpicklingError: Unsupported operand 95"
    with pytest.raises(SourceError) as info:
        detect_format(root)  # without skip_bad the first bad file stops it, as it would stop the conversion
    assert (info.value.path, info.value.problem) == (str(files[0].absolute()), corrupt)
    assert detect_format(root, skip_bad=True) is FORMATS["speculators-v0-pt"]  # the tenth file is good
    files[9].write_bytes(JUNK)
    with pytest.raises(SourceError) as info:
        detect_format(root, skip_bad=True)
    assert (info.value.path, info.value.problem) == (str(root), (
        "no readable sample files: 11 skipped, first problems: "
        f"data_0.pt: {corrupt}; data_1.pt: {corrupt}; data_10.pt: is a broken symbolic link: its target missing.pt "
        "does not exist"))


def test_nothing_but_unusable_entries(tmp_path: Path) -> None:
    root = tmp_path / "src"
    root.mkdir()
    os.symlink("missing.ckpt", root / "data_0.ckpt")
    touch_all(root, "notes.pt")
    broken = "is a broken symbolic link: its target missing.ckpt does not exist"
    for find in (detect_format, FORMATS["specforge-ckpt"].discover):
        with pytest.raises(SourceError) as info:
            find(root)
        assert (info.value.path, info.value.problem) == (str(root.absolute() / "data_0.ckpt"), broken)
    everything = f"data_0.ckpt: {broken}; notes.pt: {MISNAMED}data_{{i}}.pt"
    with pytest.raises(SourceError) as info:
        detect_format(root, skip_bad=True)
    assert (info.value.path, info.value.problem) == (
        str(root), f"no readable sample files: 2 skipped, first problems: {everything}")
    with pytest.raises(SourceError) as info:
        FORMATS["specforge-ckpt"].scan(root, skip_bad=True)
    assert (info.value.path, info.value.problem) == (
        str(root), f"no readable sample files: 1 skipped, first problems: data_0.ckpt: {broken}")


# --------------------------------------------------------------------------- Model-Optimizer, AngelSlim, NeMo (E-G)


def test_formats_are_told_apart_by_their_keys(tmp_path: Path) -> None:
    """The key `hidden_states` is a list (speculators legacy), the last state (Model-Optimizer) or the aux concat
    (AngelSlim): detection reads the companion keys, whatever the files are called."""
    cases = {
        "modelopt-pt": ("conv_7.pt", modelopt_dict()),
        "angelslim-ckpt": ("rank_0/rows_0-5000/data_0.ckpt", angelslim_dict()),
        "specforge-ckpt": ("rows_0-2000/data_0.ckpt", specforge_dict()),
        "specforge-dflash-ckpt": ("rows_0-2000/data_0.ckpt", {"input_ids": torch.arange(3),
                                                               "loss_mask": torch.ones(3, dtype=torch.int64),
                                                               "hidden_states": torch.zeros(1, 3, H)}),
        "speculators-legacy-pt": ("data_0.pt", legacy_dict()),
    }
    for fmt, (name, d) in cases.items():
        root = tmp_path / fmt
        save_sample(root / name, d)
        assert detect_format(root) is FORMATS[fmt]
    save_sample(tmp_path / "named-like-legacy" / "data_3.pt", modelopt_dict())  # a conversation called data_3
    assert detect_format(tmp_path / "named-like-legacy") is FORMATS["modelopt-pt"]
    write_synthetic(tmp_path / "nemo", "nemo-eagle3-cache", 3, H, K, lengths=(4, 6), seed=1)
    assert detect_format(tmp_path / "nemo") is FORMATS["nemo-eagle3-cache"]
    save_sample(tmp_path / "neither" / "data_0.ckpt", {"input_ids": torch.arange(3), "hidden": torch.zeros(3, H)})
    expect_error(lambda: detect_format(tmp_path / "neither"), tmp_path / "neither" / "data_0.ckpt",
                 "keys ('input_ids', 'hidden') match neither SpecForge EAGLE-3 ('aux_hidden_state' + "
                 "'hidden_state'), SpecForge DSpark ('hidden_states' + 'target_last_hidden_states'), SpecForge "
                 "DFlash/Domino ('hidden_states' alone) nor AngelSlim ('hidden_states' + 'target_hiddens')")


def test_modelopt_files_that_would_lose_something_are_refused(tmp_path: Path) -> None:
    f = FORMATS["modelopt-pt"]
    cases = [
        ({**modelopt_dict(), "conversation_id": "other"}, ("'conversation_id' is 'other' but the file is named "
         "conv_0.pt: Model-Optimizer names each dump <conversation_id>.pt and the store keeps the id as the file "
         "name, so the two must agree")),
        ({**modelopt_dict(), "extra": torch.zeros(2)}, ("has key(s) 'extra' that format modelopt-pt does not have; "
         "h5feed keeps every key the trainer reads and will not drop others in silence")),
        ({"input_ids": torch.arange(4), "hidden_states": torch.zeros(4, H)}, ("has neither 'aux_hidden_states' nor "
         "'hidden_state_features' (the aux layers) for format modelopt-pt (found keys: 'input_ids', 'hidden_states')")),
        ({**modelopt_dict(), "hidden_states_prenorm": "yes"}, "'hidden_states_prenorm' is a str, expected a bool"),
    ]
    for i, (d, problem) in enumerate(cases):
        root = tmp_path / str(i)
        save_sample(root / "conv_0.pt", d)
        with pytest.raises(SourceError) as info:
            f.load(f.discover(root)[0])
        assert info.value.problem == problem
    save_sample(tmp_path / "ok" / "17.pt", {**modelopt_dict(), "conversation_id": 17, "hidden_states_prenorm": True})
    sample = f.load(f.discover(tmp_path / "ok")[0])
    assert (sample.last_state_norm, sample.shape.num_aux_layers) == ("pre", K)


def test_angelslim_files_that_would_lose_something_are_refused(tmp_path: Path) -> None:
    f = FORMATS["angelslim-ckpt"]
    d = angelslim_dict()
    cases = [
        ({**d, "target_logits": torch.zeros(1, 4, 8)}, ("has key(s) 'target_logits' that format angelslim-ckpt does "
         "not have; h5feed keeps every key the trainer reads and will not drop others in silence")),
        ({**d, "input_ids": torch.arange(4)}, "'input_ids' must be [1, T] as AngelSlim writes it, got shape [4]"),
        ({**d, "position_ids": torch.zeros(2, 4, dtype=torch.int64)}, ("'position_ids' has shape [2, 4]; expected "
         "[T], [1, T], [3, T] or [3, 1, T] with T = 4")),
        ({**d, "inputs_embeds": torch.zeros(1, 3, H)}, "'inputs_embeds' has 3 tokens but 'input_ids' has 4"),
    ]
    for i, (sample, problem) in enumerate(cases):
        root = tmp_path / str(i)
        save_sample(root / "data_0.ckpt", sample)
        with pytest.raises(SourceError) as info:
            f.load(f.discover(root)[0])
        assert info.value.problem == problem


def nemo_cache(tmp_path: Path, pipeline: PipelineOptions = PipelineOptions()) -> Path:
    root = tmp_path / "nemo"
    write_synthetic(root, "nemo-eagle3-cache", 5, H, K, lengths=[4, 9, 6, 9, 3], seed=1, pipeline=pipeline)
    return root


def edit_shard(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_nemo_padding_is_dropped_only_when_nothing_in_it_is_lost(tmp_path: Path) -> None:
    root = nemo_cache(tmp_path)
    f = FORMATS["nemo-eagle3-cache"]
    shard = root / "shard-000000.safetensors"
    sample = f.load(f.discover(root)[0])  # 4 real tokens of S = 9
    assert (len(sample.input_ids), sample.last_hidden_state, sample.hidden_size) == (4, None, H)
    assert [k for k in sample.extras] == ["position_mask", "target_probs"]

    def expect(edit, problem: str) -> None:
        original = shard.read_bytes()
        edit_shard(shard, edit)
        try:
            with pytest.raises(SourceError) as info:
                f.load(f.discover(root)[0])
            assert (info.value.path, info.value.problem) == (str(shard), problem)
        finally:
            shard.write_bytes(original)

    def loss_in_padding(t: dict) -> None:
        t["loss_mask"][0, 6] = 1

    def hole(t: dict) -> None:
        t["attention_mask"][0, 1] = 0

    def wrong_pad(t: dict) -> None:
        t["input_ids"][0, 5] = 7

    expect(loss_in_padding, "sample 0's padding (rows 4 to 9) is not what NeMo's precompute writes: loss_mask is not "
           "0 there; h5feed drops padding only when nothing in it is lost")
    expect(hole, "sample 0's attention_mask is not 3 ones then zeros (the right padding NeMo's precompute writes): "
           "h5feed keeps the real tokens only and cannot tell them here")
    expect(wrong_pad, "sample 0's padding (rows 4 to 9) is not what NeMo's precompute writes: input_ids are not the "
           "pad id shifted left by one (then 0); h5feed drops padding only when nothing in it is lost")


def test_nemo_caches_that_are_incomplete_or_of_another_version_are_refused(tmp_path: Path) -> None:
    root = nemo_cache(tmp_path, PipelineOptions(shard_size=2))
    f = FORMATS["nemo-eagle3-cache"]
    assert [s.relpath for s in f.discover(root)] == ["shard-000000.safetensors#0", "shard-000000.safetensors#1",
                                                      "shard-000001.safetensors#0", "shard-000001.safetensors#1",
                                                      "shard-000002.safetensors#0"]
    (root / "shard-000001.safetensors").rename(root / "moved")
    with pytest.raises(SourceError) as info:
        f.discover(root)
    assert info.value.problem == ("manifest.json declares 5 samples in 3 shard(s) of 2, but shard-000001.safetensors "
                                  "is missing: the cache is incomplete or mixed (NeMo's reader refuses it too)")
    (root / "moved").rename(root / "shard-000001.safetensors")
    manifest = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps({**manifest, "format_version": 3}))
    f2 = type(f)()  # a fresh reader: the manifest is cached per file version
    with pytest.raises(SourceError) as info:
        f2.discover(root)
    assert info.value.problem == "format_version 3 is not a NeMo EAGLE-3 cache version h5feed reads (1, 2)"
    (root / "manifest.json").write_text(json.dumps({**manifest, "dtype": "fp16"}))
    f3 = type(f)()
    with pytest.raises(SourceError) as info:
        f3.probe(f3.discover(root)[0])
    assert info.value.problem == ("'aux_hidden_states' is [2, 9, 144] torch.bfloat16; the manifest says [2, 9, 144] "
                                  "torch.float16")


@pytest.mark.parametrize("fmt", ["speculators-legacy-pt", "speculators-v0-pt"])
def test_an_unknown_key_in_a_speculators_dict_is_refused_not_dropped(tmp_path: Path, fmt: str) -> None:
    """As in Model-Optimizer's, AngelSlim's and vLLM's files: a key the store would not keep is refused, naming it."""
    root, files = write(tmp_path, fmt)
    d = torch.load(files[0], weights_only=True)
    d["attention_mask"] = torch.ones_like(d["input_ids"])
    torch.save(d, files[0])
    f = FORMATS[fmt]
    expect_error(lambda: f.load(f.discover(root)[0]), files[0], "has key(s) 'attention_mask' that format "
                 f"{fmt} does not have; h5feed keeps every key the trainer reads and will not drop others in silence")
