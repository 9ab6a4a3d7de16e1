"""`h5feed report`: the pages of a two-rank run with a stall and of a one-rank run, each with two DataLoader
workers counted by h5feed's counters, rendered in headless Chromium."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

import h5feed
from h5feed.observe.metrics import LoaderCounters
from h5feed.observe.report import plot_figure, write_report
from h5feed.observe.tracks import load_runs
from h5feed.observe.watch import frame


class Timed(Dataset):
    """Samples that take `delay` seconds each (`worker_delay` in DataLoader worker 1), and sample `slow_at`
    `slow` seconds (a stall); counted in h5feed's shared counters, as its datasets do."""

    def __init__(self, n: int, delay: float, slow_at: int | None = None, slow: float = 0.0,
                 worker_delay: float | None = None) -> None:
        self.n, self.delay, self.slow_at, self.slow = n, delay, slow_at, slow
        self.worker_delay = delay if worker_delay is None else worker_delay
        self.counters = LoaderCounters()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        delay = self.worker_delay if info is not None and info.id == 1 else self.delay
        counters = self.counters.worker()
        counters.begin_sample(i)
        time.sleep(self.slow if i == self.slow_at else delay)
        counters.add_read(1_000_000, delay)
        counters.end_sample(i, 100)
        return torch.zeros(1000)


def monitored_run(folder, dataset: Timed, epochs: int, every: float = 0.1) -> None:
    for _epoch in range(epochs):
        for _ in h5feed.monitor(DataLoader(dataset, num_workers=2), every=every, stall_after=0.4, log_dir=folder,
                                name="report"):
            time.sleep(0.005)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", "2")
        for rank, dataset in ((0, Timed(20, 0.01)), (1, Timed(20, 0.03, slow_at=10, slow=0.8, worker_delay=0.06))):
            mp.setenv("RANK", str(rank))
            monitored_run(folder, dataset, epochs=2)
    return folder


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one")
    monitored_run(folder, Timed(24, 0.02, worker_delay=0.08), epochs=1)
    return folder


def page_rows(text: str, element_id: str) -> list[list[str]]:
    """The cells of the page's table `element_id`, header first."""
    found = re.search(rf'<table id="{element_id}">(.*?)</table>', text, re.DOTALL)
    assert found is not None, f"no table {element_id}"
    return [re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row) for row in re.findall(r"<tr>(.*?)</tr>", found.group(1))]


def worker_pixels(png: Path) -> int:
    """Pixels of matplotlib's first two line colours (C0 blue, C1 orange) in the bottom third of the plots:
    the per-worker panel, whose lines these are (its message when no worker was counted is black)."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(png).convert("RGB"), dtype=np.int32)
    panel = pixels[2 * pixels.shape[0] // 3:]
    colours = np.array([(0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)])
    distance = np.abs(panel[:, :, None, :] - colours[None, None]).sum(axis=-1)
    return int((distance.min(axis=-1) < 60).sum())


def test_the_report_sums_up_the_run_and_draws_it(two_rank_run, tmp_path, cli):
    page, png = tmp_path / "run.html", tmp_path / "run.png"
    result = cli("report", two_rank_run, "-o", page, "--png", png)
    assert result.status == 0, result.output
    text = page.read_text()
    assert "report rank 0: 40 steps over 2 epoch(s), finished; the trainer waited for data " in text
    assert "report rank 1: 40 steps over 2 epoch(s), finished" in text
    assert "slowest rank: rank 1, " in text  # its samples take three times as long
    assert "stall report(s): rank 1 at step " in text and "rank 0 at step" not in text
    assert len(page_rows(text, "passes")) == 1 + 4  # each rank's two passes
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    workers = page_rows(text, "workers")
    assert workers[0] == ["rank", "worker", "samples", "samples/s", "s reading per sample", "read MB/s"]
    assert [row[:2] for row in workers[1:]] == [["0", "0"], ["0", "1"], ["1", "0"], ["1", "1"]]
    assert "slowest worker: rank 1 worker 1, " in text  # its samples take twice as long as its rank's others
    assert worker_pixels(png) > 30  # lines in the worker panel (51-225 pixels as timing goes; none drawn: < 10)


def test_the_report_of_one_rank_draws_its_workers_and_names_the_slowest(one_rank_run, tmp_path, cli):
    page, png = tmp_path / "one.html", tmp_path / "one.png"
    assert cli("report", one_rank_run, "-o", page, "--png", png).status == 0
    text = page.read_text()
    assert "report rank 0: 24 steps over 1 epoch(s), finished" in text and "slowest rank" not in text
    assert "slowest worker: rank 0 worker 1, " in text
    workers = page_rows(text, "workers")
    assert [row[:2] for row in workers[1:]] == [["0", "0"], ["0", "1"]]
    assert float(workers[1][4]) == pytest.approx(0.02, abs=0.005)  # each worker's own pace
    assert float(workers[2][4]) == pytest.approx(0.08, abs=0.01)
    assert worker_pixels(png) > 30  # as above


def test_a_run_without_h5feed_counters_has_no_worker_table_and_says_so_in_its_plot(tmp_path, cli):
    for _ in h5feed.monitor(DataLoader(list(range(6))), every=0.01, log_dir=tmp_path, name="plain"):
        time.sleep(0.01)
    page, png = tmp_path / "plain.html", tmp_path / "plain.png"
    assert cli("report", tmp_path, "-o", page, "--png", png).status == 0
    assert 'id="workers"' not in page.read_text() and worker_pixels(png) < 10


@pytest.mark.parametrize(("run", "named"), [("two_rank_run", "slowest rank: rank 1"),
                                            ("one_rank_run", "slowest worker: rank 0 worker 1")])
def test_the_report_renders_in_headless_chromium_with_its_plots(run, named, tmp_path, chromium, request):
    from PIL import Image

    page = write_report(request.getfixturevalue(run), tmp_path / "run.html")
    dom = chromium("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr
    assert 'data-plot-width="990"' in dom.stdout  # the embedded plots decoded: 11 in at 90 dpi
    assert named in dom.stdout and '<table id="workers">' in dom.stdout
    shot = tmp_path / "shot.png"
    taken = chromium(f"--screenshot={shot}", "--window-size=1200,1400", page.as_uri())
    assert taken.returncode == 0, taken.stderr
    image = Image.open(shot).convert("L")
    assert image.size == (1200, 1400)
    low, high = image.getextrema()
    assert high - low > 100  # text and plot lines on the page, not a blank screen
    histogram = image.histogram()
    assert sum(histogram[:200]) > 0.01 * image.size[0] * image.size[1]  # plenty of drawn (non-white) pixels


def test_a_folder_without_runs_is_one_clear_error(tmp_path, cli):
    result = cli("report", tmp_path)
    assert result.status == 1
    assert f"{tmp_path}: no h5feed-monitor*.jsonl with records here or in its sub-folders" in result.output


def test_a_stall_names_how_long_the_trainer_waited_to_a_tenth_of_a_second(two_rank_run):
    stalls = [json.loads(line) for line in (two_rank_run / "h5feed-monitor-report-rank1.jsonl").read_text().splitlines()
              if '"kind": "stall"' in line]
    assert {stall["epoch"] for stall in stalls} == {0, 1}  # the slow sample, in each epoch
    for epoch in (0, 1):  # the other worker reads on, then its queue is full: a bottleneck, then stuck
        verdicts = [stall["verdict"] for stall in stalls if stall["epoch"] == epoch]
        assert verdicts in (["bottleneck", "stuck"], ["stuck"])
    for stall in stalls:
        shown = f"the trainer has waited {stall['waiting(s)']:.1f} s for batch 11"
        assert shown in stall["message"] and stall["waiting(s)"] >= 0.4  # not "0 s"


def test_the_monitors_last_line_names_the_slowest_worker_by_its_own_pace(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="h5feed")
    monitored_run(tmp_path, Timed(10, 0.01, worker_delay=0.05), epochs=1)
    [line] = [r.getMessage() for r in caplog.records if "batches in" in r.getMessage()]
    pace = re.search(r"slowest worker: worker 1, ([0-9.]+) s reading per sample \(the fastest: ([0-9.]+) s\)", line)
    assert pace is not None, line
    assert float(pace.group(1)) == pytest.approx(0.05, abs=0.005)
    assert float(pace.group(2)) == pytest.approx(0.01, abs=0.005)


# --------------------------------------------------------------------------- the report as the run's record

PASSES, PER_PASS = 4, 12  # passes far shorter than the monitor's `every`


@pytest.fixture(scope="module")
def short_passes(tmp_path_factory):
    """A run of PASSES passes, each over in a fraction of `every`: the monitor writes no periodic record, only
    each pass's last window and its end."""
    folder = tmp_path_factory.mktemp("short")
    monitored_run(folder, Timed(PER_PASS, 0.01), epochs=PASSES, every=30.0)
    return folder


def log_records(folder: Path, name: str = "report") -> list[dict]:
    return [json.loads(line) for line in (folder / f"h5feed-monitor-{name}.jsonl").read_text().splitlines()]


def write_records(folder: Path, records: list[dict], name: str = "report") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"h5feed-monitor-{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def drawn(folder: Path):
    """The figure of the folder's one run and attempt, and its data-wait axes."""
    [run], _ = load_runs(folder)
    [attempt] = run.attempts
    fig = plot_figure(attempt)
    return attempt, fig, next(ax for ax in fig.axes if ax.get_ylabel().startswith("data wait"))


def by_gid(ax, gid: str) -> list:
    return [a for a in ax.get_children() if a.get_gid() == gid]


def check_every_pass_drawn(folder: Path, ends: list[dict]) -> None:
    attempt, fig, ax = drawn(folder)
    t0 = attempt.began
    assert ax.get_ylim()[0] == 0  # the data wait is drawn from 0, never a small range blown up
    marks = by_gid(ax, "pass")
    assert len(marks) == PASSES  # each pass's start marked on the time axis
    spans = [seg for c in by_gid(ax, "pass figures") for seg in c.get_segments()]
    assert len(spans) == PASSES  # each pass's own data wait drawn over its time
    assert [seg[1][0] for seg in spans] == pytest.approx([e["time"] - t0 for e in ends])  # to each pass's end
    assert [seg[0][1] for seg in spans] == pytest.approx([e["data_loading(%)"] for e in ends])
    [line] = [line for line in ax.get_lines() if line.get_gid() == "windows"]
    assert max(line.get_xdata()) == pytest.approx(ends[-1]["time"] - t0, abs=0.05)  # drawn to the run's end
    assert len(line.get_xdata()) >= PASSES  # a point per pass at least
    assert ax.get_xlim()[0] == 0 and ax.get_xlim()[1] >= ends[-1]["time"] - t0
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_a_run_of_passes_shorter_than_every_is_drawn_and_counted_whole(short_passes, tmp_path):
    ends = [r for r in log_records(short_passes) if r["kind"] == "end"]
    assert len(ends) == PASSES
    check_every_pass_drawn(short_passes, ends)
    text = write_report(short_passes, tmp_path / "page.html").read_text()
    passes = page_rows(text, "passes")
    assert len(passes) == 1 + PASSES and all(row[-1] == "finished" for row in passes[1:])
    workers = page_rows(text, "workers")
    read = {row[1]: int(row[2]) for row in workers[1:]}
    assert read == {str(w["worker"]): w["samples"] for w in ends[-1]["workers"]}  # what watch shows at the end
    assert sum(read.values()) == PASSES * PER_PASS
    assert f"report rank 0: {PASSES * PER_PASS} steps over {PASSES} epoch(s), finished" in text


def test_a_log_with_no_window_records_is_drawn_from_its_ends(short_passes, tmp_path):
    """A monitor that wrote no record of a pass but its start and end (as one did before it wrote each pass's
    last window): the report still draws and counts every pass from its end."""
    records = [r for r in log_records(short_passes) if r["kind"] != "report"]
    folder = tmp_path / "ends-only"
    write_records(folder, records)
    ends = [r for r in records if r["kind"] == "end"]
    check_every_pass_drawn(folder, ends)
    text = write_report(folder, tmp_path / "page.html").read_text()
    read = {row[1]: int(row[2]) for row in page_rows(text, "workers")[1:]}
    assert sum(read.values()) == PASSES * PER_PASS


def test_the_page_of_short_passes_renders_every_pass_in_headless_chromium(short_passes, tmp_path, chromium):
    page = write_report(short_passes, tmp_path / "run.html")
    dom = chromium("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr
    assert 'data-plot-width="990"' in dom.stdout
    assert len(page_rows(dom.stdout, "passes")) == 1 + PASSES
    assert sum(int(row[2]) for row in page_rows(dom.stdout, "workers")[1:]) == PASSES * PER_PASS


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A parent folder of two runs of two ranks each, of the same name, in their own log_dirs."""
    parent = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", "2")
        for run, epochs in (("a", 1), ("b", 2)):
            for rank in (0, 1):
                mp.setenv("RANK", str(rank))
                monitored_run(parent / run, Timed(6, 0.005), epochs=epochs)
    return parent


def test_a_parent_folder_of_two_runs_keeps_them_apart_in_watch_and_report(two_runs, tmp_path):
    shown = frame(two_runs)
    assert shown.count("== report") == 2 and shown.count("(2 of 2 ranks;") == 2, shown
    runs, _ = load_runs(two_runs)
    assert [len(run.attempts) for run in runs] == [1, 1]
    text = write_report(two_runs, tmp_path / "page.html").read_text()
    assert text.count('<h2 id="run-') == 2  # a section per run, each linked from the contents
    assert 'href="#run-1"' in text and 'href="#run-2"' in text
    assert len(page_rows(text, "passes-1")) == 1 + 2 and len(page_rows(text, "passes-2")) == 1 + 4
    assert "report rank 0: 6 steps over 1 epoch(s), finished" in text
    assert "report rank 0: 12 steps over 2 epoch(s), finished" in text
    assert text.count("slowest rank:") <= 2  # named within each run, never across them


def restarted(lines: list[dict], pid: int | None) -> list[dict]:
    """The records of the same script run twice into one log_dir: the second process's are later, its epochs
    and steps counted from 0 again, and its pid `pid` (None: the first one's, as in a container)."""
    shift = lines[-1]["time"] - lines[0]["time"] + 5.0
    again = []
    for rec in lines:
        rec = {**rec, "time": rec["time"] + shift}
        if rec["kind"] == "start" and pid is not None:
            rec["pid"] = pid
        again.append(rec)
    return lines + again


@pytest.mark.parametrize("pid", [424242, None])
def test_a_run_restarted_into_its_log_dir_is_shown_as_two_attempts(short_passes, tmp_path, pid, cli):
    folder = tmp_path / "again"
    write_records(folder, restarted(log_records(short_passes), pid))
    [run], _ = load_runs(folder)
    assert len(run.attempts) == 2
    text = write_report(folder, tmp_path / "page.html").read_text()
    assert text.count(f"report rank 0: {PASSES * PER_PASS} steps over {PASSES} epoch(s), finished") == 2
    assert "attempt 1 of 2" in text and "attempt 2 of 2" in text
    assert len(page_rows(text, "passes-1")) == len(page_rows(text, "passes-2")) == 1 + PASSES
    assert "finished" in cli("watch", folder, "--once").output
