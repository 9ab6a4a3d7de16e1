"""Trusting `h5feed convert`: its worker processes die with it however it is killed, even while they start, and
leave no semaphore behind; a code-carrying pickle of any protocol is refused as what it is; plans of older
versions still read and extend."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import psutil
import pytest
import torch
from conftest import RunsEval, RunsShell

from h5feed import SkipPolicy, StoreSettings
from h5feed.conversion.converter import PLAN_FILE, convert
from h5feed.errors import SourceError
from h5feed.formats import FORMATS
from h5feed.store import Store
from h5feed.testing.synthetic import write_synthetic

H = 32
CHUNK = 16
CHUNKED = StoreSettings(chunk_tokens=CHUNK)  # the store settings of most conversions here


# --------------------------------------------------------------------------- SIGKILL while the workers start


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _marked(marker: str) -> set[int]:
    """The living processes whose environment holds `marker`: the converter's descendants, wherever reparented."""
    found = set()
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("H5FEED_TEST_RUN") == marker and _alive(proc):
                found.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _mapped_shm_inodes(pid: int) -> set[int]:
    """Inodes of the /dev/shm files (named semaphores among them) that a process maps."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return {int(line.split()[4]) for line in maps.splitlines() if " /dev/shm/" in line}


def _semaphore_inodes() -> set[int]:
    inodes = set()
    for path in Path("/dev/shm").glob("sem.*"):
        try:
            inodes.add(path.stat().st_ino)
        except FileNotFoundError:
            continue
    return inodes


# after the converter's first child (its resource tracker, then its first worker) appears: workers are starting
KILL_AFTER_S = (0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.25, 1.5)


@pytest.mark.slow
def test_a_sigkill_while_workers_start_leaves_no_process_and_no_semaphore(tmp_path: Path, assert_same_tree) -> None:
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    write_synthetic(src, "speculators-legacy-pt", 24, H, lengths=(20, 60), seed=6)
    convert(src, ref, workers=0, progress=False, settings=CHUNKED)
    args = ["-q", "convert", str(src), str(dst), "--workers", "2", "--chunk-tokens", str(CHUNK)]
    script = Path(sys.executable).with_name("h5feed")  # the `h5feed` command: its workers re-run it before h5feed's code
    commands = [[sys.executable, "-m", "h5feed", *args], [sys.executable, str(script), *args]]
    for run, delay in enumerate(KILL_AFTER_S):
        command = commands[run % 2]
        marker = uuid.uuid4().hex
        log = tmp_path / "run.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(command, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "H5FEED_TEST_RUN": marker})
        converter = psutil.Process(proc.pid)
        children: set[psutil.Process] = set()
        deadline = time.monotonic() + 120
        while not children:
            assert proc.poll() is None, f"the conversion ended before it started a worker:\n{log.read_text()}"
            assert time.monotonic() < deadline, "timed out waiting for the converter's first worker"
            children.update(converter.children())
            time.sleep(0.002)
        kill_at = time.monotonic() + delay
        while time.monotonic() < kill_at:
            children.update(converter.children())
            time.sleep(0.002)
        semaphores = _mapped_shm_inodes(proc.pid)
        assert semaphores  # the pool's queues made theirs before its first process started
        children.update(converter.children())
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        gone_by = time.monotonic() + 1.0
        psutil.wait_procs(children, timeout=1.0)
        time.sleep(max(0.0, gone_by - time.monotonic()))
        survivors = {p.pid for p in children if _alive(p)} | _marked(marker)
        assert survivors == set(), f"{len(survivors)} process(es) of a converter killed {delay} s into start-up"
        assert semaphores & _semaphore_inodes() == set(), delay  # the resource tracker removed them, and ended
    done = subprocess.run(command, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_tree(dst, ref)


# --------------------------------------------------------------------------- code-carrying pickles, every protocol


PAYLOADS = {"os.system": (RunsShell, "posix.system"), "builtins.eval": (RunsEval, "eval")}  # and the name torch gives
SERIALIZATIONS = {  # file name, torch.save's keyword arguments
    "zip": ("data_0.pt", {}),
    "pre-1.6": ("data_0.pt", {"_use_new_zipfile_serialization": False}),
    "gzip": ("rows_0-2000/data_0.ckpt.gz", {}),
}


def _sample(t: int = 4) -> dict:
    return {"input_ids": torch.arange(t), "loss_mask": torch.ones(t, dtype=torch.int64),
            "hidden_states": torch.zeros(t, 3 * H), "target": torch.zeros(t, H)}


def _save(path: Path, obj: dict, protocol: int, **kwargs) -> None:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch notes the protocol 4 and 5 it will not read
        torch.save(obj, buffer, pickle_protocol=protocol, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(buffer.getvalue()) if path.suffix == ".gz" else buffer.getvalue())


@pytest.mark.parametrize("serialization", SERIALIZATIONS)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_code_carrying_pickle_is_refused_as_one_whatever_its_protocol(
    tmp_path: Path, payload: str, serialization: str
) -> None:
    cls, named = PAYLOADS[payload]
    name, kwargs = SERIALIZATIONS[serialization]
    fmt = FORMATS["specforge-ckpt" if name.endswith(".gz") else "speculators-legacy-pt"]
    marker = tmp_path / "ran"
    expected = ("refusing to load: the pickle needs code to run (h5feed always loads with weights_only=True): "
                f"it references {named}, a class or function that is not a tensor or plain container; "
                "re-save it holding only tensors, lists and dicts")
    for protocol in (2, 3, 4, 5):
        root = tmp_path / f"protocol{protocol}"
        _save(root / name, {**_sample(), "meta": cls(marker)}, protocol, **kwargs)
        source = fmt.discover(root)[0]
        for read in (fmt.probe, fmt.load):
            with warnings.catch_warnings(), pytest.raises(SourceError) as refused:
                warnings.simplefilter("ignore")
                read(source)
            assert (refused.value.path, refused.value.problem) == (str(source.path), expected), protocol
    assert not marker.exists()


def test_the_real_command_refuses_a_protocol_5_pickle_that_runs_a_shell(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    _save(tmp_path / "src" / "data_0.pt", {**_sample(), "meta": RunsShell(marker)}, 5)
    done = subprocess.run([sys.executable, "-m", "h5feed", "-q", "convert", str(tmp_path / "src"),
                           str(tmp_path / "store"), "--workers", "0"], check=False, capture_output=True, text=True,
                           timeout=120)
    path = (tmp_path / "src" / "data_0.pt").resolve()
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        f"h5feed convert: error: {path}: refusing to load: the pickle needs code to run (h5feed always loads with "
        "weights_only=True): it references posix.system, a class or function that is not a tensor or plain "
        "container; re-save it holding only tensors, lists and dicts")
    assert not marker.exists() and not (tmp_path / "store").exists()


@pytest.mark.parametrize("protocol", [4, 5])
def test_a_plain_protocol_5_pickle_is_still_named_as_a_protocol_torch_cannot_read(tmp_path: Path, protocol: int) -> None:
    _save(tmp_path / "data_0.pt", _sample(), protocol)
    fmt = FORMATS["speculators-legacy-pt"]
    with warnings.catch_warnings(), pytest.raises(SourceError) as refused:
        warnings.simplefilter("ignore")
        fmt.load(fmt.discover(tmp_path)[0])
    assert refused.value.problem == (
        "its pickle uses the opcode FRAME of pickle protocol 4, which torch's weights-only loader cannot read; "
        "re-save it with torch.save's default pickle protocol (2)")


# --------------------------------------------------------------------------- the plan file


def test_a_plan_written_before_appending_existed_is_extended_with_its_entries_as_they_were(tmp_path: Path) -> None:
    """Plans of older versions record no file size and mtime (nor the store's attributes): an append reads them and
    writes their entries back without inventing any, and the new entries get theirs."""
    src, dst, staged = tmp_path / "src", tmp_path / "store", tmp_path / "staged"
    write_synthetic(staged, "speculators-legacy-pt", 5, H, lengths=(5, 40), seed=7)
    src.mkdir()
    for name in ("data_0.pt", "data_1.pt", "data_2.pt"):
        shutil.copy2(staged / name, src / name)
    convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    old = json.loads((dst / PLAN_FILE).read_text())
    del old["store"]  # nor a copy of the store's attributes
    for entry in old["samples"]:
        del entry["size"], entry["mtime_ns"]
    (dst / PLAN_FILE).write_text(json.dumps(old))
    for name in ("data_3.pt", "data_4.pt"):
        shutil.copy2(staged / name, src / name)
    report = convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    assert (report.num_samples, report.converted_now, report.resumed) == (5, 2, 3)
    plan = json.loads((dst / PLAN_FILE).read_text())
    assert list(plan) == ["options", "samples", "skipped", "total_rows", "append_from"]
    assert plan["samples"][:3] == old["samples"] and plan["append_from"] == 3
    assert [sorted(entry) for entry in plan["samples"][3:]] == [
        ["mtime_ns", "num_tokens", "relpath", "sample_index", "size", "start"]] * 2
    assert Store(dst).source_paths == [f"data_{i}.pt" for i in range(5)]


_CLAIMS = r"""
import resource, sys, torch, h5feed
from pathlib import Path
from h5feed.errors import SourceError

root, t, h = Path(sys.argv[1]), 1 << 20, 1024  # each layer claims 2 GiB, the sample 8 GiB

def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def refused(run) -> None:
    before = peak()
    try:
        run()
    except SourceError as exc:
        print(exc.path, "|", exc.problem, "|", peak() - before, flush=True)
    else:
        print("converted |  | ", peak() - before, flush=True)

small = {"input_ids": torch.arange(3), "hidden_states": [torch.ones(3, h, dtype=torch.bfloat16) for _ in range(4)]}
expanded = {"input_ids": torch.zeros(1, dtype=torch.int64).expand(t),
            "hidden_states": [torch.ones(1, h, dtype=torch.bfloat16).expand(t, h) for _ in range(4)]}
meta = {"input_ids": torch.zeros(t, dtype=torch.int64, device="meta"),
        "hidden_states": [torch.empty(t, h, dtype=torch.bfloat16, device="meta") for _ in range(4)]}
h5feed.convert(root / "warm", root / "warm.zarr", workers=0, progress=False)  # the imports, the first allocations
for name, d in (("expanded", expanded), ("meta", meta)):
    (root / name).mkdir()
    torch.save(d, root / name / "data_0.pt")
    refused(lambda: h5feed.convert(root / name, root / f"{name}.zarr", workers=0, progress=False))
    with h5feed.open_writer(root / f"written_{name}.zarr") as writer:
        writer.append(small, name="small")
        refused(lambda: writer.append(d, name=name))
"""


def test_tensors_that_claim_more_than_they_hold_are_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    """An expanded view (stride 0) or a meta tensor claims 8 GiB here while holding bytes or nothing: the file, and
    the sample given to a writer, are refused naming the key, and the process grows by no more than a few MB."""
    (tmp_path / "warm").mkdir()
    torch.save({"input_ids": torch.arange(3), "hidden_states": [torch.ones(3, 1024, dtype=torch.bfloat16)] * 4},
               tmp_path / "warm" / "data_0.pt")
    run = subprocess.run([sys.executable, "-c", _CLAIMS, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [line.split(" | ") for line in run.stdout.splitlines()]
    assert [path for path, _, _ in lines] == [
        str(tmp_path / "expanded" / "data_0.pt"), str(tmp_path / "written_expanded.zarr" / "expanded"),
        str(tmp_path / "meta" / "data_0.pt"), str(tmp_path / "written_meta.zarr" / "meta")]
    for (_, problem, grown), what in zip(lines, ("expanded", "expanded", "meta", "meta")):
        assert int(grown) < 64 << 20, (problem, grown)
        if what == "expanded":
            assert problem.startswith("'input_ids' claims [1048576] (8388608 bytes) but holds 8 bytes: ")
        else:
            assert problem.startswith("'input_ids' is a meta tensor [1048576]: ")


def test_a_skipped_file_that_vanished_is_named_as_gone_by_retry_skipped(tmp_path: Path) -> None:
    """A file skipped while planning (damaged) and one skipped while converting (damaged after planning), both
    deleted since: --retry-skipped --skip-bad keeps a record of each that says it is gone, not the old reason."""
    src, dst = tmp_path / "src", tmp_path / "store"
    files = write_synthetic(src, "speculators-legacy-pt", 5, 16, lengths=(4, 9), seed=2)
    files[1].write_bytes(files[1].read_bytes()[:100])
    convert(src, dst, workers=0, progress=False, skips=SkipPolicy(skip_bad=True))
    assert [s.path for s in Store(dst).info.skipped] == ["data_1.pt"]
    files[1].unlink()
    convert(src, dst, workers=0, progress=False, skips=SkipPolicy(skip_bad=True, retry_skipped=True))
    skipped = Store(dst).info.skipped
    assert [s.path for s in skipped] == ["data_1.pt"] and len(Store(dst)) == 4
    assert skipped[0].problem.startswith("is gone: it was skipped (not a readable torch.save file")
    assert skipped[0].problem.endswith("; --retry-skipped found no file to try again")


def test_a_file_skipped_while_converting_then_deleted_is_named_as_gone_by_retry_skipped(
        tmp_path: Path, interrupted_convert) -> None:
    src, dst = tmp_path / "src", tmp_path / "store"
    files = write_synthetic(src, "speculators-legacy-pt", 5, 16, lengths=(4, 9), seed=2)
    assert sorted(interrupted_convert(src, dst, after=2)) == [0, 1]
    files[3].write_bytes(files[3].read_bytes()[:100])  # damaged after it was planned: skipped while converting
    convert(src, dst, workers=0, progress=False, skips=SkipPolicy(skip_bad=True))
    assert [s.path for s in Store(dst).info.skipped] == ["data_3.pt"]
    files[3].unlink()
    for _ in range(2):  # and again: the record stays as it is
        convert(src, dst, workers=0, progress=False, skips=SkipPolicy(skip_bad=True, retry_skipped=True))
        skipped = Store(dst).info.skipped
        assert [s.path for s in skipped] == ["data_3.pt"] and len(Store(dst)) == 4
        assert skipped[0].problem.startswith("is gone: it was skipped (not a readable torch.save file")
        assert skipped[0].problem.endswith("; --retry-skipped found no file to try again")
