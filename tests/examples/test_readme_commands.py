"""The README's Quickstart runs as written: its shell commands and its Python block, read from README.md itself (so
that the test fails when the README drifts), on a small synthetic set made here in the place of `/data`.

The README's first two commands (install and `h5feed bench`, install and the tests) are run as written by
.ci/run, which reads them from README.md the same way.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from h5feed.store import Store
from h5feed.testing.synthetic import write_synthetic

SAMPLES = 8


def readme_blocks(section: str) -> dict[str, list[str]]:
    """The fenced code blocks of README.md's `## {section}`, by language, in order."""
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    blocks: dict[str, list[str]] = {}
    for language, body in re.findall(r"^```(\w+)\n(.*?)^```$", text[start:end], flags=re.S | re.M):
        blocks.setdefault(language, []).append(body)
    return blocks


@pytest.fixture
def quickstart(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A folder standing for `/`: sample files in its data/hidden_states; and the environment that runs this
    checkout's `h5feed` command and package."""
    write_synthetic(tmp_path / "data" / "hidden_states", "speculators-legacy-pt", SAMPLES, 32, lengths=(20, 60),
                    seed=5)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "h5feed").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m h5feed.cli "$@"\n')
    (bin_dir / "h5feed").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return tmp_path, env


def as_here(code: str, root: Path) -> str:
    """The README's code with its `/data/` paths moved under `root`, and nothing else changed."""
    return code.replace("/data/", f"{root}/data/")


def test_the_quickstart_runs_as_written(quickstart) -> None:
    root, env = quickstart
    blocks = readme_blocks("Quickstart")
    [commands], [python] = blocks["bash"], blocks["python"]
    assert "h5feed convert /data/hidden_states /data/hs.zarr" in commands and "h5feed inspect /data/hs.zarr" in commands
    assert "h5feed.BatchLoader(" in python and "h5feed.monitor(" in python

    shell = subprocess.run(["bash", "-euo", "pipefail", "-c", as_here(commands, root)], cwd=root, env=env,
                           capture_output=True, text=True, timeout=600, check=False)
    assert shell.returncode == 0, shell.stderr
    store = Store(root / "data" / "hs.zarr")
    assert len(store) == SAMPLES and store.info.source_format == "speculators-legacy-pt"
    assert re.search(rf"^samples +{SAMPLES}$", shell.stdout, flags=re.M), shell.stdout  # inspect's figures
    assert re.search(r"^hidden_size +32$", shell.stdout, flags=re.M)

    (root / "quickstart.py").write_text(as_here(python, root))
    run = subprocess.run([sys.executable, "quickstart.py"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0, run.stderr
    [log] = (root / "runs" / "drafter").glob("h5feed-monitor*.jsonl")  # the monitor's log_dir, as the README names
    records = [json.loads(line) for line in log.read_text().splitlines()]
    ends = [r for r in records if r["kind"] == "end"]
    assert [(r["epoch"], r["steps"], r["complete"]) for r in ends] == [(0, SAMPLES, True), (1, SAMPLES, True)]
    assert "h5feed[train] epoch 1" in run.stderr  # the monitor's report lines, where the trainer's log goes

