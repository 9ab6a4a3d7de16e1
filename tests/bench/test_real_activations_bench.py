"""bench/training/real_activations.py at tiny sizes on the CPU: its report holds together, its stores hold what was written.

The script trains a small LM on the standard library's text, writes its EAGLE-3 inputs to an exact and an FP8
store and trains one drafter on each; these tests check what must hold whatever the sizes: the exact store
reads back the written states bit for bit, the FP8 store holds their quantization, the A/B differs only by
the stores (the same store twice gives the same losses), and the figures are those of the stores on disk.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import math
import sys

import pytest
import torch
from conftest import REPO

import h5feed
from h5feed.store import plain_allocator
from h5feed.store.fp8 import dequantize_into, dequantized, quantize, token_scales

H, LAYERS, SAMPLES, EVAL_SAMPLES, DRAFTER_STEPS = 32, 7, 6, 2, 6
TINY = ["--device", "cpu", "--hidden-size", str(H), "--layers", str(LAYERS), "--train-steps", "30", "--train-len", "64",
        "--batch-size", "4", "--samples", str(SAMPLES), "--tokens", "16:64", "--drafter-steps", str(DRAFTER_STEPS),
        "--drafter-eval-samples", str(EVAL_SAMPLES), "--max-corpus-mb", "1"]


def bench_module():
    spec = importlib.util.spec_from_file_location("real_activations_bench", REPO / "bench" / "training" / "real_activations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    return bench_module()


@pytest.fixture(scope="module")
def run(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("realacts")
    result = bench.main(["--out", str(out), *TINY])
    return out, result


def hidden_rows(raw: h5feed.RawSample) -> torch.Tensor:
    return torch.cat([raw.aux_hidden_states, raw.last_hidden_state], dim=1)


def test_the_report_is_the_json_and_holds_together(run):
    out, result = run
    assert json.loads((out / "real_activations.json").read_text()) == json.loads(json.dumps(result))
    assert result["config"]["aux_layers"] == [2, 3, 4]  # (2, L//2, L-3) of 7 layers
    lm = result["lm"]
    assert lm["steps"] == 30 and lm["tokens"] == 30 * 4 * 64
    assert lm["bits_per_byte_after"] < lm["bits_per_byte_before"]  # it learned
    fp8 = result["fp8"]
    tokens = sum(h5feed.Store(out / "stores" / "exact").sample_lengths.tolist())
    assert fp8["samples"] == SAMPLES and fp8["tokens"] == tokens == result["extraction"]["tokens"]
    assert fp8["raw_bf16_hidden_bytes"] == tokens * 4 * H * 2  # 3 aux layers + the last state, bf16
    assert fp8["fp8_hidden_and_scale_bytes"] < fp8["exact_hidden_bytes"]
    assert fp8["raw_bf16_over_fp8_hidden"] == round(fp8["raw_bf16_hidden_bytes"] / fp8["fp8_hidden_and_scale_bytes"], 3)
    error = fp8["relative_rms_error_per_token"]
    assert 0 < error["median"] <= error["p99"] <= error["max"] < 0.1  # e4m3: 3 mantissa bits
    assert result["exact_reads_equal_written"] is True
    for name in ("real", "synthetic"):
        layers = result["activation_stats"][name]["layers"]
        assert list(layers) == ["aux_input_of_layer_2", "aux_input_of_layer_3", "aux_input_of_layer_4", "last_pre_norm"]
        assert all(s["channel_rms_max_over_median"] >= 1 and s["channel_absmax_over_rms"]["max"] >= 1
                   for s in layers.values())


def test_the_exact_store_reads_back_the_written_states_bit_for_bit(run):
    out, result = run
    store = h5feed.Store(out / "stores" / "exact")
    got = [hashlib.sha256(hidden_rows(store.read_sample(i)).contiguous().view(torch.int16).numpy().tobytes()).hexdigest()
           for i in range(len(store))]
    assert got == result["extraction"]["written_sha256"] and len(set(got)) == SAMPLES


def test_the_fp8_store_holds_the_quantized_written_states(run):
    out, _ = run
    exact, fp8 = h5feed.Store(out / "stores" / "exact"), h5feed.Store(out / "stores" / "fp8")
    for i in range(len(exact)):
        rows = hidden_rows(exact.read_sample(i))
        scales = token_scales([rows])
        want = dequantize_into(quantize(rows, scales), scales, torch.empty_like(rows))
        raw = fp8.read_sample(i)
        got = hidden_rows(dequantized(raw, plain_allocator))
        assert torch.equal(raw.hidden_scales, scales)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_the_drafter_curves_are_written(run):
    out, result = run
    with open(out / "drafter_losses.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss_exact", "train_loss_fp8"]
    assert [int(r[0]) for r in rows[1:]] == list(range(1, DRAFTER_STEPS + 1))
    assert all(math.isfinite(float(x)) for r in rows[1:] for x in r[1:])
    assert (out / "drafter_losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = result["drafter"]["runs"]
    assert runs["exact"]["evals"][0] == runs["fp8"]["evals"][0]  # the same drafter, before it saw either store
    assert [e["step"] for e in runs["exact"]["evals"]][-1] == DRAFTER_STEPS
    first = result["drafter"]["first_train_loss"]
    assert first["exact"] != first["fp8"]  # the first step's batch differs by FP8's error alone
    assert float(rows[1][1]) == pytest.approx(first["exact"], abs=1e-6)


def test_a_store_trained_on_twice_gives_the_same_losses(bench, run, tmp_path):
    out, _ = run
    args = bench.parse_args(["--out", str(tmp_path), *TINY])
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    lm = LlamaForCausalLM(bench.llama_config(H, LAYERS, 64))
    head = bench.VerifierHead(lm)
    exact = out / "stores" / "exact"
    evals = bench.eval_batches(exact, [4, 5], args, torch.device("cpu"))
    runs = [bench.train_drafter(exact, [0, 1, 2, 3], evals, lm, head, args, torch.device("cpu")) for _ in range(2)]
    assert len(runs[0].losses) == DRAFTER_STEPS and runs[0].losses == runs[1].losses
    assert runs[0].evals == runs[1].evals


def test_too_few_layers_for_eagle3_aux_layers_are_refused(bench, tmp_path):
    with pytest.raises(SystemExit, match=r"EAGLE-3's aux layers \(2, L//2, L-3\) = \(2, 3, 3\) need L >= 7"):
        bench.parse_args(["--out", str(tmp_path), "--layers", "6"])


def test_an_earlier_runs_stores_are_not_appended_to(bench, run):
    out, _ = run
    with pytest.raises(SystemExit, match="exists .an earlier run.s stores.: remove it, or give another --out or --stores"):
        bench.main(["--out", str(out), *TINY])
