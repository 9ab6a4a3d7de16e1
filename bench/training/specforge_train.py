"""SpecForge 0.2's own `specforge train`: its time to first step and its data wait on its .ckpt (or .ckpt.gz) files,
against the same data in an h5feed store (``python -m h5feed.specforge_train``).

    python bench/training/specforge_train.py --make-data 48 --hidden-size 1024 --tokens 1024:2048 --steps 8 --repeat 2 \
        --cold --work /tmp/specforge_bench --out bench/out

``--make-data N`` writes N samples as SpecForge's capture writes them for ``--algorithm`` (DFlash's
``hidden_states`` [1, T, K*H] by default, K = ``--layers``; EAGLE-3's or DSpark's with their last state), in its
``rows_{g}-{g+2000}/data_{i}.ckpt`` layout (also gzipped, for the ``files-gz`` arm), converts them into a store, and
makes a verifier of that hidden size with few layers and its draft's config (random weights: only shapes and speed
matter).  Or on real data: ``--files DIR --store STORE --config RUN.yaml`` (SpecForge's run file; its
``data.hidden_states_path`` is replaced by each arm's).

Each arm runs SpecForge's training in its own process for ``--steps`` steps, SpecForge's code unchanged:

- ``files``: ``python -m specforge.cli train`` on the ``.ckpt`` files (its `OfflineManifestReader` lists them, its
  loader's threads torch.load each one whole);
- ``files-gz``: the same on the ``.ckpt.gz`` files (each decompressed whole);
- ``store``: ``python -m h5feed.specforge_train train`` on the store (the refs from its index, each sample read and
  checked from the store).

Measured: the time to first step (from starting the process to SpecForge's log line of step 1: imports, model
assembly, listing the data, the first batch), and SpecForge's own ``perf/data_wait_time_s``, the seconds each step
waited for its batch (step 1's is the first batch; the later steps' mean), and the step time.  On a CPU the step
hides the loader's prefetch, so two parts of the data path are also timed alone, each arm in its own process:

- ``loader``: one epoch of SpecForge's own loader (`FeatureDataLoader` with the algorithm's reader, normalizer and
  collator, ``--workers`` threads, ``--batch-size``), no model: how long a trainer that computed nothing would wait;
- ``vocab``: the pass EAGLE-3 makes before its first step when the draft's vocabulary is smaller than the verifier's
  (SpecForge's `count_effective_feature_tokens` over every file; over a store, the count h5feed's command makes from
  the ids and loss masks alone).

``--cold`` drops the page cache before each measurement (as root): the data then comes from the disk, as in a first
epoch.  On a machine without a GPU the draft trains on the CPU (``training.fsdp_sharding=NO_SHARD``; EAGLE-3 needs
a GPU, its loader and vocabulary pass do not).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import io
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ARMS = ("files", "files-gz", "store")
REPO = Path(__file__).resolve().parents[2]
VOCAB = 8192
STEP_LINE = re.compile(r"^step (\d+): (\{.*\})$")


def sample(algorithm: str, t: int, hidden_size: int, layers: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One sample as SpecForge's capture for `algorithm` saves it (random values)."""
    ids = torch.randint(0, VOCAB, (t,), generator=g)
    mask = torch.ones(t, dtype=torch.int64)
    mask[: t // 4] = 0  # the prompt
    aux = torch.randn(1, t, layers * hidden_size, generator=g).to(torch.bfloat16)
    if algorithm == "eagle3":
        last = torch.randn(1, t, hidden_size, generator=g).to(torch.bfloat16)
        return {"input_ids": ids, "loss_mask": mask, "aux_hidden_state": aux, "hidden_state": last}
    d = {"input_ids": ids, "loss_mask": mask, "hidden_states": aux}
    if algorithm == "dspark":
        d["target_last_hidden_states"] = torch.randn(1, t, hidden_size, generator=g).to(torch.bfloat16)
    return d


def make_data(args: argparse.Namespace) -> tuple[Path, Path, Path, Path]:
    """SpecForge-written files (.ckpt and .ckpt.gz), their store, a verifier and a run file, in args.work."""
    import h5feed

    work, (low, high) = args.work, (int(x) for x in args.tokens.split(":"))
    files, gz, store = work / "hs", work / "hs-gz", work / "hs.zarr"
    if not (work / "made.json").exists():
        g = torch.Generator().manual_seed(0)
        for i in range(args.make_data):
            folder = f"rows_{i // 2000 * 2000}-{i // 2000 * 2000 + 2000}"
            (files / folder).mkdir(parents=True, exist_ok=True)
            (gz / folder).mkdir(parents=True, exist_ok=True)
            t = int(torch.randint(low, high + 1, (1,), generator=g))
            buffer = io.BytesIO()
            torch.save(sample(args.algorithm, t, args.hidden_size, args.layers, g), buffer)
            (files / folder / f"data_{i}.ckpt").write_bytes(buffer.getvalue())
            (gz / folder / f"data_{i}.ckpt.gz").write_bytes(gzip.compress(buffer.getvalue(), compresslevel=6))
        for folder in (files, gz):
            (folder / "config.json").write_text(json.dumps({"hidden_size": args.hidden_size}))  # H, for the store
        h5feed.convert(files, store, workers=os.cpu_count() or 1, progress=False, overwrite=True)
        make_models(work, args)
        (work / "made.json").write_text(json.dumps(vars(args), default=str))
    return files, gz, store, work / "run.json"


def make_models(work: Path, args: argparse.Namespace) -> None:
    """A verifier of the data's hidden size (few layers) and a one-layer draft of `args.algorithm`, and the run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    h, heads = args.hidden_size, max(1, args.hidden_size // 128)
    LlamaForCausalLM(LlamaConfig(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=args.layers + 1,
                                 num_attention_heads=heads, num_key_value_heads=heads, vocab_size=VOCAB,
                                 max_position_embeddings=32768, bos_token_id=1, eos_token_id=2)
                     ).to(torch.bfloat16).save_pretrained(work / "verifier")
    arch = {"eagle3": "LlamaForCausalLMEagle3", "dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}
    draft: dict[str, Any] = {"architectures": [arch[args.algorithm]], "hidden_size": h, "intermediate_size": 2 * h,
                             "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": heads,
                             "head_dim": 128 if h >= 128 else h, "vocab_size": VOCAB, "max_position_embeddings": 32768,
                             "rms_norm_eps": 1e-6, "hidden_act": "silu", "pad_token_id": 0,
                             "tie_word_embeddings": False}
    if args.algorithm == "eagle3":
        draft.update(model_type="llama", draft_vocab_size=VOCAB)
    else:
        draft.update(model_type="qwen3", num_target_layers=args.layers + 1, block_size=4,
                     layer_types=["full_attention"], rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                     dflash_config={"target_layer_ids": list(range(args.layers)), "mask_token_id": 3})
    (work / "draft.json").write_text(json.dumps(draft))
    run = {"model": {"target_model_path": str(work / "verifier"), "draft_model_config": str(work / "draft.json"),
                     "torch_dtype": "bfloat16"},
           "data": {"hidden_states_path": "", "max_length": int(args.tokens.split(":")[1]),
                    "cache_dir": str(work / "cache")},
           "training": {"strategy": args.algorithm, "batch_size": args.batch_size, "attention_backend": "sdpa",
                        "num_anchors": 16, "log_interval": 1}}
    (work / "run.json").write_text(json.dumps(run))


def drop_page_cache() -> bool:
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        print(f"--cold: cannot drop the page cache ({e}); the arms read what memory holds", flush=True)
        return False
    return True


def run_arm(arm: str, data: Path, args: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    """One arm's `specforge train`, its step lines timed as they are printed."""
    config = json.loads(json.dumps(base))
    config["data"]["hidden_states_path"] = str(data)
    config["data"]["dataloader_num_workers"] = args.workers
    config["training"].update(max_steps=args.steps, log_interval=1)
    if not torch.cuda.is_available():
        config["training"]["fsdp_sharding"] = "NO_SHARD"
    config["output_dir"] = str(args.work / f"out-{arm}")
    path = args.work / f"run-{arm}.json"
    path.write_text(json.dumps(config))
    module = "h5feed.specforge_train" if arm == "store" else "specforge.cli"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PYTHONUNBUFFERED": "1"}
    cold = drop_page_cache() if args.cold else False
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", module, "train", "--config", str(path)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    steps: list[tuple[float, dict[str, Any]]] = []
    tail: list[str] = []
    assert process.stdout is not None
    for line in process.stdout:
        tail = (tail + [line])[-40:]
        m = STEP_LINE.match(line.strip())
        if m:
            steps.append((time.perf_counter() - start, ast.literal_eval(m.group(2))))  # the dict SpecForge prints
    if process.wait() != 0 or not steps:
        raise SystemExit(f"{arm}: `{module} train` failed:\n{''.join(tail)}")
    waits = [s["perf/data_wait_time_s"] for _, s in steps]
    step_times = [s["perf/optimizer_step_time_s"] for _, s in steps]
    return {"arm": arm, "cold": cold, "steps": len(steps), "time_to_first_step_s": steps[0][0],
            "first_batch_wait_s": waits[0], "wait_s_mean_after_first": statistics.fmean(waits[1:] or [0.0]),
            "step_s_mean_after_first": statistics.fmean(step_times[1:] or [0.0]), "wall_s": time.perf_counter() - start,
            "loss": [s["loss"] for _, s in steps]}


def measure(part: str, arm: str, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """In this process (a child): one epoch of SpecForge's loader, or its vocabulary pass, over `data`."""
    import specforge.launch
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    import h5feed
    from h5feed.integrations.specforge import StoreAccess, count_loss_tokens, install

    max_len = int(args.tokens.split(":")[1])
    if arm == "store":
        install(StoreAccess())
    start = time.perf_counter()  # the imports and the installation are the command's start, timed in `train`
    if part == "vocab":
        if arm == "store":
            counts = count_loss_tokens(h5feed.Store(data), max_len, VOCAB)
        else:
            counts = count_effective_feature_tokens(str(data), max_length=max_len, target_vocab_size=VOCAB)
        return {"part": part, "arm": arm, "seconds": time.perf_counter() - start, "tokens": sum(counts.values())}
    provider = builtin_algorithm_registry().resolve(args.algorithm).providers.offline_for("text")
    refs = provider.build_reader(str(data), run_id="bench", ttt_length=7, max_len=max_len).read()
    listed = time.perf_counter() - start
    loader = FeatureDataLoader(specforge.launch.LocalFeatureStore("bench"), refs=refs, batch_size=args.batch_size,
                               collate_fn=provider.build_collator(),
                               per_sample_transform=provider.build_normalizer(max_len), drop_last=False,
                               strategy=args.algorithm, num_workers=args.workers)
    first, batches = None, 0
    for _ in loader:
        batches += 1
        first = first or time.perf_counter() - start
    return {"part": part, "arm": arm, "seconds": time.perf_counter() - start, "listing_s": listed,
            "first_batch_s": first, "batches": batches}


def run_measure(part: str, arm: str, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    cold = drop_page_cache() if args.cold else False
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    child = subprocess.run([sys.executable, __file__, "--child", part, arm, str(data), "--algorithm", args.algorithm,
                            "--tokens", args.tokens, "--batch-size", str(args.batch_size), "--workers",
                            str(args.workers)], capture_output=True, text=True, env=env, check=False)
    if child.returncode != 0:
        raise SystemExit(f"{part} {arm} failed:\n{child.stdout[-2000:]}{child.stderr[-4000:]}")
    return {**json.loads(child.stdout.strip().splitlines()[-1]), "cold": cold}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=Path, help="SpecForge's hidden-states folder (.ckpt files)")
    parser.add_argument("--files-gz", type=Path, help="the same samples as .ckpt.gz (for the files-gz arm)")
    parser.add_argument("--store", type=Path, help="the store converted from --files")
    parser.add_argument("--config", type=Path, help="SpecForge's run file (its hidden_states_path is replaced)")
    parser.add_argument("--make-data", type=int, metavar="N", help="write N synthetic samples into --work instead")
    parser.add_argument("--algorithm", choices=("dflash", "dspark", "eagle3"), default="dflash")
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=5, help="captured layers K (DFlash's shipped configs: 5)")
    parser.add_argument("--tokens", default="1024:2048", help="synthetic samples' lengths, MIN:MAX")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="data.dataloader_num_workers (prefetch threads)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each arm (root)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/specforge_train_bench"))
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--parts", default="train,loader,vocab", help="what to time: train, loader, vocab")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each arm (the median is reported)")
    parser.add_argument("--child", nargs=3, metavar=("PART", "ARM", "DATA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        part, arm, data = args.child
        print(json.dumps(measure(part, arm, Path(data), args)))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    if args.make_data:
        args.files, args.files_gz, args.store, args.config = make_data(args)
    elif not (args.files and args.store and args.config):
        parser.error("give --files, --store and --config, or --make-data N")
    base = json.loads(args.config.read_text()) if args.config.suffix == ".json" else _yaml(args.config)
    data = {"files": args.files, "files-gz": args.files_gz, "store": args.store}
    arms, parts = args.arms.split(","), args.parts.split(",")
    missing = [arm for arm in arms if data.get(arm) is None]
    if missing:
        parser.error(f"arm(s) {', '.join(missing)} need their data (--files-gz for files-gz)")
    results: dict[str, list[dict[str, Any]]] = {part: [] for part in parts}
    for part in parts:
        for arm in arms:
            runs = []
            for _ in range(args.repeat):  # the arms of a repeat one after the other would share the box's state
                run = run_arm(arm, data[arm], args, base) if part == "train" else run_measure(part, arm, data[arm], args)
                print(json.dumps({"part": part, **run}), flush=True)
                runs.append(run)
            results[part].append(median_run(runs))
    if "train" in results and len({tuple(r["loss"]) for r in results["train"]}) != 1:
        print("warning: the arms' losses differ: they did not train on the same batches", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "specforge_train.json").write_text(json.dumps(results, indent=1))
    print_table(results)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median time (first step for `train`, seconds otherwise), with every run's times beside it."""
    key = "time_to_first_step_s" if "time_to_first_step_s" in runs[0] else "seconds"
    ordered = sorted(runs, key=lambda r: r[key])
    return {**ordered[(len(ordered) - 1) // 2], "runs": len(runs), f"all_{key}": [r[key] for r in runs]}


def print_table(results: dict[str, list[dict[str, Any]]]) -> None:
    if results.get("train"):
        print(f"\nspecforge train  {'first step s':>12} {'1st batch wait s':>16} {'wait s/step':>11} {'step s':>7}")
        for r in results["train"]:
            print(f"  {r['arm']:14} {r['time_to_first_step_s']:12.2f} {r['first_batch_wait_s']:16.3f} "
                  f"{r['wait_s_mean_after_first']:11.3f} {r['step_s_mean_after_first']:7.2f}")
    if results.get("loader"):
        print(f"\nloader epoch     {'listing s':>12} {'first batch s':>16} {'epoch s':>11} {'batches':>7}")
        for r in results["loader"]:
            print(f"  {r['arm']:14} {r['listing_s']:12.3f} {r['first_batch_s']:16.3f} {r['seconds']:11.2f} "
                  f"{r['batches']:7d}")
    if results.get("vocab"):
        print(f"\nvocabulary pass  {'seconds':>12}")
        for r in results["vocab"]:
            print(f"  {r['arm']:14} {r['seconds']:12.2f}")


def _yaml(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text())


if __name__ == "__main__":
    main()
