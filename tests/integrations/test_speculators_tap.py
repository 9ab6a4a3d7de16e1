"""The ``h5feed-tap`` backend against the released speculators 0.9, hs-connectors 0.9.0 and Mooncake, with a real
``mooncake_master`` on 127.0.0.1: what speculators' `ArrowDataset` receives through it is what it receives through the
`mooncake` backend, bit for bit; the store then holds those samples, bit for bit; a second epoch, a later run (its
master stopped) and the ``h5feed`` backend read the store with no Mooncake request; a kill -9 loses only the samples
not journaled yet; errors name what to do.

The verifier is `VllmStandIn`: it answers speculators' requests as vLLM with hs-connectors'
MooncakeHiddenStatesConnector does, putting each row's ``hs_{i}.safetensors`` (what the `file` backend reads) into
Mooncake, and counts what it generated.  Every Mooncake client (stand-in, trainers) runs in a process of its own,
stopped before the master, as on a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import REPO
from hs_connectors import FileTransfer, HiddenStatesBackend
from speculators.train.data import ArrowDataset

import h5feed
from h5feed.errors import H5feedError, StoreError
from h5feed.integrations.mooncake_local import LocalMaster, free_port
from h5feed.integrations.speculators import H5feedBackend
from h5feed.integrations.speculators_tap import TapBackend, TapOptions, TapTransfer, open_tap_writer
from h5feed.store import Store
from h5feed.store.journal import journal_records
from h5feed.store.writer_state import WriterFiles
from h5feed.testing.synthetic import write_synthetic

H, K, N = 32, 3, 8
LENGTHS = (5, 40)
SEQ_LEN = 96
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]),
       "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1", "OMP_NUM_THREADS": "1"}
# a trainer lends the store no memory, so the objects live in the stand-in's (as they can in vLLM's): otherwise the
# master may place the next object in the memory of a trainer a test killed, and the put fails (status -800) until
# the master drops that client (its client_ttl, 10 s)
SMALL_SEGMENTS = ["--mooncake-global-segment-gib", "0", "--mooncake-local-buffer-gib", "0.0625"]

TRAINER = r"""
import argparse, json, os, sys, time, torch
import h5feed.integrations.speculators_tap  # registers h5feed and h5feed-tap
from hs_connectors import HiddenStatesBackend
from speculators.train.data import ArrowDataset
spec = json.loads(sys.argv[1])
backend = HiddenStatesBackend.registry[spec["backend"]]
parser = argparse.ArgumentParser()
backend.add_train_args(parser)
transfer = backend.from_train_args(parser.parse_args(spec["flags"]), spec["data"])
dataset = ArrowDataset(96, spec["data"], transfer=transfer, vllm_endpoint=spec["endpoint"], on_missing="generate",
                       model="verifier", request_timeout=30, max_retries=0, generation_validation_retries=0)
passes = []
for number in range(spec["passes"]):
    items = []
    for i in spec.get("rows") or range(len(dataset)):
        item = dataset[i]
        items.append(item if isinstance(item, dict) else {"unavailable": item.reason})
        print("served", i, flush=True)
    passes.append(items)
    if spec.get("pause") and number == 0:  # after epoch 1: wait for the test to stop the master
        print("paused", flush=True)
        while not os.path.exists(spec["pause"]):
            time.sleep(0.05)
torch.save(passes, spec["out"])
"""

LOADERS = r"""
import argparse, json, sys, time, torch
import h5feed.integrations.speculators_tap
from hs_connectors import HiddenStatesBackend
from speculators.models.eagle3.data import shift_batch
from speculators.train.dataloader import create_train_val_loaders
spec = json.loads(sys.argv[1])
backend = HiddenStatesBackend.registry["h5feed-tap"]
parser = argparse.ArgumentParser()
backend.add_train_args(parser)
transfer = backend.from_train_args(parser.parse_args(spec["flags"]), spec["data"])
train, _ = create_train_val_loaders(
    data_path=spec["data"], total_seq_len=96, hidden_states_dtype=torch.bfloat16, transfer=transfer,
    vllm_endpoint=spec["endpoint"], on_missing="generate", verifier_name_or_path="verifier", request_timeout=30,
    max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1, hidden_size=32,
    num_target_layers=3, num_workers=2, prefetch_factor=2, preprocess=shift_batch, train_data_ratio=0.7, seed=0)
epochs = []
for epoch in range(2):
    train.batch_sampler.set_epoch(epoch)
    epochs.append(list(train))
torch.save(epochs, spec["out"])
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """speculators' data folder: its Arrow dataset and the hs_{i}.safetensors the stand-in verifier serves."""
    root = tmp_path_factory.mktemp("tap") / "data"
    write_synthetic(root, "speculators-safetensors", N, H, num_aux_layers=K, lengths=LENGTHS, seed=5)
    return root


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with LocalMaster(tmp_path_factory.mktemp("master") / "master.log") as running:
        yield running


class StandIn:
    """`python -m h5feed.integrations.mooncake_local DATA --master ADDR`: the verifier, in a process of its own."""

    def __init__(self, data: Path, master_address: str) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}/v1"
        self.process = subprocess.Popen([sys.executable, "-m", "h5feed.integrations.mooncake_local", str(data),
                                         "--master", master_address, "--port", str(self.port)],
                                        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.generated()
                return
            except OSError:
                assert self.process.poll() is None and time.monotonic() < deadline, "the stand-in did not start"
                time.sleep(0.1)

    def generated(self) -> dict[int, int]:
        """{row: samples generated for it so far}."""
        with urllib.request.urlopen(f"{self.endpoint}/stats", timeout=5) as answer:
            return {int(row): n for row, n in json.loads(answer.read())["generated"].items()}

    def stop(self) -> None:
        self.process.kill()  # its Mooncake client goes with it (a kill needs no master to unmount from)
        self.process.wait()


@pytest.fixture
def stand_in(data, master):
    running = StandIn(data, master.address)
    yield running
    running.stop()


def trainer(spec: dict, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAINER, json.dumps(spec)], env=ENV, text=True, **popen)


def train(backend: str, data: Path, endpoint: str, out: Path, flags: list[str], passes: int = 1,
          rows: list[int] | None = None) -> list[list[dict]]:
    """speculators' ArrowDataset through `backend` in a trainer process: the items of each pass over `rows`."""
    spec = {"backend": backend, "data": str(data), "endpoint": endpoint, "out": str(out), "flags": flags,
            "passes": passes, "rows": rows}
    run = trainer(spec, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr[-4000:]
    (out.parent / f"{out.stem}.stderr").write_text(stderr)
    return torch.load(out, weights_only=True)


def tap_flags(store: Path, master_address: str, *extra: str) -> list[str]:
    return ["--h5feed-store", str(store), "--mooncake-master", master_address, *SMALL_SEGMENTS, *extra]


def file_items(data: Path, rows=range(N)) -> list[dict]:
    dataset = ArrowDataset(SEQ_LEN, data, transfer=FileTransfer(data / "hidden_states"), on_missing="raise")
    return [dataset[i] for i in rows]


def h5feed_transfer(store: Path, data: Path):
    args = argparse.Namespace(h5feed_store=str(store), h5feed_cache_dir=None, h5feed_on_corrupt="raise")
    return H5feedBackend.from_train_args(args, str(data))


def assert_store_holds_the_files_samples(store: Path, data: Path, rows, assert_same_batch) -> None:
    """The store, read by the h5feed backend (another run, another drafter), holds each row's sample bit for bit."""
    transfer, files = h5feed_transfer(store, data), FileTransfer(data / "hidden_states")
    assert sorted(Store(store).source_indices.tolist()) == sorted(rows)
    for i in rows:
        assert_same_batch(transfer.get_cached(i), files.get_cached(i))


# --------------------------------------------------------------------------- what the trainer receives, and keeps


def test_the_backend_is_registered_as_hs_connectors_expects():
    assert HiddenStatesBackend.registry["h5feed-tap"] is TapBackend
    parser = argparse.ArgumentParser()
    TapBackend.add_train_args(parser)
    args = parser.parse_args(["--h5feed-store", "/s"])
    assert (args.mooncake_master, args.h5feed_tap_write_behind, args.h5feed_tap_publish_every) == (
        "127.0.0.1:50051", 2, 16)
    assert TapBackend.build_kv_transfer_config(argparse.Namespace(
        mooncake_master="m:1", mooncake_metadata_server="P2PHANDSHAKE", mooncake_global_segment_gib=1.0,
        mooncake_local_buffer_gib=1.0, mooncake_protocol="tcp", mooncake_device="", mooncake_writer_threads=4,
    ))["kv_connector"] == "MooncakeHiddenStatesConnector"


@pytest.mark.slow
def test_the_trainer_receives_the_mooncake_backends_samples_and_the_store_keeps_them(data, master, stand_in, tmp_path,
                                                                                   assert_same_batch):
    """Epoch 1 through the tap is the mooncake backend's epoch bit for bit; epoch 2 reads the store, asking the
    verifier for nothing; the store holds every row bit for bit, for the h5feed backend to read."""
    plain = train("mooncake", data, stand_in.endpoint, tmp_path / "plain.pt",
                  ["--mooncake-master", master.address, *SMALL_SEGMENTS])
    assert stand_in.generated() == dict.fromkeys(range(N), 1)
    tapped = train("h5feed-tap", data, stand_in.endpoint, tmp_path / "tapped.pt",
                   tap_flags(tmp_path / "hs.zarr", master.address), passes=2)
    assert stand_in.generated() == dict.fromkeys(range(N), 2)  # the tap's epoch 1 only
    on_files = file_items(data)
    for i in range(N):
        assert_same_batch(plain[0][i], on_files[i])  # what the stand-in put is the files' sample
        assert_same_batch(tapped[0][i], plain[0][i])
        assert_same_batch(tapped[1][i], plain[0][i])
    assert_store_holds_the_files_samples(tmp_path / "hs.zarr", data, range(N), assert_same_batch)
    store = Store(tmp_path / "hs.zarr")
    assert store.source_paths == [f"hs_{i}" for i in store.source_indices]
    assert store.info.source_format == "speculators-legacy-pt" and store.info.last_state_norm == "pre"
    for j, i in enumerate(store.source_indices):  # the rows' loss masks are kept too, for h5feed's own loaders
        raw = store.read_sample(j)
        assert raw.has_loss_mask and torch.equal(raw.loss_mask, on_files[i]["loss_mask"].to(torch.int64))


@pytest.mark.slow
def test_epoch_2_and_a_later_run_read_the_store_with_the_master_stopped(data, tmp_path, assert_same_batch):
    """The master (and the verifier) go away after epoch 1: epoch 2 of the same run reads the store, as does a later
    run, and the h5feed backend (another drafter)."""
    spec = {"backend": "h5feed-tap", "data": str(data), "out": str(tmp_path / "first.pt"), "passes": 2,
            "rows": [0, 1, 2, 3], "pause": str(tmp_path / "go")}
    with LocalMaster(tmp_path / "master.log") as own:
        verifier = StandIn(data, own.address)
        spec.update(endpoint=verifier.endpoint, flags=tap_flags(tmp_path / "hs.zarr", own.address))
        run = trainer(spec, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            lines = [run.stdout.readline() for _ in range(5)]
            assert lines[-1] == "paused\n", lines
            assert verifier.generated() == dict.fromkeys(range(4), 1)
        finally:
            verifier.stop()
    assert own.process.poll() is not None  # stopped
    (tmp_path / "go").touch()
    rest, _ = run.communicate(timeout=300)
    assert run.returncode == 0 and rest.split()[-8:] == [w for i in range(4) for w in ("served", str(i))]
    first = torch.load(tmp_path / "first.pt", weights_only=True)
    for got, want in zip(first[1], file_items(data, range(4))):
        assert_same_batch(got, want)
    items = train("h5feed-tap", data, "http://127.0.0.1:9/v1", tmp_path / "later.pt",
                  tap_flags(tmp_path / "hs.zarr", own.address), rows=[3, 1, 0, 2])[0]
    on_files = file_items(data, [3, 1, 0, 2])
    for got, want in zip(items, on_files):
        assert_same_batch(got, want)
    dataset = ArrowDataset(SEQ_LEN, data, transfer=h5feed_transfer(tmp_path / "hs.zarr", data), on_missing="raise")
    for i in range(4):
        assert_same_batch(dataset[i], file_items(data, [i])[0])


def test_speculators_loaders_with_spawned_workers_tap_once_and_read_the_store_in_epoch_2(data, stand_in, master,
                                                                                        tmp_path, assert_same_batch):
    """speculators' own loaders (packing sampler, 2 spawned workers, each appending as a writer of its own): epoch 2
    generates nothing, and its batches are epoch 2's through the file backend."""
    out = tmp_path / "epochs.pt"
    flags = tap_flags(tmp_path / "hs.zarr", master.address, "--h5feed-tap-write-behind", "0",
                      "--h5feed-tap-publish-every", "1")  # each kept row published before it is served
    spec = {"data": str(data), "endpoint": stand_in.endpoint, "out": str(out), "flags": flags}
    run = subprocess.run([sys.executable, "-c", LOADERS, json.dumps(spec)], env=ENV, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    train_rows = range(int(N * 0.7))
    assert stand_in.generated() == dict.fromkeys(train_rows, 1)
    epochs = torch.load(out, weights_only=True)
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    dataset = ArrowDataset(SEQ_LEN, data, transfer=FileTransfer(data / "hidden_states"), on_missing="raise",
                           train_ratio=0.7)
    collate = CollateFn(SEQ_LEN, H, num_target_layers=K, preprocess=shift_batch)
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=SEQ_LEN, lengths=dataset.approx_lengths,
                                                 num_replicas=1, rank=0, seed=0)
    for epoch, batches in enumerate(epochs):
        sampler.set_epoch(epoch)
        want = [collate([dataset[i] for i in rows]) for rows in sampler]
        assert len(batches) == len(want) > 0
        for got, expected in zip(batches, want):
            assert_same_batch(got, expected)
    writers = sorted(p.name for p in (tmp_path / "hs.zarr" / "h5feed-writers").glob("id-tap-*.jsonl"))
    assert writers == [f"id-tap-{w}.jsonl" for w in range(min(2, len(epochs[0])))]  # a writer per worker (batch)
    assert_store_holds_the_files_samples(tmp_path / "hs.zarr", data, train_rows, assert_same_batch)


# --------------------------------------------------------------------------- crash safety


@pytest.mark.slow
def test_a_kill_9_loses_only_unjournaled_samples_and_a_rerun_continues(data, master, stand_in, tmp_path,
                                                                      assert_same_batch):
    store = tmp_path / "hs.zarr"
    spec = {"backend": "h5feed-tap", "data": str(data), "endpoint": stand_in.endpoint, "out": str(tmp_path / "x.pt"),
            "flags": tap_flags(store, master.address, "--h5feed-tap-publish-every", "100"), "passes": 1, "rows": None}
    killed = trainer(spec, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        served = [killed.stdout.readline() for _ in range(5)]
        assert all(line.startswith("served") for line in served), served
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
    journal = WriterFiles(store, "tap-0").journal
    journaled = {r.source_index for r in journal_records(journal) if r.i is not None}
    assert journaled and journaled <= set(range(5))
    with pytest.raises(StoreError):  # nothing was published: the command (or the rerun) publishes it
        Store(store)
    published = subprocess.run([sys.executable, "-m", "h5feed.integrations.speculators_tap", "publish", str(store)],
                               env=ENV, capture_output=True, text=True, timeout=120, check=False)
    assert published.returncode == 0, published.stderr
    assert published.stdout == f"{store}: {len(journaled)} samples published\n"
    assert sorted(Store(store).source_indices.tolist()) == sorted(journaled)
    before = stand_in.generated()
    items = train("h5feed-tap", data, stand_in.endpoint, tmp_path / "rerun.pt", tap_flags(store, master.address))[0]
    after = stand_in.generated()
    regenerated = {i for i in range(N) if after.get(i, 0) > before.get(i, 0)}
    assert regenerated == set(range(N)) - journaled  # the journaled ones are read from the store
    assert all(after[i] == before.get(i, 0) + 1 for i in regenerated)
    for got, want in zip(items, file_items(data)):
        assert_same_batch(got, want)
    assert_store_holds_the_files_samples(store, data, range(N), assert_same_batch)


# --------------------------------------------------------------------------- errors


def tap_transfer(store: Path, data: Path, master_address: str = "127.0.0.1:1", *extra: str) -> TapTransfer:
    parser = argparse.ArgumentParser()
    TapBackend.add_train_args(parser)
    return TapBackend.from_train_args(parser.parse_args(tap_flags(store, master_address, *extra)), str(data))


def test_an_unreachable_master_is_named_with_what_to_do(data, stand_in, tmp_path):
    port = free_port()
    transfer = tap_transfer(tmp_path / "hs.zarr", data, f"127.0.0.1:{port}")
    message = (f"the Mooncake master at 127.0.0.1:{port} does not answer (Connection refused): start "
               "`mooncake_master` there (pip install mooncake-transfer-engine-non-cuda (or the CUDA build, "
               "mooncake-transfer-engine)), or pass --mooncake-master HOST:PORT, the address vLLM's "
               "MooncakeHiddenStatesConnector puts its samples through")
    started = time.monotonic()
    with pytest.raises(H5feedError) as err:
        transfer.setup()
    assert str(err.value) == message and time.monotonic() - started < 10
    dataset = ArrowDataset(SEQ_LEN, data, transfer=transfer, vllm_endpoint=stand_in.endpoint, on_missing="generate",
                           model="verifier", max_retries=0, generation_validation_retries=0)
    item = dataset[0]  # speculators' recovery: the sample is unavailable, its reason ours
    assert message in item.reason and stand_in.generated() == {}


def test_a_store_held_by_another_writer_is_refused(data, tmp_path):
    store = tmp_path / "hs.zarr"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from h5feed.conversion.lock import WriterLock\nWriterLock.acquire(Path(sys.argv[1]))\n"
                               "print('held', flush=True)\ntime.sleep(120)", str(store)],
                              env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(StoreError) as err:
            tap_transfer(store, data)
    finally:
        holder.kill()
        holder.wait()
    assert str(err.value).startswith(f"{store}: another `h5feed convert` (host ")
    assert str(err.value).endswith("is writing this store; wait for it to finish, or stop it and run this command "
                                   "again")
    tap_transfer(store, data)  # once let go


def test_a_store_the_tap_cannot_write_into_is_refused(data, tmp_path):
    h5feed.convert(data, tmp_path / "converted.zarr", workers=0, progress=False)
    with pytest.raises(StoreError) as err:
        tap_transfer(tmp_path / "converted.zarr", data)
    assert str(err.value) == (f"{tmp_path / 'converted.zarr'}: was made by `h5feed convert`, not by open_writer: "
                              "append files to it with `h5feed convert`, or write into another store")
    with pytest.raises(H5feedError) as err:
        tap_transfer("s3://bucket/hs.zarr", data)
    assert str(err.value) == ("--hidden-states-backend h5feed-tap keeps the samples in a local folder, not in "
                              "s3://bucket/hs.zarr: tap into a folder of this machine (upload it afterwards, and "
                              "train from the bucket with --hidden-states-backend h5feed)")
    with pytest.raises(H5feedError, match=r"needs --h5feed-store FOLDER, where it keeps the samples it receives"):
        TapBackend.from_train_args(argparse.Namespace(h5feed_store=None), str(data))


def test_a_sample_of_another_shape_is_served_then_stops_the_training_naming_it(data, master, tmp_path):
    """The store holds rows 0-3 of a verifier with H=32; another verifier (H=64, same prompts) serves rows 4-7."""
    store = tmp_path / "hs.zarr"
    files = FileTransfer(data / "hidden_states")
    with open_tap_writer(TapOptions(str(store), str(data))) as writer:
        for i in range(4):
            sample = files.get_cached(i)
            writer.append(input_ids=sample["token_ids"], hidden_states=list(sample["hidden_states"].unbind(1)),
                          name=f"hs_{i}", source_index=i)
    other = tmp_path / "other"
    write_synthetic(other, "speculators-safetensors", N, 2 * H, num_aux_layers=K, lengths=LENGTHS, seed=5)
    verifier = StandIn(other, master.address)
    try:
        spec = {"backend": "h5feed-tap", "data": str(data), "endpoint": verifier.endpoint,
                "out": str(tmp_path / "x.pt"), "flags": tap_flags(store, master.address), "passes": 1, "rows": None}
        run = trainer(spec, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = run.communicate(timeout=300)
        assert verifier.generated() == {4: 1}
    finally:
        verifier.stop()
    assert run.returncode == 1
    assert stdout.split() == [w for i in range(5) for w in ("served", str(i))]  # row 4 was served, then it stopped
    assert (f"h5feed.errors.H5feedError: {store}: the h5feed-tap backend could not keep row 4's sample ({store}/hs_4: "
            f"hidden size {2 * H} differs from {H} of the store's samples); training stops here, with the samples "
            "kept before it in the store: remove the cause and train again (rows the store holds are read from it, "
            "the others generated), or tap into another --h5feed-store (one store holds one verifier's hidden "
            "states)") in stderr
    assert sorted(Store(store).source_indices.tolist()) == [0, 1, 2, 3]


def test_the_command_takes_the_taps_flags(data, tmp_path):
    r = subprocess.run([sys.executable, "-m", "h5feed.speculators_train", "--dump-config", "--verifier-name-or-path",
                        "verifier", "--data-path", str(data), "--hidden-states-backend", "h5feed-tap",
                        "--h5feed-store", str(tmp_path / "hs.zarr"), "--mooncake-master", "10.0.0.5:50051",
                        "--h5feed-tap-publish-every", "4"],
                       check=False, capture_output=True, text=True, timeout=300, cwd=REPO, env=ENV)
    assert r.returncode == 0, r.stderr
    for line in ("hidden_states_backend: h5feed-tap", f"h5feed_store: {tmp_path / 'hs.zarr'}",
                 "mooncake_master: 10.0.0.5:50051", "h5feed_tap_publish_every: 4"):
        assert line in r.stdout, r.stdout
