"""`h5feed bench` on the command line."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

from h5feed.bench.loaders import DEFAULT_LOADERS, LOADER_LABELS, LOADERS
from h5feed.bench.runner import Passes, run_bench
from h5feed.bench.step import REPRESENTATIVE, StepOptions
from h5feed.bench.synthetic_set import DEFAULT_CACHE_DIR, DefaultSet, SyntheticSpec, set_folder
from h5feed.cli.options import add_location_options, location_options
from h5feed.errors import H5feedError
from h5feed.loading.options import StoreOptions
from h5feed.observe.page import pyplot


def _cmd_bench(args: argparse.Namespace) -> int:
    where = location_options(args)
    if args.html is not None:  # what the page needs is checked now, not after minutes of passes
        pyplot("h5feed bench --html")
        if not args.html.parent.is_dir():
            raise H5feedError(f"{args.html}: no folder {args.html.parent} to write the page in")
    spec = SyntheticSpec(num_samples=args.num_samples)
    built = set_folder(args.cache_dir, spec) if args.store is None else None
    try:
        _run_and_print(args, where, spec)
    finally:
        if built is not None:
            _keep_or_remove(built, args.keep_cache, quiet=args.quiet)
    return 0


def _keep_or_remove(folder: Path, keep: bool, quiet: bool) -> None:
    """The built set stays for the next run unless asked otherwise; either way the user learns where its gigabytes
    are, and how to get them back."""
    if not keep:
        shutil.rmtree(folder, ignore_errors=True)
        if not quiet:
            print(f"[h5feed bench] removed the bench set {folder} (--no-keep-cache)", file=sys.stderr, flush=True)
    elif not quiet and folder.is_dir():
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(f"[h5feed bench] the bench set and its store ({size / 1e9:.1f} GB) stay in {folder} for the next run; "
              f"remove them with `rm -rf {folder}`, or run with --no-keep-cache", file=sys.stderr, flush=True)


def _run_and_print(args: argparse.Namespace, where: dict[str, Any], spec: SyntheticSpec) -> None:
    result = run_bench(
        StoreOptions(args.store, **where) if args.store is not None else None,
        workers=args.workers,
        max_len=args.max_len,
        flavor=args.flavor,
        passes=Passes(args.loaders, cold=args.cold, warm=args.warm),
        step=None if args.step == "none" else StepOptions(args.step),
        default_set=DefaultSet(spec, args.cache_dir),
        progress=not args.quiet,
        verbose=args.verbose,
    )
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.table(verbose=args.verbose))
    if args.html is not None:
        page = result.write_html(args.html)
        if not args.quiet:
            print(f"[h5feed bench] the page with plots: {page}", file=sys.stderr, flush=True)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def _loader_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in LOADERS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown loader(s) {bad}: choose from {', '.join(LOADERS)}")
    return names


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `h5feed bench` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="the trainer's path: h5feed's loaders against the speculators 0.4 .pt loader, on the same samples",
        description=textwrap.fill("Time, cold and warm, the batches a trainer takes (batch_size 1, the trainer's collate, "
        "pin_memory=True) from speculators 0.4's .pt loader in a DataLoader and from h5feed's loaders, on the "
        "same samples, and check that every loader delivers the same batches. On a GPU, a training step runs on "
        "every batch and loaders are ranked by the trainer's samples/s against the step alone. With no STORE, a Kimi-shaped "
        "synthetic set (H=7168, K=3, 1500..1900 tokens) is written and converted once under --cache-dir: some 8 GB of "
        ".pt files and their store, a few minutes on a machine of few cores; later runs reuse it.", 100),
        epilog="loaders:\n" + "\n".join(f"  {name} = {label}" for name, label in LOADER_LABELS.items())
        + "\n\nexamples:\n  h5feed bench --workers 4                  # the embedded synthetic set, built once"
        "\n  h5feed bench --step mytrain.bench:make_step  # ranked by your own training step (on a GPU)"
        "\n  h5feed bench /data/hs.zarr --workers 8    # your store (its source .pt files are the baseline)"
        "\n  h5feed bench --html bench.html            # also a page with plots (pip install 'h5feed[report]')",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("store", nargs="?", help="an h5feed store (its source files are the baseline's input); "
                   "default: the embedded synthetic set")
    p.add_argument("--workers", type=int, default=4, help="DataLoader num_workers; BatchLoader-threads: reader threads (default: %(default)s)")
    p.add_argument("--max-len", type=_positive, default=2048,
                   help="the trainer's max_len, which its collate pads and cuts to (default: %(default)s)")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=None,
                   help="measure with a cold page cache (needs root; default: when possible)")
    p.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                   help="measure with a warm page cache (default: on)")
    p.add_argument("--loaders", type=_loader_list, default=list(DEFAULT_LOADERS),
                   help=f"comma-separated subset of {','.join(LOADERS)} (default: {','.join(DEFAULT_LOADERS)})")
    p.add_argument("--flavor", help="the trainer's flavor (default: speculators-legacy, specforge for post-norm stores)")
    p.add_argument("--num-samples", type=int, default=SyntheticSpec.num_samples,
                   help="samples of the embedded default set (default: %(default)s, ~100 MB each)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                   help="where the embedded default set is kept (default: %(default)s)")
    p.add_argument("--keep-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the embedded default set (~8 GB, minutes to build) for the next run (default: on)")
    p.add_argument("--step", default=REPRESENTATIVE, metavar="NAME",
                   help="the training step run on every batch on a GPU, by which loaders are ranked: "
                        f"{REPRESENTATIVE!r} (default: an EAGLE-3 drafter step at the store's shape: attention, "
                        "SwiGLU MLP, 3 training-time-test steps, AdamW), your own as package.module:function "
                        "(function(store, device) returns a callable that runs one step on a batch), or 'none' "
                        "(the loaders alone); no step runs without CUDA")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--html", type=Path, metavar="FILE",
                   help="also write one self-contained HTML page: the settings, the advice, samples/s, CPU s/sample "
                        "and peak memory per loader as plots, every column of the table, the notes (needs "
                        "matplotlib: pip install 'h5feed[report]')")
    p.add_argument("--verbose", action="store_true",
                   help="the table with every column (CPU cores, GB/s, each worker's samples/s, the other processes' "
                        "CPU) and a line for each untimed checking pass")
    add_location_options(p, cache_flag="--read-cache-dir")  # --cache-dir is where the default set is kept
    p.set_defaults(func=_cmd_bench)
    return p
