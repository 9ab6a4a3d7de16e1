"""Fixtures shared by the tests.

The expected tensors are read from the source files the way each trainer's own code
describes, without h5feed, so a reader bug in h5feed cannot hide itself.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from s3_server import S3

    from h5feed.store import Store
    from h5feed.store.journal import JournalRecord

REPO = Path(__file__).resolve().parents[1]  # the checkout: README.md, src/, examples/, bench/, tools/
TESTS = Path(__file__).resolve().parent  # this folder, where `conftest` and `s3_server` import from
CHECKOUT_ENV = {**os.environ, "PYTHONPATH": str(REPO / "src")}  # a child process that runs this checkout's h5feed


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip, saying why, where this machine cannot run them: `@pytest.mark.gpu` needs CUDA and
    nvCOMP (h5feed's GPU decode), `@pytest.mark.gpu(nvcomp=False)` CUDA alone.  `pytest -m gpu` runs them on a GPU
    box; CI deselects them (`-m "not gpu"`)."""
    from h5feed.gpu import why_unavailable

    no_decode = why_unavailable()
    for item in items:
        mark = item.get_closest_marker("gpu")
        if mark is None:
            continue
        if mark.kwargs.get("nvcomp", True):
            if no_decode is not None:
                item.add_marker(pytest.mark.skip(reason=f"GPU decode unavailable: {no_decode}"))
        elif not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


def _source_sample(fmt: str, root: Path, relpath: str, index: int) -> dict[str, Any]:
    """input_ids, loss_mask (None when absent), aux [T, K*H] and last [T, H] of one source file, as its trainer reads it."""
    path = Path(root) / relpath
    if fmt == "speculators-safetensors":
        import pyarrow as pa
        from safetensors.torch import load_file

        d = load_file(str(path))
        state = json.loads((Path(root) / "state.json").read_text())
        rows = pa.concat_tables(
            [pa.ipc.open_stream(pa.OSFile(str(Path(root) / f["filename"]))).read_all() for f in state["_data_files"]]
        ).to_pydict()
        hs = d["hidden_states"]  # [T, K+1, H]
        assert rows["seq_len"][index] == hs.shape[0] and rows["input_ids"][index] == d["token_ids"].tolist()
        mask = torch.tensor(rows["loss_mask"][index], dtype=torch.int64) if "loss_mask" in rows else None
        aux = hs[:, :-1].reshape(hs.shape[0], -1)
        return {"input_ids": d["token_ids"], "loss_mask": mask, "aux": aux, "last": hs[:, -1]}
    data = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    d = torch.load(io.BytesIO(data), weights_only=True)
    if fmt == "speculators-legacy-pt":
        aux, last = torch.cat(d["hidden_states"][:-1], dim=-1), d["hidden_states"][-1]
    elif fmt == "speculators-v0-pt":
        aux, last = d["hidden_state"], d["target"]
    else:  # specforge-ckpt: leading batch dim
        aux, last = d["aux_hidden_state"][0], d["hidden_state"][0]
    return {"input_ids": d["input_ids"], "loss_mask": d.get("loss_mask"), "aux": aux, "last": last}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, so equality is exact (NaN == NaN, -0 != +0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_item(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same keys, and every tensor equal (floats bit for bit)."""
    return a.keys() == b.keys() and all(
        torch.equal(bits(a[k]) if a[k].is_floating_point() else a[k], bits(b[k]) if b[k].is_floating_point() else b[k])
        for k in a
    )


def assert_same(got: Any, want: Any, what: str = "item") -> None:
    """Same keys in the same order, tensors equal bit for bit with the same dtype and shape, other values equal."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (what, list(got), list(want))
        for key in want:
            assert_same(got[key], want[key], f"{what}[{key!r}]")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (what, len(got), len(want))
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{what}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), what
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), (what, got.dtype, got.shape, want.shape)
        assert torch.equal(bits(got.contiguous()), bits(want.contiguous())), f"{what} differs"
    else:
        assert type(got) is type(want) and got == want, (what, got, want)


@pytest.fixture
def source_sample() -> Callable[[str, Path, str, int], dict[str, Any]]:
    return _source_sample


@pytest.fixture
def assert_sample_matches_source() -> Callable[..., None]:
    """Check store.read_sample(i) bit for bit against the source file it came from."""

    def check(store: Any, i: int, fmt: str, src: Path) -> None:
        want = _source_sample(fmt, src, store.source_paths[i], int(store.source_indices[i]))
        got = store.read_sample(i)
        t = len(want["input_ids"])
        assert got.num_tokens == t == int(store.sample_lengths[i])
        assert got.input_ids.dtype == torch.int64 and torch.equal(got.input_ids, want["input_ids"])
        mask = want["loss_mask"] if want["loss_mask"] is not None else torch.ones(t, dtype=torch.int64)
        assert got.loss_mask.dtype == torch.int64 and torch.equal(got.loss_mask, mask)
        assert got.has_loss_mask is (want["loss_mask"] is not None)
        pairs = (("aux", got.aux_hidden_states, want["aux"]), ("last", got.last_hidden_state, want["last"]))
        for name, stored, source in pairs:
            assert stored.dtype == source.dtype and stored.shape == source.shape, name
            assert torch.equal(bits(stored), bits(source)), f"{name} of sample {i} differs"

    return check


def file_tree(root: Path) -> dict[str, bytes]:
    """Every file under root, by its path relative to root, with its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.fixture
def assert_same_tree() -> Callable[[Path, Path], None]:
    """Two stores hold the same files with the same bytes, nothing excluded."""

    def check(a: Path, b: Path) -> None:
        ta, tb = file_tree(a), file_tree(b)
        assert sorted(ta) == sorted(tb)
        assert [name for name in ta if ta[name] != tb[name]] == []

    return check


@dataclass(frozen=True)
class CliResult:
    status: int  # what `h5feed` exits with
    stdout: str
    output: str  # stdout, stderr and log lines together


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run `h5feed -q ARGS` in this process."""
    from h5feed.cli import main

    def run(*args: Any) -> CliResult:
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        logger = logging.getLogger("h5feed")
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            status = main(["-q", *map(str, args)])
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        out = capsys.readouterr()
        return CliResult(status, out.out, out.out + out.err + stream.getvalue())

    return run


@pytest.fixture
def chromium(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run headless Chromium with ARGS (e.g. `--dump-dom`, a page's URI), to see a page as a browser shows it.

    Skips the test where Debian's chromium is not installed (`apt install chromium`; .ci/run installs it)."""
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("needs Debian's chromium (apt install chromium); .ci/run installs it")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'chromium-profile'}"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([path, *flags, *args], capture_output=True, text=True, timeout=120, check=False)

    return run


@pytest.fixture
def interrupted_convert(monkeypatch: pytest.MonkeyPatch) -> Callable[..., dict[int, JournalRecord]]:
    """Convert in this process and stop like Ctrl-C after `after` samples; returns the journal.

    With workers=0 and after=2 the journal holds exactly samples 0 and 1.
    """
    from h5feed.conversion.converter import convert
    from h5feed.store.journal import read_journal

    module = sys.modules["h5feed.conversion.tasks"]  # where the convert step looks convert_one up

    def run(src: Path, dst: Path, after: int = 2, **kwargs: Any) -> dict[int, JournalRecord]:
        original = module.convert_one
        calls = []

        def convert_one(*args: Any) -> Any:
            calls.append(args)
            if len(calls) > after:
                raise KeyboardInterrupt
            return original(*args)

        monkeypatch.setattr(module, "convert_one", convert_one)
        try:
            with pytest.raises(KeyboardInterrupt):
                convert(src, dst, workers=0, progress=False, **kwargs)
        finally:
            monkeypatch.setattr(module, "convert_one", original)
        return read_journal(Path(dst))

    return run


# --- synthetic stores, each converted once a session ---------------------------------------------


class SyntheticStore:
    """A synthetic source folder, its files (store index i <-> files[i]), lengths and converted store."""

    def __init__(self, src: Path, files: list[Path], path: Path, lengths: list[int]) -> None:
        self.src, self.files, self.path, self.lengths = src, files, path, lengths


@pytest.fixture(scope="session")
def synthetic_store(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., SyntheticStore]:
    """`synthetic_store(name, fmt, n, hidden_size, lengths, chunk_tokens=16, codec="zstd", seed=0, files=...)`, the
    files as `FileOptions` lay them out.

    Each store is written and converted (in this process) once per session; a name returns the same store.
    """
    import h5feed
    from h5feed.testing.synthetic import FileOptions, sample_lengths, write_synthetic

    made: dict[str, SyntheticStore] = {}

    def make(name: str, fmt: str, n: int, hidden_size: int, lengths: Any, chunk_tokens: int = 16,
             codec: str = "zstd", seed: int = 0, files: FileOptions = FileOptions()) -> SyntheticStore:
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            files = write_synthetic(root / "src", fmt, n, hidden_size, lengths=lengths, seed=seed, files=files)
            h5feed.convert(root / "src", root / "store", workers=0, progress=False,
                           settings=h5feed.StoreSettings(chunk_tokens=chunk_tokens, codec=codec))
            made[name] = SyntheticStore(root / "src", files, root / "store", sample_lengths(n, lengths, seed))
        return made[name]

    return make


def inner_chunk_span(store_path: Path, sample: int, array: str, chunk: int) -> tuple[Path, int, int]:
    """(shard file, offset, length) of inner chunk `chunk` (counted within the sample) of a format-2 store,
    read from the shard's own index, so tests can damage exactly the bytes of one chunk."""
    from h5feed.store import Store
    from h5feed.store.layout import decode_shard_index, object_key, shard_index_nbytes

    store = Store(store_path)
    info = store.info
    per = info.chunks_per_shard
    shard = int(store.sample_starts[sample]) // info.shard_tokens + chunk // per
    path = Path(store_path) / object_key(info, array, shard)
    data = path.read_bytes()
    index = decode_shard_index(data[-shard_index_nbytes(per):], per, len(data))
    offset, length = (int(x) for x in index[chunk % per])
    return path, offset, length


@pytest.fixture
def flip_byte() -> Callable[..., Path]:
    """Flip one byte at `at` inside inner chunk `chunk` of sample `sample`'s `array`; returns the shard's path."""

    def flip(store_path: Path, sample: int, array: str = "aux_hidden_states", chunk: int = 0, at: int = 100) -> Path:
        path, offset, length = inner_chunk_span(store_path, sample, array, chunk)
        assert at < length - 4, "inside the chunk's frame, not its checksum"
        data = bytearray(path.read_bytes())
        data[offset + at] ^= 0xFF
        path.write_bytes(bytes(data))
        return path

    return flip


# --- exact comparison of trainer batches --------------------------------------------------------------


@pytest.fixture
def assert_same_batch() -> Callable[[dict[str, Any], dict[str, Any]], None]:
    """Two batches hold the same keys in the same order, every tensor equal bit for bit, same dtype and shape."""
    return lambda got, want: assert_same(got, want, "batch")


# --- torchrun launches: a test file that is also the ranks' script ---------------------------------

LAUNCH_TIMEOUT_S = 300  # a bound against hangs; a loaded 2-core machine takes 30-120 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, ranks: int, *args: Any, timeout: float = LAUNCH_TIMEOUT_S) -> None:
    """`torchrun --nproc-per-node RANKS` of `script` (gloo on loopback); killed whole if it hangs, as a rank short
    of a step at DDP's all-reduce would."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0", str(script), *map(str, args)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(TESTS)]), "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo"}  # the script imports this checkout's h5feed, and conftest as the tests do
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"torchrun of {ranks} ranks hung for {timeout} s:\n{output[-4000:]}") from None
    assert proc.returncode == 0, output[-4000:]


class SlowDataset(torch.utils.data.Dataset):
    """Each item takes `delay` seconds, counted in h5feed's shared counters as h5feed's datasets count theirs: as
    reading (`stage="read"`) or as decoding ("decode")."""

    def __init__(self, n: int, delay: float, stage: str = "read") -> None:
        from h5feed.observe.metrics import LoaderCounters

        self.n, self.delay, self.stage = n, delay, stage
        self.counters = LoaderCounters()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        counters = self.counters.worker()
        counters.begin_sample(i)
        time.sleep(self.delay)
        if self.stage == "read":
            counters.add_read(1_000_000, self.delay)
        else:
            counters.add_read(1_000_000, 0.0)
            counters.add_decode(self.delay)
        counters.end_sample(i, 100)
        return torch.zeros(1000)


def _options_of(kwargs: dict[str, Any], *kinds: type) -> list[dict[str, Any]]:
    """`kwargs` split by the option objects whose fields they are (popped from `kwargs`), one dict per kind."""
    from dataclasses import fields

    return [{name: kwargs.pop(name) for name in [f.name for f in fields(kind)] if name in kwargs} for kind in kinds]


def make_stream(store: Any, flavor: str = "speculators", max_len: int | None = None, **kwargs: Any) -> Any:
    """The tests' shorthand for a `HiddenStatesStream`: loose keyword arguments (seed=, rank=, threads=,
    storage_options=, ...) each put into its option object by the field it names; the rest passed as they are."""
    from h5feed import HiddenStatesStream, ReadOptions, ScheduleOptions, StoreOptions

    schedule, reading, where = _options_of(kwargs, ScheduleOptions, ReadOptions, StoreOptions)
    where.pop("location", None)
    return HiddenStatesStream(StoreOptions(store, **where) if where else store, flavor, max_len,
                              schedule=ScheduleOptions(**schedule), reading=ReadOptions(**reading), **kwargs)


def make_batch_loader(data: Any, **kwargs: Any) -> Any:
    """The tests' shorthand for a `BatchLoader`: schedule and store arguments into their option objects, and the
    backend's own (threads=, prefetch=, decode_group=, ...) into the options of the backend they name (decode="cuda":
    the GPU decoder's; num_workers > 0: the worker processes'; else the reader threads')."""
    from h5feed import BatchLoader, CudaOptions, ScheduleOptions, StoreOptions, ThreadsOptions, WorkersOptions

    schedule, where = _options_of(kwargs, ScheduleOptions, StoreOptions)
    where.pop("location", None)
    decode = kwargs.pop("decode", "cpu")
    backend = CudaOptions if decode == "cuda" else WorkersOptions if kwargs.get("num_workers") else ThreadsOptions
    if isinstance(decode, str) and decode != "auto":
        own = _options_of(kwargs, backend)[0]
        others = _options_of(kwargs, WorkersOptions, ThreadsOptions, CudaOptions)  # another backend's: not used
        kwargs.update({name: value for kind in others for name, value in kind.items() if name in ("num_workers",
                                                                                                  "device")})
        if own.keys() - {"num_workers", "device"}:
            if not kwargs.pop("num_workers", 0) or backend is WorkersOptions:  # 0: threads, as BatchLoader reads it
                decode = backend(**own)
        else:
            kwargs.update(own)
    return BatchLoader(StoreOptions(data, **where) if where else data, decode=decode,
                       schedule=ScheduleOptions(**schedule) if schedule else None, **kwargs)


# --- code that runs when unpickled: what torch.load(weights_only=True) must refuse ------------------------------


class NeedsCode:
    """A class that torch.load(weights_only=True) must refuse to build."""

    def __init__(self) -> None:
        self.x = 1


class RunsShell:
    """Unpickling it runs a shell command through os.system (posix.system)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class RunsEval(RunsShell):
    """Unpickling it evaluates Python source (builtins.eval)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


# --- objects in a bucket -------------------------------------------------------------------------------------


def bucket_objects(s3: S3, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object under the prefix, read straight from moto (not through the proxy), by key relative to it."""
    keys = []
    for page in s3.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return {k[len(prefix) + 1:]: s3.client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in sorted(keys)}


# --- the trainers' released collates, restated on their own items without h5feed -----------------------------


def modelopt_collate(features: list[dict[str, Any]], train_len: int) -> dict[str, Any]:
    """Model-Optimizer `EagleOfflineDataCollator(train_len).__call__`."""

    def pad_or_truncate(x: torch.Tensor, length: int) -> torch.Tensor:
        out = x.new_zeros([length, *x.shape[1:]])
        out[: min(length, x.size(0))] = x[: min(length, x.size(0))]
        return out

    batch = {k: torch.stack([pad_or_truncate(f[k], train_len) for f in features])
             for k in ["input_ids", "attention_mask", "loss_mask", "labels"]}
    outputs: dict[str, Any] = {k: torch.stack([pad_or_truncate(f[k], train_len) for f in features])
                               for k in ["base_model_hidden_states", "aux_hidden_states"]}
    if "base_hidden_prenorm" in features[0]:
        flags = {bool(f["base_hidden_prenorm"]) for f in features}
        assert len(flags) == 1
        outputs["base_hidden_prenorm"] = flags.pop()
    return {**batch, "base_model_outputs": outputs}


def angelslim_collate(features: list[dict[str, Any]]) -> dict[str, Any]:
    """AngelSlim `DataCollatorWithPadding.__call__` with `paddingtensor2D` / `paddingtensor` (data_utils.py)."""
    n = max(f["input_ids"].shape[1] for f in features)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t, torch.zeros(t.shape[0], n - t.shape[1], *t.shape[2:], dtype=t.dtype)), dim=1)

    batch: dict[str, Any] = {k: torch.cat([pad(f[k]) for f in features]) for k in ("input_ids", "attention_mask", "loss_mask")}
    batch["hidden_states"] = batch["target_hiddens"] = None
    for key in ("hidden_states", "target_hiddens"):
        if all(key in f for f in features):
            batch[key] = torch.cat([pad(f[key]) for f in features])
    return batch


def nemo_collate(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """NeMo Automodel `_collate_cached` (stack of CACHE_KEYS)."""
    keys = ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "position_mask", "target_probs")
    return {key: torch.stack([f[key] for f in features], dim=0) for key in keys}


def restated_collate(flavor: str, max_len: int | None) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """The released collate of the trainer that `flavor` (Model-Optimizer, AngelSlim or NeMo) stands for."""
    if flavor.startswith("modelopt"):
        return lambda items: modelopt_collate(items, max_len)
    return angelslim_collate if flavor == "angelslim" else nemo_collate


def speculators_shift_batch(batch: dict[str, torch.Tensor], clamp: bool = False) -> dict[str, torch.Tensor]:
    """speculators' `shift_batch` (0.4 `train/data.py`, 0.9 `models/eagle3/data.py`): the tokens one ahead of the
    states; 0.9 clamps `lengths` at 0, 0.4/0.5 do not."""
    lengths = batch["lengths"] - 1
    return {
        "input_ids": batch["input_ids"][1:],
        "hidden_states": batch["hidden_states"][:-1],
        "verifier_last_hidden_states": batch["verifier_last_hidden_states"][1:],
        "loss_mask": batch["loss_mask"][1:],
        "lengths": torch.clamp(lengths, min=0) if clamp else lengths,
        "position_ids": batch["position_ids"][1:],
    }


def speculators_04_collate(max_len: int, preprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None
                           ) -> Callable[[list[dict[str, Any] | None]], dict[str, Any]]:
    """speculators 0.4 `create_collate_fn(max_len)`, as `h5feed bench`'s baseline restates it (speculators 0.4
    cannot be installed beside 0.9); with `preprocess` the 0.5 one (None items dropped first)."""
    from h5feed.testing.baseline import create_collate_fn

    collate = create_collate_fn(max_len)

    def collate_fn(batch: list[dict[str, Any] | None]) -> dict[str, Any]:
        items = [b for b in batch if b is not None]
        return collate([preprocess(b) for b in items] if preprocess is not None else items)

    return collate_fn


# --- stores of Model-Optimizer's, AngelSlim's and NeMo Automodel's files, and their trainers' batches ---------

PIPELINE_H, PIPELINE_K, PIPELINE_CHUNK = 32, 3, 8
PIPELINE_LENGTHS = [6, 30, 11, 25, 9, 17, 3, 28]  # below and past every train_len used with them
# store name: (format, variant, --last-state-norm)
PIPELINE_STORES = {
    "modelopt-hf": ("modelopt-pt", "hf", "post"),
    "modelopt-vllm": ("modelopt-pt", "vllm", "pre"),  # base_hidden_prenorm True
    "angelslim-hf": ("angelslim-ckpt", "hf", None),
    "angelslim-vllm": ("angelslim-ckpt", "vllm", "post"),  # inputs_embeds, position_ids: not batched
    "nemo-full": ("nemo-eagle3-cache", "full", None),
    "nemo-topk": ("nemo-eagle3-cache", "topk", None),  # values and indices scattered back
}
# (store, flavor, max_len): every flavor of those trainers
PIPELINE_CASES = [
    ("modelopt-hf", "modelopt", 12),
    ("modelopt-hf", "modelopt", 40),
    ("modelopt-hf", "modelopt-answer-only", 12),
    ("modelopt-hf", "modelopt-0.45", 28),
    ("modelopt-vllm", "modelopt", 25),
    ("angelslim-hf", "angelslim", None),
    ("angelslim-vllm", "angelslim", None),
    ("nemo-full", "nemo-eagle3", None),
    ("nemo-topk", "nemo-eagle3", None),
]
PIPELINE_CASE_IDS = [f"{flavor}-{store}-{max_len}" for store, flavor, max_len in PIPELINE_CASES]


@pytest.fixture(scope="module")
def pipeline_store(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`pipeline_store(name)` -> the path of the store converted from synthetic files of that pipeline (made once
    a module)."""
    import h5feed
    from h5feed.testing.synthetic import PipelineOptions, write_synthetic

    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            fmt, variant, norm = PIPELINE_STORES[name]
            root = tmp_path_factory.mktemp(name)
            write_synthetic(root / "src", fmt, len(PIPELINE_LENGTHS), PIPELINE_H, PIPELINE_K, lengths=PIPELINE_LENGTHS,
                            seed=11, pipeline=PipelineOptions(variant=variant))
            h5feed.convert(root / "src", root / "store", workers=0, progress=False,
                           settings=h5feed.StoreSettings(chunk_tokens=PIPELINE_CHUNK, last_state_norm=norm))
            made[name] = root / "store"
        return made[name]

    return make


def pipeline_reference(path: Path, flavor: str, max_len: int | None, batch_size: int, epoch: int = 0,
                       **schedule: Any) -> list[Any]:
    """What the trainer gets from a DataLoader over the flavor's items with its own released collate."""
    import h5feed

    stream = h5feed.HiddenStatesStream(path, flavor, max_len, schedule=h5feed.ScheduleOptions(**schedule))
    stream.set_epoch(epoch)
    return list(h5feed.StreamLoader(stream, batch_size=batch_size, collate_fn=restated_collate(flavor, max_len)))


# --- BatchLoader's store of speculators' files -----------------------------------------------------------------

BATCH_H = 32
# 1-token samples, chunk-sized ones (16), samples past every max_len used with it
BATCH_LENGTHS = [1, 5, 16, 17, 33, 64, 100, 3, 48, 31, 2, 90, 16, 7]


@pytest.fixture(scope="module")
def batch_loader_store(synthetic_store: Callable[..., SyntheticStore]) -> SyntheticStore:
    return synthetic_store("ba_legacy", "speculators-legacy-pt", len(BATCH_LENGTHS), BATCH_H, BATCH_LENGTHS,
                           chunk_tokens=16, seed=7)


# --- a store with damaged samples beside a sound conversion of the same files; a worker killed ----------------

DAMAGE_H, DAMAGE_CHUNK = 32, 16
DAMAGE_LENGTHS = [20, 35, 40, 8, 33, 17, 5, 48, 26, 12, 3, 30]  # distinct: a sample is known by its length
DAMAGED = (2, 7, 8)  # one flipped byte each, in a chunk every flavor used with them reads
DAMAGE_FLAVOR, DAMAGE_MAX_LEN = "speculators", 40


def _converted_damage_sources(root: Path, name: str) -> Path:
    from h5feed import StoreSettings, convert
    from h5feed.testing.synthetic import write_synthetic

    src = root / "src"
    if not src.exists():
        write_synthetic(src, "speculators-legacy-pt", len(DAMAGE_LENGTHS), DAMAGE_H, lengths=DAMAGE_LENGTHS, seed=5)
    convert(src, root / name, workers=0, progress=False, settings=StoreSettings(chunk_tokens=DAMAGE_CHUNK))
    return root / name


@pytest.fixture(scope="module")
def damaged_and_sound(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(damaged, sound): two conversions of the same files, samples DAMAGED flipped in the first."""
    root = tmp_path_factory.mktemp("loader_trust")
    damaged, sound = _converted_damage_sources(root, "damaged"), _converted_damage_sources(root, "sound")
    for sample in DAMAGED:
        path, offset, length = inner_chunk_span(damaged, sample, "aux_hidden_states", 0)
        data = bytearray(path.read_bytes())
        data[offset + length // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    return damaged, sound


def _hold_sample(target_length: int, read: Callable[..., Any]) -> Callable[..., Any]:
    """`read`, made to wait (as on a stalled disk) on the sample with this many tokens."""

    def held(store: Store, i: int, *args: Any, **kwargs: Any) -> Any:
        if int(store.sample_lengths[i]) == target_length:
            time.sleep(60)
        return read(store, i, *args, **kwargs)

    return held


def _kill_when_reading(counters: Any, sample: int, killed: list[tuple[int, int]]) -> threading.Thread:
    """A thread that SIGKILLs the worker once its counters show it reading `sample`, as the OOM killer would."""

    def run() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for worker in counters.snapshot().workers:
                if worker.current_sample == sample and worker.pid:
                    killed.append((worker.worker, worker.pid))
                    os.kill(worker.pid, signal.SIGKILL)
                    return
            time.sleep(0.01)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def assert_a_killed_worker_is_named(monkeypatch: pytest.MonkeyPatch, sound: Path, read: str,
                                    make_loader: Callable[[Any], Any]) -> None:
    """A worker SIGKILLed while it reads a sample (held in `Store.<read>`) raises a WorkerDiedError naming the worker,
    its pid and the sample, within 20 s, for the loader `make_loader(stream)` makes."""
    import h5feed
    from h5feed.errors import WorkerDiedError
    from h5feed.store import Store

    victim = 5
    monkeypatch.setattr(Store, read, _hold_sample(DAMAGE_LENGTHS[victim], getattr(Store, read)))
    stream = h5feed.HiddenStatesStream(sound, DAMAGE_FLAVOR, DAMAGE_MAX_LEN,
                                       schedule=h5feed.ScheduleOptions(shuffle=False),
                                       reading=h5feed.ReadOptions(prefetch=0))
    loader = make_loader(stream)
    killed: list[tuple[int, int]] = []
    killer = _kill_when_reading(stream.counters, victim, killed)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError) as error:
        for _ in loader:
            pass
    killer.join()
    [(worker, pid)] = killed
    assert worker == victim % 2 and time.monotonic() - started < 20
    assert (error.value.worker, error.value.pid, error.value.sample) == (worker, pid, victim)
    assert str(error.value) == (
        f"{sound}: DataLoader worker {worker} (pid {pid}) was killed by SIGKILL while reading sample {victim} "
        f"(converted from data_{victim}.pt); something outside h5feed ended it (often the kernel's out-of-memory "
        "killer: see `dmesg`); continue from the last state_dict() in a new loader")


# --- several writers' samples, each known by its name ------------------------------------------------------------

WRITER_H, WRITER_K, WRITER_CHUNK, WRITER_SHARD, WRITER_BLOCK = 32, 2, 16, 64, 2
WRITER_LENGTHS = ((5, 20), (60, 140), (1, 64), (30, 200))  # writer w's samples: some span two or four shards
WRITER_PUBLISH_EVERY = (1, 3, 5, 2)
SPAWN = multiprocessing.get_context("spawn")


def name_of(w: int, i: int) -> str:
    return f"w{w}-{i}"


def make_sample(w: int, i: int) -> dict[str, Any]:
    """Writer w's sample i, the same in every process."""
    g = torch.Generator().manual_seed(1000 * w + i)
    low, high = WRITER_LENGTHS[w]
    t = int(torch.randint(low, high + 1, (1,), generator=g))
    return {"input_ids": torch.randint(0, 50000, (t,), generator=g),
            "hidden_states": [torch.randn(t, WRITER_H, generator=g).bfloat16() for _ in range(WRITER_K + 1)],
            "loss_mask": torch.randint(0, 2, (t,), generator=g)}


def writer_options(w: int) -> dict[str, Any]:
    """Writer w's `open_writer` settings and writing options (it publishes every WRITER_PUBLISH_EVERY[w] samples)."""
    from h5feed import StoreSettings, WriteOptions

    return {"settings": StoreSettings(chunk_tokens=WRITER_CHUNK, shard_tokens=WRITER_SHARD),
            "writing": WriteOptions(block_shards=WRITER_BLOCK, publish_every=WRITER_PUBLISH_EVERY[w])}


def join_all(processes: dict[int, multiprocessing.Process]) -> None:
    for w, process in processes.items():
        process.join(300)
        assert process.exitcode == 0, f"writer w{w} exited with {process.exitcode}"


def check_sample(store: Store, j: int) -> str:
    """Store sample j is exactly the sample appended under its name; returns the name."""
    name = store.source_paths[j]
    w, i = (int(x) for x in name.removeprefix("w").split("-"))
    want, got = make_sample(w, i), store.read_sample(j)
    assert torch.equal(got.input_ids, want["input_ids"]), name
    assert torch.equal(got.loss_mask, want["loss_mask"]), name
    assert torch.equal(got.aux_hidden_states, torch.cat(want["hidden_states"][:-1], dim=1)), name
    assert torch.equal(got.last_hidden_state, want["hidden_states"][-1]), name
    assert int(store.source_indices[j]) == i
    return name


# --- a writer in a process of its own that crashes, and is restarted --------------------------------------------

SAFETY_S = 60.0  # an idle bound so that a regression ends a test instead of hanging it; no test waits for it
CRASHED = r"writer 'w0' \(host [^,]+, pid \d+, started at [^)]+\) went away without closing"
CRASHING_WRITER = """
import json, sys, time, torch, h5feed
store, source, options, ready, upto, unpublished, end = sys.argv[1:]
samples = torch.load(source, weights_only=True)
w = h5feed.open_writer(store, writer="w0", settings=h5feed.StoreSettings(chunk_tokens=16, shard_tokens=64),
                      writing=h5feed.WriteOptions(publish_every=1000), bucket=h5feed.BucketOptions(**json.loads(options)))
for i in range(w.report.samples, int(upto)):  # a restarted writer resumes after what it journaled
    w.append(samples[i], name=f"data_{i}.pt")
    if i + 1 == int(upto) - int(unpublished):
        w.publish()
open(ready, "w").close()
if end == "close":
    w.close()
else:
    time.sleep(600)  # until killed
"""


def writer_process(store: str | Path, tmp_path: Path, samples: list[dict[str, Any]], upto: int, unpublished: int = 0,
                   end: str = "hang", options: dict[str, Any] | None = None) -> subprocess.Popen[bytes]:
    """Writer 'w0' in a process of its own: appends samples up to `upto` (after what it journaled before), the last
    `unpublished` of them journaled but not published, then hangs until killed (or, `end="close"`, closes).
    `options`: its `BucketOptions` (storage_options, staging_dir), for a store in a bucket."""
    source, ready = tmp_path / "samples.pt", tmp_path / f"ready-{time.monotonic_ns()}"
    if not source.exists():
        torch.save(samples, source)
    process = subprocess.Popen([sys.executable, "-c", CRASHING_WRITER, str(store), str(source),
                                json.dumps(options or {}), str(ready), str(upto), str(unpublished), end],
                               env=CHECKOUT_ENV)
    deadline = time.monotonic() + SAFETY_S
    while not ready.exists():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    return process


def kill_9(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGKILL)
    assert process.wait(SAFETY_S) == -signal.SIGKILL  # reaped: its pid no longer runs


def restarted_once_seen_gone(caplog: pytest.LogCaptureFixture, store: str | Path, tmp_path: Path,
                             samples: list[dict[str, Any]], options: dict[str, Any] | None = None) -> threading.Thread:
    """Writer 'w0' restarted (resuming what it journaled, appending the rest, closing) once a follower has said
    that it went away: in a thread, started."""
    caplog.set_level("WARNING", logger="h5feed")

    def restart() -> None:
        deadline = time.monotonic() + SAFETY_S
        while "went away without closing" not in caplog.text:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert writer_process(store, tmp_path, samples, len(samples), end="close",
                              options=options).wait(SAFETY_S) == 0

    thread = threading.Thread(target=restart)
    thread.start()
    return thread


# --- SpecForge 0.2's offline captures, as each of its algorithms saves them -------------------------------------

CAPTURE_H, CAPTURE_K = 16, 5  # five captured layers, as SpecForge's shipped DFlash configs capture
EAGLE3_LAYERS = 3  # EAGLE-3's draft reads three (its fc is 3*H wide)
CAPTURE_LENGTHS = (7, 12, 9, 15, 6, 11, 8, 13, 10, 14, 5, 16)  # twelve files: data_10 sorts before data_2 as paths


def supervised_mask(t: int, g: torch.Generator) -> torch.Tensor:
    """A loss mask with some unsupervised tokens and at least two supervised ones in a row (DFlash needs them)."""
    mask = (torch.rand(t, generator=g) > 0.3).to(torch.int64)
    mask[-3:-1] = 1
    return mask


def eagle3_dict(t: int, seed: int) -> dict[str, torch.Tensor]:
    """What SpecForge's EAGLE-3 capture saves: three aux layers [1, T, 3*H] and the post-norm last state."""
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 1000, (t,), generator=g), "loss_mask": supervised_mask(t, g),
            "aux_hidden_state": torch.randn(1, t, EAGLE3_LAYERS * CAPTURE_H, generator=g).to(torch.bfloat16),
            "hidden_state": torch.randn(1, t, CAPTURE_H, generator=g).to(torch.bfloat16)}


def dflash_dict(t: int, seed: int) -> dict[str, torch.Tensor]:
    """What SpecForge's DFlash / Domino capture saves: the captured layers concatenated, no last state."""
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 1000, (t,), generator=g), "loss_mask": supervised_mask(t, g),
            "hidden_states": torch.randn(1, t, CAPTURE_K * CAPTURE_H, generator=g).to(torch.bfloat16)}


def dspark_dict(t: int, seed: int) -> dict[str, torch.Tensor]:
    """DSpark's: DFlash's keys and the post-norm last state."""
    d = dflash_dict(t, seed)
    d["target_last_hidden_states"] = torch.randn(1, t, CAPTURE_H, generator=torch.Generator().manual_seed(seed + 99)
                                                 ).to(torch.bfloat16)
    return d


CAPTURES = {"eagle3": eagle3_dict, "dflash": dflash_dict, "domino": dflash_dict, "dspark": dspark_dict}


def write_capture(root: Path, algorithm: str, lengths: tuple[int, ...] = CAPTURE_LENGTHS, compress: bool = False,
                  config: dict[str, Any] | None = None) -> list[dict[str, torch.Tensor]]:
    """SpecForge's layout: rows_{g}-{g+2000}/data_{i}.ckpt (here 8 files a folder, to have two folders), gzipped
    with compress; the DFlash family's folder gets the verifier's config.json (`config`, default its hidden_size)."""
    samples = [CAPTURES[algorithm](t, seed=i) for i, t in enumerate(lengths)]
    for i, d in enumerate(samples):
        folder = root / f"rows_{i // 8 * 2000}-{i // 8 * 2000 + 2000}"
        folder.mkdir(parents=True, exist_ok=True)
        if compress:
            buffer = io.BytesIO()
            torch.save(d, buffer)
            (folder / f"data_{i}.ckpt.gz").write_bytes(gzip.compress(buffer.getvalue()))
        else:
            torch.save(d, folder / f"data_{i}.ckpt")
    if algorithm in ("dflash", "domino"):
        (root / "config.json").write_text(json.dumps(config if config is not None else {"hidden_size": CAPTURE_H}))
    return samples


def specforge_provider(algorithm: str) -> Any:
    """The installed SpecForge's offline data provider of `algorithm` (its reader, normalizer and collator)."""
    from specforge.algorithms.builtin import builtin_algorithm_registry

    return builtin_algorithm_registry().resolve(algorithm).providers.offline_for("text")
