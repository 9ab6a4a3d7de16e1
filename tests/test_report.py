"""`h5feed report`: the page of a two-rank run, with a stall, rendered in headless Chromium."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import h5feed
from h5feed.observe.report import write_report


class Timed(Dataset):
    """Samples that take `delay` seconds each, and sample `slow_at` `slow` seconds (a stall)."""

    def __init__(self, n: int, delay: float, slow_at: int | None = None, slow: float = 0.0) -> None:
        self.n, self.delay, self.slow_at, self.slow = n, delay, slow_at, slow

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.slow if i == self.slow_at else self.delay)
        return torch.zeros(1000)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", "2")
        for rank, dataset in ((0, Timed(20, 0.01)), (1, Timed(20, 0.03, slow_at=10, slow=0.8))):
            mp.setenv("RANK", str(rank))
            for _epoch in range(2):
                monitored = h5feed.monitor(DataLoader(dataset), every=0.1, stall_after=0.4, log_dir=folder,
                                           name="report")
                for _ in monitored:
                    time.sleep(0.005)
    return folder


def test_the_report_sums_up_the_run_and_draws_it(two_rank_run, tmp_path, cli):
    page, png = tmp_path / "run.html", tmp_path / "run.png"
    result = cli("report", two_rank_run, "-o", page, "--png", png)
    assert result.status == 0, result.output
    text = page.read_text()
    assert "report rank 0: 40 steps over 2 epoch(s), finished; the step waited for data " in text
    assert "report rank 1: 40 steps over 2 epoch(s), finished" in text
    assert "slowest rank: rank 1, " in text  # its samples take three times as long
    assert "stall report(s): rank 1 at step " in text and "rank 0 at step" not in text
    assert text.count("<tr><td>") == 4  # each rank's two passes
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_renders_in_headless_chromium_with_its_plots(two_rank_run, tmp_path, chromium):
    from PIL import Image

    page = write_report(two_rank_run, tmp_path / "run.html")
    dom = chromium("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr
    assert 'data-plot-width="990"' in dom.stdout  # the embedded plots decoded: 11 in at 90 dpi
    assert "slowest rank: rank 1" in dom.stdout
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
    assert len(stalls) == 2  # the slow sample, once in each epoch
    for stall in stalls:
        shown = f"the trainer has waited {stall['waiting(s)']:.1f} s for batch 11"
        assert stall["message"].startswith(shown) and stall["waiting(s)"] >= 0.4  # not "0 s"
