"""The training scripts in examples/ run at tiny shapes on the CPU, and their swap changes nothing but speed:
the tiny drafter sees the same batches, so BatchLoader and the DataLoader path give the same losses, bit for bit.

The trainers' own training loops cannot run here: speculators' `Trainer` (0.4 and 0.9) moves
model and batches to `local_rank`, a CUDA device, and its wheels pin other torch builds
(0.4: torch <= 2.10; 0.9: torchvision/torchaudio); SpecForge needs sglang.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
from conftest import REPO

H = 32
LENGTHS = [9, 40, 3, 25, 60, 17, 1]  # 7 samples: the last batch of each epoch is short


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pre_norm_store(synthetic_store):
    return synthetic_store("ex_legacy", "speculators-legacy-pt", len(LENGTHS), H, LENGTHS, chunk_tokens=16, seed=3).path


@pytest.fixture(scope="module")
def post_norm_store(synthetic_store):
    return synthetic_store("ex_specforge", "specforge-ckpt", len(LENGTHS), H, LENGTHS, chunk_tokens=16, seed=4).path


@pytest.mark.parametrize(("name", "kwargs"), [
    ("speculators_04", {"max_len": 48, "batch_size": 2, "noise_std": 0.0}),
    ("speculators_09", {"max_len": 48, "batch_size": 3}),
    ("specforge", {"max_len": 32, "batch_size": 2}),
    ("specforge", {"max_len": 32, "batch_size": 2, "flavor": "specforge-shifted"}),
])
def test_the_swap_gives_the_same_training(pre_norm_store, post_norm_store, name, kwargs):
    store = str(post_norm_store if name == "specforge" else pre_norm_store)
    train = example(name).train
    fast = train(store, loader="batch", steps=9, device="cpu", **kwargs)  # 9 steps: two epochs and a bit
    slow = train(store, loader="dataloader", steps=9, device="cpu", **kwargs)
    assert len(fast) == 9 and all(math.isfinite(loss) for loss in fast)
    assert fast == slow


def test_speculators_04_noise_goes_onto_the_batch(pre_norm_store):
    quiet = example("speculators_04").train(str(pre_norm_store), max_len=48, steps=3, noise_std=0.0, device="cpu")
    noisy = example("speculators_04").train(str(pre_norm_store), max_len=48, steps=3, noise_std=0.05, device="cpu")
    assert all(math.isfinite(loss) for loss in noisy) and noisy != quiet


def test_a_script_runs_as_users_run_it(pre_norm_store):
    """`python examples/speculators_04.py STORE --workers 2`: DataLoader worker processes, the script's own CLI."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "examples/speculators_04.py", str(pre_norm_store), "--max-len", "48",
                          "--workers", "2", "--steps", "4"], check=False, cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [line.split()[:2] for line in out.stdout.splitlines()] == [["step", str(i)] for i in range(4)]


def test_the_readmes_quickstart_runs_as_written(tmp_path, cli, monkeypatch):
    """The README's quickstart, its commands and its code, run on tiny synthetic files with only the paths
    changed; the batch has the keys its comment lists."""
    import re

    from h5feed.testing.synthetic import write_synthetic

    text = (REPO / "README.md").read_text()
    section = text.split("## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    shell, code = re.findall(r"```(?:bash|python)\n(.*?)```", section, re.DOTALL)
    paths = {"/data/hidden_states": str(tmp_path / "src"), "/data/hs.zarr": str(tmp_path / "hs.zarr"),
             "runs/drafter": str(tmp_path / "runs")}
    for old, new in paths.items():
        shell, code = shell.replace(old, new), code.replace(old, new)
    write_synthetic(tmp_path / "src", "speculators-legacy-pt", 5, H, lengths=(4, 40), seed=11)
    for line in shell.strip().splitlines():
        command = line.split("#", 1)[0].split()
        assert command[0] == "h5feed"
        result = cli(*command[1:])
        assert result.status == 0, (line, result.output)
    namespace: dict[str, object] = {}
    exec(compile(code, "README quickstart", "exec"), namespace)
    listed = re.search(r"\.\.\.  # (.*)", code).group(1).split(", ")
    assert sorted(namespace["batch"]) == sorted(listed)  # the last batch of the second epoch
    ends = [line for line in (tmp_path / "runs" / "h5feed-monitor-train.jsonl").read_text().splitlines()
            if '"kind": "end"' in line]
    assert len(ends) == 2  # one run, two epochs


def test_extraction_writes_straight_into_a_store_that_a_drafter_trains_on_meanwhile(tmp_path):
    """examples/extract_and_train.py: a Llama made here runs over prompts; each sample's stored states are the
    model's own (recomputed from the stored input_ids, bit for bit), and the drafter trained on every one."""
    import torch

    import h5feed

    module = example("extract_and_train")
    model = module.tiny_llama(32, 4, seed=1)
    done, losses = module.run(tmp_path / "hs.zarr", prompts=6, tokens=(8, 40), model=model, max_len=64)
    assert done.samples == 6 and len(losses) == 6 and all(math.isfinite(loss) for loss in losses)
    assert done.writer_seconds > 0 and done.model_seconds > 0
    store = h5feed.Store(tmp_path / "hs.zarr")
    assert len(store) == 6 and store.source_paths == [f"prompt-{i}" for i in range(6)]
    assert (store.info.hidden_size, store.info.num_aux_layers, store.info.last_state_norm) == (32, 3, "pre")
    captured = []
    hook = model.model.layers[-1].register_forward_hook(lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out))
    try:
        for i in range(len(store)):
            sample = store.read_sample(i)
            with torch.no_grad():
                out = model(input_ids=sample.input_ids[None], output_hidden_states=True)
            aux = torch.cat([out.hidden_states[layer][0] for layer in module.AUX_LAYERS], dim=-1)
            assert torch.equal(sample.aux_hidden_states, aux) and torch.equal(sample.last_hidden_state, captured.pop()[0])
    finally:
        hook.remove()


def test_extraction_without_transformers_says_what_to_install(tmp_path, monkeypatch):
    """Before a store is made, not as an import error from the middle of the example."""
    module = example("extract_and_train")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "transformers" else find_spec(name))
    monkeypatch.setattr(sys, "argv", ["extract_and_train.py", str(tmp_path / "hs.zarr")])
    with pytest.raises(SystemExit) as stopped:
        module.main()
    assert str(stopped.value) == ("extract_and_train.py: the model is made with transformers, which is not "
                                  "installed: pip install transformers")
    assert "(`pip install transformers`)" in module.__doc__
    assert not (tmp_path / "hs.zarr").exists()


def test_the_folder_that_holds_the_clone_imports_the_package(tmp_path):
    """A clone named h5feed, and Python started beside it: the package lives in src/, so the clone's own folder
    cannot stand in for it as an empty namespace package (which has no BatchLoader)."""
    assert (REPO / "src" / "h5feed" / "__init__.py").is_file() and not (REPO / "h5feed").exists()
    (tmp_path / "h5feed").symlink_to(REPO, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, "-c", "import h5feed; print(h5feed.__file__, h5feed.BatchLoader.__name__)"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(REPO / "src" / "h5feed" / "__init__.py"), "BatchLoader"]
