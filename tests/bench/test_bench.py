"""`h5feed bench` and its `.pt` baseline, on tiny synthetic sets (H=64, a handful of samples, warm only).

No timings are asserted: the loaders' batches, the counts and the report's shape are."""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from h5feed import bench
from h5feed.bench import LOADER_LABELS, LOADERS, Passes, SyntheticSpec, ensure_default_set, run_bench
from h5feed.bench.loaders import BASELINE, GPU_DECODE, ITEMS, SHORT_LABELS, USABLE, compare_digests, digest
from h5feed.bench.report import TABLE_COLUMNS
from h5feed.cli import main
from h5feed.gpu import why_unavailable
from h5feed.loading.datasets import HiddenStatesDataset
from h5feed.store import Store
from h5feed.testing.baseline import Eagle3SampleFileDataset, list_files
from h5feed.testing.synthetic import write_synthetic

MEASURED = tuple(n for n in LOADERS if n != GPU_DECODE or why_unavailable() is None)  # on this machine

H, K = 64, 3
LENGTHS = (30, 60)
MAX_LEN = 48  # shorter than some samples: the collate cuts them


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


def test_every_loader_delivers_the_baselines_batches_and_the_report_says_so(tiny) -> None:
    """max_len 48 cuts the longer samples: every loader must cut them as speculators 0.4's collate does."""
    result = run_bench(tiny.path, workers=2, max_len=MAX_LEN, passes=Passes(LOADERS, cold=False), progress=False,
                       step=None)
    assert [(p.loader, p.cache) for p in result.passes] == [(name, "warm") for name in MEASURED]
    assert not result.cold and result.collate == f"speculators 0.4 create_collate_fn({MAX_LEN})"
    assert result.checks == {name: "reference" if name == BASELINE else "equal" for name in MEASURED}
    n, row_bytes = len(tiny.files), (K + 1) * H * 2  # bfloat16 hidden_states (K layers) + verifier state
    base = result.get(BASELINE, "warm")
    assert base is not None and base.ratio == pytest.approx(1.0)
    assert base.bytes_read == sum(f.stat().st_size for f in tiny.files)
    for p in result.passes:
        assert p.samples == n and p.samples_per_s == pytest.approx(n / p.seconds)
        if p.loader == ITEMS:  # items, not batches: the rows read, no padding, and no ratio to the batches' baseline
            assert p.hidden_bytes == sum(min(t - 1, MAX_LEN) for t in tiny.lengths) * row_bytes
            assert p.ratio is None
        else:  # one [1, max_len, ...] batch per sample
            assert p.hidden_bytes == n * MAX_LEN * row_bytes
            assert p.ratio == pytest.approx(p.samples_per_s / base.samples_per_s)
        processes = 1 if p.loader in ("BatchLoader-threads", GPU_DECODE) else 2  # threads count as one worker
        assert sum(w.samples for w in p.workers) == n and len(p.workers) == processes
        assert p.bytes_read > 0 and p.cpu_seconds > 0
        assert p.peak_memory_bytes > 0 and p.memory_metric in ("pss", "rss")
    assert not any("DIFFER" in note for note in result.notes)
    if GPU_DECODE not in MEASURED:  # no CUDA or nvCOMP here: said so
        assert f'BatchLoader(decode="cuda") not measured: {why_unavailable()}' in result.notes

    rows, columns = result.rows(verbose=True), result.columns(verbose=True)
    assert columns == tuple(c for c in TABLE_COLUMNS if c not in ("of step alone", "running", "step x alone"))  # no step ran
    assert rows[0] == [c if c != "peak mem" else f"peak mem ({result.memory_metric.upper()})" for c in columns]
    assert [(r[0], r[1]) for r in rows[1:]] == [(LOADER_LABELS[name], "warm") for name in MEASURED]
    assert [r[columns.index("batches")] for r in rows[1:]] == ["reference"] + ["equal"] * (len(MEASURED) - 1)
    assert rows[1][columns.index("x baseline")] == "1.00x"
    assert rows[-1][columns.index("x baseline")] == "-"
    short = result.rows()
    assert short[0][:5] == ["loader", "cache", "samples/s", "x baseline", "CPU s/sample"]
    assert [r[0] for r in short[1:]] == [SHORT_LABELS[name] for name in MEASURED]
    table = result.table()
    assert all(f"{SHORT_LABELS[name]} = {LOADER_LABELS[name]}" in table for name in MEASURED) and "load average" in table
    code = "To use it: "
    assert max(len(line) for line in table.splitlines() if not line.startswith(code)) <= 120
    assert "per-worker samples/s" not in table and "per-worker samples/s" in result.table(verbose=True)
    usable = [p for p in result.passes if p.loader not in (BASELINE, ITEMS)]
    best = max(usable, key=lambda p: p.ratio)  # one cache state: the best ratio
    assert result.fastest() == best.loader
    equals = [p.loader for p in usable if p is not best and p.ratio >= best.ratio * 0.95]  # within the noise
    assert result.ranking() == (best.loader, equals)
    advice = table.split("\n\nFastest here: ", 1)[1].splitlines()
    assert advice == [
        (f"{SHORT_LABELS[best.loader]}: {best.ratio:.2f}x the .pt loader warm, "
         f"{best.cpu_per_sample:.3f} CPU s/sample (the .pt loader: {base.cpu_per_sample:.3f})."),
        *([f"As good within the noise: {', '.join(SHORT_LABELS[name] for name in equals)} (within 5%, the "
           "run-to-run noise of a busy machine)."] if equals else []),
        code + USABLE[best.loader].format(flavor="speculators-legacy", max_len=MAX_LEN, workers=2, dtype="bfloat16", device=""),
    ]
    assert "target" not in table and " met" not in table


def test_a_loader_with_other_batches_is_caught(synthetic_store, tmp_path) -> None:
    """A source file changed after conversion: the baseline reads it, h5feed the store; batch 2 differs."""
    altered = synthetic_store("bench-altered", "speculators-legacy-pt", 4, H, LENGTHS, chunk_tokens=16)
    other = write_synthetic(tmp_path / "other", "speculators-legacy-pt", 4, H, lengths=LENGTHS, seed=7)
    shutil.copyfile(other[2], altered.files[2])
    result = run_bench(altered.path, workers=0, max_len=MAX_LEN,
                       passes=Passes([BASELINE, "BatchLoader-threads", ITEMS], cold=False), progress=False)
    assert result.checks[BASELINE] == "reference"
    assert result.checks["BatchLoader-threads"].startswith("DIFFER: batch 2 (")
    assert "hidden_states" in result.checks["BatchLoader-threads"]
    assert result.checks[ITEMS] == result.checks["BatchLoader-threads"]
    assert any(note.startswith("BATCHES DIFFER") for note in result.notes)
    assert result.fastest() is None  # a loader whose batches differ is never the advice


def test_digests_compare_batch_for_batch() -> None:
    batch = {"hidden_states": torch.arange(12, dtype=torch.bfloat16).view(1, 3, 4),
             "lengths": torch.tensor([3]), "records": ["a"]}
    changed = {**batch, "hidden_states": batch["hidden_states"].clone()}
    changed["hidden_states"][0, 2, 3] = 0
    assert compare_digests([digest(batch)], [digest({**batch})]) == "equal"
    assert compare_digests([digest(batch), digest(changed)], [digest(batch), digest(batch)]) == \
        "DIFFER: batch 1 (hidden_states)"
    assert compare_digests([digest(batch)], [digest(batch)] * 2) == "DIFFER: 1 batches, not 2"
    assert compare_digests([digest({**batch, "lengths": torch.tensor([3], dtype=torch.int32)})],
                           [digest(batch)]) == "DIFFER: batch 0 (lengths)"  # same value, other dtype


def test_cli_json(tiny, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: only --html needs it
    rc = main(["-q", "bench", str(tiny.path), "--workers", "2", "--max-len", str(MAX_LEN), "--no-cold", "--json",
               "--loaders", "pt-baseline,BatchLoader-threads"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_samples"] == len(tiny.files) and out["workers"] == 2 and out["max_len"] == MAX_LEN
    assert [(p["loader"], p["cache"]) for p in out["passes"]] == [("pt-baseline", "warm"),
                                                                  ("BatchLoader-threads", "warm")]
    assert out["checks"] == {"pt-baseline": "reference", "BatchLoader-threads": "equal"}
    assert out["passes"][1]["ratio"] == pytest.approx(out["passes"][1]["samples_per_s"] /
                                                      out["passes"][0]["samples_per_s"])
    assert out["machine"]["load_average"].keys() == {"start", "end"}


HTML_LOADERS = (BASELINE, "BatchLoader-threads", "StreamLoader")


@pytest.fixture(scope="module")
def html_bench(tiny, tmp_path_factory):
    """`h5feed bench --html PAGE` on the tiny store: the page, and the result it was made from (run_bench spied on)."""
    page = tmp_path_factory.mktemp("bench-html") / "bench.html"
    results = []

    def spy(*args, **kwargs):
        results.append(run_bench(*args, **kwargs))
        return results[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench.cli, "run_bench", spy)
        rc = main(["-q", "bench", str(tiny.path), "--workers", "2", "--max-len", str(MAX_LEN), "--no-cold",
                   "--loaders", ",".join(HTML_LOADERS), "--html", str(page), "--step", "none"])
    assert rc == 0 and len(results) == 1
    return page, results[0]


def test_html_page_holds_the_settings_the_advice_every_column_and_the_plots(html_bench) -> None:
    from PIL import Image

    page, result = html_bench
    text = page.read_text()
    passes = re.search(r'<table id="passes">(.*?)</table>', text, re.DOTALL).group(1)
    cells = [[html.unescape(c) for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row)]
             for row in re.findall(r"<tr>(.*?)</tr>", passes)]
    assert cells == result.rows(verbose=True)  # every pass, every column, its figures as the table prints them
    assert [row[0] for row in cells[1:]] == [LOADER_LABELS[name] for name in HTML_LOADERS]
    advice = result.recommendation()
    assert advice.startswith("Fastest here: ") and f'<pre id="recommendation">{html.escape(advice)}</pre>' in text
    assert all(html.escape(line) in text for line in [*result.settings_lines(), *result.notes])
    assert f"H={H}, K={K}" in text and f"max_len={MAX_LEN}" in text and "cores" in text
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert len(images) == 1
    png = base64.b64decode(images[0])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert Image.open(io.BytesIO(png)).size[0] == 990  # it decodes: 11 in at 90 dpi


def test_html_page_renders_in_headless_chromium(html_bench, chromium) -> None:
    page, _ = html_bench
    dom = chromium("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr
    assert 'data-plot-width="990"' in dom.stdout  # the browser decoded the embedded plots
    assert all(html.escape(LOADER_LABELS[name]) in dom.stdout for name in HTML_LOADERS)


def test_html_fails_before_the_bench_without_matplotlib_or_a_folder_for_the_page(tiny, tmp_path, monkeypatch,
                                                                                 cli) -> None:
    monkeypatch.setattr(bench.cli, "run_bench", lambda *args, **kwargs: pytest.fail("the bench ran"))
    nowhere = tmp_path / "nowhere" / "bench.html"
    r = cli("bench", tiny.path, "--html", nowhere)
    assert r.status == 1 and f"h5feed bench: error: {nowhere}: no folder {nowhere.parent} to write the page in" \
        in r.output
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: `import matplotlib` fails
    page = tmp_path / "bench.html"
    r = cli("bench", tiny.path, "--html", page)
    assert r.status == 1 and not page.exists()
    assert ("h5feed bench: error: h5feed bench --html draws its plots with matplotlib: "
            "pip install 'h5feed[report]'") in r.output


def test_an_unknown_loader_is_refused_when_the_passes_are_made() -> None:
    with pytest.raises(ValueError) as info:
        Passes(["BatchLoader-threads", "DataLoader-fast"])
    assert str(info.value) == f"unknown loader(s) ['DataLoader-fast']: choose from {', '.join(LOADERS)}"


def test_max_len_must_be_given(tiny, capsys) -> None:
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        run_bench(tiny.path, max_len=0, passes=Passes(cold=False), progress=False)
    with pytest.raises(SystemExit):
        main(["-q", "bench", str(tiny.path), "--max-len", "0"])
    assert "--max-len: must be >= 1, not 0" in capsys.readouterr().err


def test_cold_impossible_says_so(tiny, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(bench.synthetic_set, "DROP_CACHES", tmp_path)  # a folder: opening it for writing fails
    result = run_bench(tiny.path, workers=0, passes=Passes(["BatchLoader-threads"], cold=True), progress=False)
    assert not result.cold and [p.cache for p in result.passes] == ["warm"]
    assert any("cannot drop the page cache" in note for note in result.notes)


def test_non_pt_store_benches_h5feed_alone(synthetic_store) -> None:
    """No baseline for a SpecForge store: h5feed's loaders run SpecForge's collate, the first is the reference."""
    ckpt = synthetic_store("bench-ckpt", "specforge-ckpt", 3, H, LENGTHS, chunk_tokens=16)
    result = run_bench(ckpt.path, workers=0, max_len=MAX_LEN,
                       passes=Passes([BASELINE, "BatchLoader-threads", "StreamLoader"], cold=False), progress=False)
    assert [p.loader for p in result.passes] == ["BatchLoader-threads", "StreamLoader"]
    assert result.flavor == "specforge" and result.collate == f"h5feed.trainer_collate('specforge')({MAX_LEN})"
    assert result.checks == {"BatchLoader-threads": "reference", "StreamLoader": "equal"}
    assert any("no baseline" in note and "specforge-ckpt" in note for note in result.notes)
    assert all(p.samples == 3 and p.ratio is None for p in result.passes)
    assert result.fastest() is None and "Fastest here" not in result.table()  # no baseline, no ratio: no advice
    assert '<pre id="recommendation">No advice: it needs the .pt baseline measured' in result.html(b"")


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


def test_the_default_set_says_its_cost_first_and_where_it_stays_last(tmp_path, capsys, monkeypatch) -> None:
    """Building the set is said before it starts (gigabytes, minutes); the end says where it stays and how to
    remove it; --no-keep-cache removes it instead."""
    @dataclasses.dataclass(frozen=True)
    class TinySpec(SyntheticSpec):  # the CLI's set at a test's size
        hidden_size: int = 32
        tokens: tuple[int, int] = (20, 30)

    monkeypatch.setattr(bench.cli, "SyntheticSpec", TinySpec)
    folder = tmp_path / TinySpec(num_samples=3).name
    args = ["bench", "--cache-dir", str(tmp_path), "--num-samples", "3", "--workers", "1", "--max-len", str(MAX_LEN),
            "--no-cold", "--loaders", f"{BASELINE},BatchLoader-threads", "--step", "none"]
    assert main(args) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("[h5feed bench] ")]
    assert said[0].startswith(f"[h5feed bench] building the bench set once, in {folder}: 3 synthetic ")
    assert said[0].endswith(f"This takes a few minutes on a machine of few cores; later runs reuse both (remove "
                            f"them with `rm -rf {folder}`)")
    assert re.fullmatch(rf"\[h5feed bench\] the bench set and its store \([\d.]+ GB\) stay in {re.escape(str(folder))} "
                        rf"for the next run; remove them with `rm -rf {re.escape(str(folder))}`, or run with "
                        r"--no-keep-cache", said[-1]), said[-1]
    assert (folder / "store" / "zarr.json").is_file()
    assert main([*args, "--no-keep-cache"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[h5feed bench] ")]
    assert not any("building" in line for line in said)  # reused
    assert said[-1] == f"[h5feed bench] removed the bench set {folder} (--no-keep-cache)"
    assert not folder.exists()
