"""`h5feed report`: the pages of a two-rank run with a stall and of a one-rank run, each with two DataLoader
workers counted by h5feed's counters, rendered in headless Chromium."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

import h5feed
from h5feed.metrics import LoaderCounters
from h5feed.observe.report import write_report


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


def monitored_run(folder, dataset: Timed, epochs: int) -> None:
    for _epoch in range(epochs):
        for _ in h5feed.monitor(DataLoader(dataset, num_workers=2), every=0.1, stall_after=0.4, log_dir=folder,
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
    import json

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
