"""`h5feed bench` with a training step: the step runs on every batch each loader yields, is timed alone, and the
loaders are ranked by the trainer's samples/s against it.  On the CPU (no GPU in CI): the step's device is given.

No timings are asserted: the calls, the batches the step saw, the figures' arithmetic and the ranking are."""

from __future__ import annotations

import sys

import pytest
import torch

import h5feed
from h5feed import trainer_collate
from h5feed.bench import Passes, StepOptions, run_bench
from h5feed.bench.loaders import BASELINE, ITEMS, SHORT_LABELS, USABLE, digest
from h5feed.bench.report import STEP_COLUMNS, BenchResult, PassResult
from h5feed.bench.runner import STEP_ALONE_STEPS
from h5feed.bench.step import DrafterStep, Shape, StepAlone, training_step
from h5feed.cli import main
from h5feed.errors import H5feedError
from h5feed.loading.datasets import HiddenStatesStream, StreamLoader
from h5feed.store import Store

H, K = 64, 3
LENGTHS = (30, 60)
MAX_LEN = 48
LOADERS = (BASELINE, "BatchLoader", "BatchLoader-threads")  # and the item path, on which no step runs

STEP_MODULE = '''
import torch

SEEN = []  # each call's batch, as digests


def make(store, device):
    from h5feed.bench.loaders import digest
    weight = torch.ones(store.hidden_size * store.num_aux_layers, 4, device=device)

    def step(batch):
        SEEN.append(digest(batch))
        (batch["hidden_states"].to(device).float() @ weight).sum().item()

    return step


def not_a_step(store, device):
    return 42
'''


@pytest.fixture(scope="module")
def tiny(synthetic_store):
    return synthetic_store("bench-step", "speculators-legacy-pt", 4, H, LENGTHS, chunk_tokens=16)


@pytest.fixture
def user_step(tmp_path, monkeypatch):
    """A user's step module on sys.path: `bench_user_step:make` records the digest of every batch it is given."""
    (tmp_path / "bench_user_step.py").write_text(STEP_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bench_user_step", raising=False)
    import bench_user_step

    return bench_user_step


def test_the_step_runs_on_every_batch_of_every_loader_and_ranks_them(tiny, user_step) -> None:
    result = run_bench(tiny.path, workers=2, max_len=MAX_LEN, passes=Passes((*LOADERS, ITEMS), cold=False),
                       progress=False, step=StepOptions("bench_user_step:make", device="cpu"))
    n = len(tiny.files)
    assert result.step is not None and result.step.name == "bench_user_step:make" and result.step.device == "CPU"
    assert result.step_after is not None and result.step_after.name == result.step.name
    # warm-up and the step alone (both on the first batch), every batch of each loader's timed pass, then the
    # warm-up and the step alone again
    timed_alone = 3 + STEP_ALONE_STEPS
    assert len(user_step.SEEN) == 2 * timed_alone + n * len(LOADERS)
    alone = user_step.SEEN[:timed_alone] + user_step.SEEN[-timed_alone:]
    passes = user_step.SEEN[timed_alone:-timed_alone]
    collate = trainer_collate("speculators-legacy", MAX_LEN, hidden_states_dtype=torch.bfloat16)
    stream = HiddenStatesStream(tiny.path, "speculators-legacy", MAX_LEN, hidden_states_dtype=torch.bfloat16,
                                schedule=h5feed.ScheduleOptions(shuffle=False))
    want = [digest(b) for b in StreamLoader(stream, batch_size=1, collate_fn=collate)]
    assert alone == [want[0]] * len(alone)
    assert [passes[i * n:(i + 1) * n] for i in range(len(LOADERS))] == [want] * len(LOADERS)
    items = result.passes.pop()
    assert items.loader == ITEMS and items.step_share is None  # no step ran on items: no trainer takes them
    for p in result.passes:
        assert p.step_share == pytest.approx(p.samples_per_s * result.step.seconds)
        assert 0 < p.first_batch_s < p.seconds
        assert p.running_share == pytest.approx(p.samples * result.step.seconds / (p.seconds - p.first_batch_s))
        assert 0 < p.data_wait < 1 and p.next_median_ms > 0
        # the step's own time beside the loader, its wait for data left out: every step fits in the pass
        assert 0 < p.step_mean_ms * 1e-3 * p.samples < p.seconds * (1 - p.data_wait)
        assert p.step_slowdown == pytest.approx(p.step_mean_ms / (1e3 * result.step.seconds))
        assert p.gpu_decode_ms_per_sample == 0.0  # these loaders decode on the CPU
        assert p.loader_cores == pytest.approx(
            max(0.0, p.cpu_seconds - result.step.cpu_seconds * p.samples) / p.seconds)
    table = result.table()
    assert "training step: bench_user_step:make, run on every batch" in table
    assert result.rows()[0] == [f"peak mem ({result.memory_metric.upper()})" if c == "peak mem" else c
                                for c in STEP_COLUMNS]
    best = result.fastest()
    assert best in LOADERS[1:]
    assert result.recommendation().startswith(f"Best for this training step here: {SHORT_LABELS[best]}: ")
    assert not any("no GPU here" in note for note in result.notes)


def test_without_a_step_device_no_step_runs_and_the_notes_say_so(tiny, user_step) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the step runs on the GPU")
    result = run_bench(tiny.path, workers=0, max_len=MAX_LEN, passes=Passes(("BatchLoader-threads",), cold=False),
                       progress=False, step=StepOptions("bench_user_step:make"))
    assert result.step is None and user_step.SEEN == []
    assert any(note.startswith("no GPU here: no training step ran") for note in result.notes)
    assert all(p.step_share is None for p in result.passes)


@pytest.mark.parametrize(("name", "error"), [
    ("no_such_module_h5feed:make", r"--step no_such_module_h5feed:make: cannot import it \(No module named"),
    ("bench_user_step:missing", r"--step bench_user_step:missing: cannot import it"),
    ("bench_user_step", r"--step bench_user_step: give 'drafter' or your step's maker as package.module:function"),
    ("bench_user_step:not_a_step", r"not_a_step\(store, device\) returned int, not a callable"),
])
def test_a_step_that_cannot_be_had_is_a_clear_error(tiny, user_step, name: str, error: str) -> None:
    with pytest.raises(H5feedError, match=error):
        training_step(name, Store(tiny.path), torch.device("cpu"))


def test_the_cli_leaves_the_step_out_with_none(tiny, capsys) -> None:
    rc = main(["-q", "bench", str(tiny.path), "--workers", "0", "--max-len", str(MAX_LEN), "--no-cold",
               "--loaders", "BatchLoader-threads", "--step", "none"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "training step: none" in out and "no GPU here" not in out


@pytest.mark.parametrize(("flavor", "source"), [("speculators-legacy", "speculators-legacy-pt"),
                                                ("specforge", "specforge-ckpt"), ("modelopt", "speculators-legacy-pt")])
def test_the_representative_step_trains_on_each_flavors_batches(synthetic_store, flavor: str, source: str) -> None:
    made = synthetic_store(f"bench-step-{source}", source, 2, H, LENGTHS, chunk_tokens=16)
    store = Store(made.path)
    stream = HiddenStatesStream(store, flavor, MAX_LEN, hidden_states_dtype=torch.float32,
                                schedule=h5feed.ScheduleOptions(shuffle=False))
    batch = next(iter(StreamLoader(stream, batch_size=1, collate_fn=trainer_collate(flavor, MAX_LEN,
                                                                                     hidden_states_dtype=torch.float32))))
    torch.manual_seed(0)
    step = DrafterStep(Shape.for_hidden(H, K), torch.device("cpu"))
    before = step.model.fc.weight.detach().clone()
    losses = [float(step(batch)) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]  # it trains: the loss falls
    assert not torch.equal(step.model.fc.weight, before)


def test_the_representative_step_names_a_batch_it_cannot_take() -> None:
    step = DrafterStep(Shape.for_hidden(H, K), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"not one with the keys \['features'\]: pass your own step"):
        step({"features": torch.zeros(1, 4)})


def _pass(loader: str, cache: str, share: float, cores: float) -> PassResult:
    return PassResult(loader=loader, cache=cache, samples=10, seconds=1.0, samples_per_s=10.0, hidden_bytes=0,
                      gb_per_s=0.0, bytes_read=0, peak_memory_bytes=0, memory_metric="pss", step_share=share - 0.1,
                      first_batch_s=0.25, running_share=share, loader_cores=cores)


def test_the_advice_is_the_fastest_trainer_and_among_equals_the_fewest_cores() -> None:
    result = BenchResult(store="s", source_root="r", source_format="f", num_samples=10, num_tokens=100,
                         hidden_size=H, num_aux_layers=K, store_bytes=1, source_bytes=None, workers=4, max_len=64,
                         flavor="speculators-legacy", collate="c", hidden_states_dtype="bfloat16",
                         memory_metric="pss", cold=True, machine={},
                         step=StepAlone("drafter", "NVIDIA H200", 0.065, 0.01))
    result.passes = [
        _pass("BatchLoader", "cold", 0.992, 1.6), _pass("BatchLoader", "warm", 0.996, 1.9),  # mean 0.994
        _pass("BatchLoader-cuda", "cold", 0.990, 0.4), _pass("BatchLoader-cuda", "warm", 0.990, 0.4),  # 0.990
        _pass("BatchLoader-threads", "cold", 0.90, 1.0), _pass("BatchLoader-threads", "warm", 0.93, 1.0),
    ]
    result.checks = {"BatchLoader": "equal", "BatchLoader-cuda": "equal", "BatchLoader-threads": "equal"}
    assert result.ranking() == ("BatchLoader-cuda", ["BatchLoader"])  # within 1% of the best, on a quarter of the cores
    assert result.recommendation().splitlines()[1] == ("As good within the noise: BatchLoader, workers (within 1 "
                                                       "point of the step alone, on more cores).")
    result.passes[2] = _pass("BatchLoader-cuda", "cold", 0.95, 0.4)  # mean 0.97: slower, whatever its cores
    assert result.fastest() == "BatchLoader"
    advice = result.recommendation()
    assert advice.splitlines() == [
        "Best for this training step here: BatchLoader, workers: cold: 99.2% of the step alone once running, first "
        "batch after 0.25 s, 1.60 loader cores; warm: 99.6% of the step alone once running, first batch after 0.25 s, "
        "1.90 loader cores.",
        "To use it: " + USABLE["BatchLoader"].format(flavor="speculators-legacy", max_len=64, workers=4,
                                                     dtype="bfloat16", device=', device="cuda"'),
    ]
    result.checks["BatchLoader"] = "reference"  # with no baseline (an FP8 store) the first loader's batches are the
    assert result.fastest() == "BatchLoader"  # reference the others are checked against: it is as trusted
    result.checks["BatchLoader"] = "DIFFER: batch 3 (hidden_states)"  # never the advice
    assert result.fastest() == "BatchLoader-cuda"

