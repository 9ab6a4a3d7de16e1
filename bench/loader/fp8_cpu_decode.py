"""What an FP8 store costs the CPU decode backends against an exact (bf16) store of the same samples.

An FP8 store holds half the bytes of an exact one, so on the CPU backends its batches should cost no more:
its rows decompress from half the bytes, then are dequantized (`h5feed.store.fp8.dequantize_into`).  This
writes one synthetic source set (a realistic width, moderately few samples), converts it exactly and to FP8,
and for each h5feed checkout given (`--root`, default this one), in fresh processes taking turns so the shared
machine's noise hits all alike, times:

- BatchLoader(threads=2) and BatchLoader(num_workers=2) over each store (speculators-legacy, batch 1, bf16,
  warm page cache, one untimed pass first): samples/s and CPU seconds per sample (the process and its workers);
- the raw dequantization on one core of the FP8 store's first samples: GB/s of output, into bfloat16 and
  into float32 (the fastest of 5 passes).

Prints each pass as it ends, then the medians, FP8 over exact per checkout, and each checkout over the first.
`uptime`'s load is printed before and after: the machine is shared, and a loaded one slows every figure.

    python bench/loader/fp8_cpu_decode.py [--work /tmp/h5feed-fp8-cpu] [--root OLD_CHECKOUT --root NEW_CHECKOUT]
        [--hidden-size 4096] [--tokens 900:1100] [--samples 16] [--passes 3]

A checkout to compare against can be exported without a worktree:
`mkdir /tmp/old && git archive HEAD src/h5feed | tar -x -C /tmp/old`, then `--root /tmp/old/src`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ONE_PASS = r"""
import json, os, sys, time
import torch
from h5feed import BatchLoader
from h5feed.store import Store
from h5feed.store.fp8 import dequantize_into

exact, fp8, samples = sys.argv[1], sys.argv[2], int(sys.argv[3])
figures = {}
for store_name, store in (("exact", exact), ("fp8", fp8)):
    for loader_name, parallel in (("threads=2", {"threads": 2}), ("num_workers=2", {"num_workers": 2})):
        loader = BatchLoader(store, flavor="speculators-legacy", max_len=2048, hidden_states_dtype=torch.bfloat16,
                             batch_size=1, samples=list(range(samples)), **parallel)
        with loader:
            for batch in loader:  # untimed: the ring's first touch, the workers' imports, the page cache
                del batch
            t0, wall0 = os.times(), time.perf_counter()
            n = 0
            for batch in loader:
                float(batch["hidden_states"].view(-1)[-1])
                n += 1
                del batch
            wall, t1 = time.perf_counter() - wall0, os.times()
        cpu = (t1.user + t1.system + t1.children_user + t1.children_system
               - t0.user - t0.system - t0.children_user - t0.children_system)
        figures[f"{store_name} {loader_name} samples/s"] = n / wall
        figures[f"{store_name} {loader_name} cpu s/sample"] = cpu / n

torch.set_num_threads(1)  # one core, as in a worker process
fp8_store = Store(fp8)  # the store's own codes and scales, as read
rows = []
for i in range(min(samples, 4)):
    t = int(fp8_store.sample_lengths[i])
    for array in ("aux_hidden_states", "last_hidden_states"):
        codes = torch.empty(t, fp8_store.info.width(array), dtype=fp8_store.info.storage_dtype(array))
        scales = torch.empty(t, dtype=fp8_store.info.storage_dtype("hidden_states_scales"))
        fp8_store.read_rows_into(i, array, 0, t, codes)
        fp8_store.read_rows_into(i, "hidden_states_scales", 0, t, scales)
        rows.append((codes.view(torch.float8_e4m3fn), scales.view(torch.float32)))
for dtype in (torch.bfloat16, torch.float32):
    outs = [torch.empty(codes.shape, dtype=dtype) for codes, _ in rows]
    seconds = []
    for _ in range(6):  # the fastest of 5 after a first, untimed
        cpu0 = time.process_time()
        for (codes, scales), out in zip(rows, outs):
            dequantize_into(codes, scales, out)
        seconds.append(time.process_time() - cpu0)
    figures[f"dequantize into {str(dtype).removeprefix('torch.')} GB/s per core"] = (
        sum(out.nbytes for out in outs) / min(seconds[1:]) / 1e9)
print(json.dumps(figures))
"""


def stores(work: Path, hidden_size: int, tokens: tuple[int, int], samples: int) -> tuple[Path, Path]:
    """The exact and the FP8 store of one synthetic source set, written once per shape under `work`."""
    import h5feed  # this checkout's, to write the stores (both precisions read the same way in every version)
    from h5feed.testing.synthetic import write_synthetic

    folder = work / f"H{hidden_size}-K3-T{tokens[0]}-{tokens[1]}-n{samples}"
    made = {precision: folder / precision for precision in ("exact", "fp8")}
    if not all((store / "zarr.json").exists() for store in made.values()):
        write_synthetic(folder / "src", "speculators-legacy-pt", samples, hidden_size, 3, tokens, seed=0)
        for precision, store in made.items():
            h5feed.convert(folder / "src", store, workers=2, progress=False, overwrite=True,
                           settings=h5feed.StoreSettings(precision=precision))
    return made["exact"], made["fp8"]


def one_pass(root: Path, exact: Path, fp8: Path, samples: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", ONE_PASS, str(exact), str(fp8), str(samples)], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/h5feed-fp8-cpu"))
    parser.add_argument("--root", type=Path, action="append",
                        help="a folder holding an h5feed/ package, as a checkout's src/ (repeat to compare; "
                             "default: this checkout's)")
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--tokens", default="900:1100", help="each sample's tokens, drawn from LOW:HIGH")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--passes", type=int, default=3, help="passes of each checkout")
    args = parser.parse_args()
    roots = args.root or [Path(__file__).resolve().parents[2] / "src"]
    low, high = (int(x) for x in args.tokens.split(":"))
    exact, fp8 = stores(args.work, args.hidden_size, (low, high), args.samples)
    print("before:", load(), file=sys.stderr, flush=True)
    passes: dict[str, list[dict[str, float]]] = {str(root): [] for root in roots}
    for _ in range(args.passes):
        for root in roots:
            passes[str(root)].append(one_pass(root, exact, fp8, args.samples))
            print(root, json.dumps(passes[str(root)][-1]), file=sys.stderr, flush=True)
    print("after:", load(), file=sys.stderr, flush=True)
    medians = {root: {key: statistics.median(p[key] for p in runs) for key in runs[0]} for root, runs in passes.items()}
    summary: dict[str, object] = {"hidden_size": args.hidden_size, "num_aux_layers": 3, "tokens": args.tokens,
                                  "samples": args.samples, "passes": args.passes, "medians": medians}
    summary["fp8_over_exact"] = {
        root: {key.removeprefix("fp8 "): value / m[key.replace("fp8 ", "exact ", 1)]
               for key, value in m.items() if key.startswith("fp8 ")}
        for root, m in medians.items()}
    first = medians[str(roots[0])]
    summary["over_first_root"] = {root: {key: value / first[key] for key, value in m.items()}
                                  for root, m in list(medians.items())[1:]}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
