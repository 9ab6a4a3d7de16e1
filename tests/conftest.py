"""Fixtures shared by the tests.

The expected tensors are read from the source files the way each trainer's own code
describes, without h5feed, so a reader bug in h5feed cannot hide itself.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from h5feed.store.journal import JournalRecord


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
    """The raw bits of a float tensor, so equality is exact (NaN == NaN, -0 != +0)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


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


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.fixture
def assert_same_tree() -> Callable[[Path, Path], None]:
    """Two stores hold the same files with the same bytes, nothing excluded."""

    def check(a: Path, b: Path) -> None:
        ta, tb = _tree(a), _tree(b)
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


# --- synthetic stores, shared by test_datasets.py and test_stream.py --------------------------


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


# --- exact comparison of trainer batches, shared by test_collate.py, test_batching.py and test_examples.py ----


def _assert_same_value(got: Any, want: Any, what: str) -> None:
    if not isinstance(want, torch.Tensor):
        assert type(got) is type(want) and got == want, (what, got, want)
        return
    assert isinstance(got, torch.Tensor), what
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    if got.dtype.is_floating_point:  # compare bits: exact, NaN-safe, -0 != +0
        got, want = bits(got), bits(want)
    assert torch.equal(got, want), f"{what} differs"


@pytest.fixture
def assert_same_batch() -> Callable[[dict[str, Any], dict[str, Any]], None]:
    """Two batches hold the same keys in the same order, every tensor equal bit for bit, same dtype and shape."""

    def check(got: dict[str, Any], want: dict[str, Any]) -> None:
        assert list(got) == list(want), "keys or key order differ"
        for key, value in want.items():
            _assert_same_value(got[key], value, key)

    return check


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
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo"}
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
