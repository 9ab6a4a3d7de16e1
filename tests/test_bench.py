"""`h5feed bench` and its `.pt` baseline, on tiny synthetic sets (H=64, a handful of samples, warm only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from h5feed import bench
from h5feed.baseline import Eagle3SampleFileDataset, list_files
from h5feed.bench import LOADERS, SyntheticSpec, ensure_default_set, run_bench
from h5feed.cli import main
from h5feed.datasets import HiddenStatesDataset
from h5feed.store import Store

H, K = 64, 3
LENGTHS = (30, 60)


@pytest.fixture(scope="module")
def tiny(synthetic_store):
    return synthetic_store("bench-tiny", "speculators-legacy-pt", 5, H, LENGTHS, chunk_tokens=16)


def test_baseline_items_equal_h5feed_items(tiny) -> None:
    """The baseline is speculators 0.4's item: the same tensors as the speculators-legacy flavor, key for key."""
    baseline = Eagle3SampleFileDataset(2048, file_list=tiny.files, hidden_states_dtype=torch.bfloat16)
    ours = HiddenStatesDataset(tiny.path, "speculators-legacy", max_len=None, hidden_states_dtype=torch.bfloat16)
    assert baseline.approx_lengths == tiny.lengths  # from sample_lengths.json, as 0.4 does
    assert sorted(map(str, list_files(tiny.src))) == sorted(map(str, tiny.files))
    for i in range(len(tiny.files)):
        want, got = baseline[i], ours[i]
        assert list(want) == list(got)
        for key in want:
            assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key
    with pytest.raises(ValueError):
        Eagle3SampleFileDataset(2048, datapath=tiny.src, file_list=tiny.files)


def test_run_bench_every_loader_exact_counts(tiny) -> None:
    result = run_bench(tiny.path, workers=2, cold=False, progress=False)
    assert [p.loader for p in result.passes] == list(LOADERS)
    assert all(p.cache == "warm" for p in result.passes) and not result.cold
    n = len(tiny.files)
    tokens = sum(t - 1 for t in tiny.lengths)  # shifted items, none longer than max_len
    base = result.get("pt-baseline", "warm")
    assert base is not None and base.ratio == pytest.approx(1.0)
    assert base.bytes_read == sum(f.stat().st_size for f in tiny.files)
    for p in result.passes:
        assert p.samples == n and p.tokens == tokens
        assert p.hidden_bytes == tokens * (K + 1) * H * 2  # bfloat16
        assert p.samples_per_s == pytest.approx(n / p.seconds)
        assert p.ratio == pytest.approx(p.samples_per_s / base.samples_per_s)
        assert p.peak_memory_bytes > 0 and p.memory_metric in ("pss", "rss")
        processes = 1 if p.loader == "HiddenStatesStream-threads" else 2  # threads in the trainer's process
        assert sum(w.samples for w in p.workers) == n and len(p.workers) == processes
        assert p.bytes_read > 0
    assert len({p.check for p in result.passes}) == 1  # the same elements arrived from every loader
    assert not any("differ" in note for note in result.notes)
    assert "HiddenStatesStream" in result.table()


def test_cli_json(tiny, capsys) -> None:
    rc = main(["-q", "bench", str(tiny.path), "--workers", "2", "--no-cold", "--json",
               "--loaders", "pt-baseline,HiddenStatesDataset"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_samples"] == len(tiny.files) and out["workers"] == 2
    assert [(p["loader"], p["cache"]) for p in out["passes"]] == [("pt-baseline", "warm"),
                                                                  ("HiddenStatesDataset", "warm")]
    assert out["passes"][1]["ratio"] == pytest.approx(out["passes"][1]["samples_per_s"] /
                                                      out["passes"][0]["samples_per_s"])


def test_cold_impossible_says_so(tiny, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(bench.synthetic_set, "DROP_CACHES", tmp_path)  # a folder: opening it for writing fails
    result = run_bench(tiny.path, workers=0, cold=True, loaders=["HiddenStatesDataset"], progress=False)
    assert not result.cold and [p.cache for p in result.passes] == ["warm"]
    assert any("cannot drop the page cache" in note for note in result.notes)


def test_non_pt_store_benches_h5feed_alone(synthetic_store) -> None:
    ckpt = synthetic_store("bench-ckpt", "specforge-ckpt", 3, H, LENGTHS, chunk_tokens=16)
    result = run_bench(ckpt.path, workers=0, cold=False, loaders=["pt-baseline", "HiddenStatesDataset"],
                       progress=False)
    assert [p.loader for p in result.passes] == ["HiddenStatesDataset"] and result.flavor == "specforge"
    assert any("no baseline" in note and "specforge-ckpt" in note for note in result.notes)
    assert result.passes[0].samples == 3 and result.passes[0].ratio is None


def test_default_set_built_once_and_rebuilt_when_incomplete(tmp_path: Path) -> None:
    spec = SyntheticSpec(num_samples=3, hidden_size=32, tokens=(20, 30))
    store = ensure_default_set(tmp_path, spec, convert_workers=0, progress=False)
    marker = store.parent / "src-complete.json"
    stamp = (marker.stat().st_mtime_ns, (store / "zarr.json").stat().st_mtime_ns)
    assert ensure_default_set(tmp_path, spec, convert_workers=0, progress=False) == store
    assert (marker.stat().st_mtime_ns, (store / "zarr.json").stat().st_mtime_ns) == stamp  # reused
    victim = next((store.parent / "src").glob("data_*.pt"))
    os.truncate(victim, 10)  # an interrupted write
    assert ensure_default_set(tmp_path, spec, convert_workers=0, progress=False) == store
    assert victim.stat().st_size > 10 and marker.stat().st_mtime_ns != stamp[0]
    assert len(Store(store)) == 3
