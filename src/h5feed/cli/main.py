"""The `h5feed` command's parser and its commands: each a thin layer over the Python API."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from h5feed.cli.options import add_location_options, add_storage_option, location_options, one_of, storage_options
from h5feed.errors import H5feedError, NotAStoreError, StoreError
from h5feed.formats import DEFAULT_LOCK_TIMEOUT_S, FORMATS
from h5feed.loading.sample_folder import explained
from h5feed.observe.report import add_report_parser
from h5feed.observe.trace import add_trace_parser
from h5feed.observe.watch import add_watch_parser
from h5feed.text import printable

log = logging.getLogger("h5feed")


def _cmd_convert(args: argparse.Namespace) -> int:
    from h5feed.conversion import BucketOptions, RunOptions, SkipPolicy, StoreSettings, convert

    if args.dask or args.scheduler:
        with contextlib.suppress(ImportError):  # convert() says what to install
            import distributed  # noqa: F401  (its import sets its loggers' levels: quieten them after)
        logging.getLogger("distributed").setLevel(logging.WARNING)  # the scheduler's and nannies' chatter
    report = convert(
        args.src,
        args.dst,
        format=args.format,
        workers=args.workers,
        overwrite=args.overwrite,
        progress=not args.quiet,
        settings=StoreSettings(codec=args.codec, chunk_tokens=args.chunk_tokens, shard_tokens=args.shard_tokens,
                               precision=args.precision, last_state_norm=args.last_state_norm),
        run=RunOptions(scheduler="local" if args.dask else args.scheduler, durable=not args.no_fsync),
        skips=SkipPolicy(skip_bad=args.skip_bad, retry_skipped=args.retry_skipped, lock_timeout=args.lock_timeout),
        bucket=BucketOptions(storage_options=storage_options(args), staging_dir=args.staging_dir),
    )
    rate = report.bytes_in / report.seconds / 1e6 if report.seconds else 0.0
    log.info(
        "%s: %d samples, %d tokens (%d converted now, %d from an earlier run, %d skipped) in %.1f s, %.0f MB/s in",
        report.store, report.num_samples, report.num_tokens, report.converted_now, report.resumed,
        len(report.skipped), report.seconds, rate,
    )
    for worker, done in sorted(report.workers.items()):
        busy = max(done.seconds, 1e-9)
        log.info("  worker %s: %d samples, %.0f MB in, %.0f MB out, %.1f s busy: %.0f MB/s in, %.0f MB/s out",
                 worker, done.samples, done.bytes_in / 1e6, done.bytes_out / 1e6, done.seconds,
                 done.bytes_in / busy / 1e6, done.bytes_out / busy / 1e6)
    for skipped in report.skipped:
        log.warning("skipped %s: %s", skipped.path, skipped.problem)
    if args.precision == "fp8":
        log.warning("%s: the hidden states were quantized to FP8 (lossy: float8_e4m3fn with one scale per token, "
                    "as hs-connectors' fp8 backend stores them); reads give them back in bfloat16, approximately",
                    report.store)
    return 0


def _refuse_while_converting(store: str) -> None:
    """A local store a running `h5feed convert` holds is refused with who converts it and how far it is."""
    from h5feed.io import is_remote
    from h5feed.store.writer_state import being_converted

    state = None if is_remote(store) else being_converted(store)
    if state is not None:
        raise StoreError(store, state)


def _cmd_verify(args: argparse.Namespace) -> int:
    from h5feed.verify import verify_store

    _refuse_while_converting(args.store)
    report = verify_store(args.store, args.against, progress=not args.quiet, **location_options(args))
    for mismatch in report.mismatches:
        log.error("MISMATCH %s", mismatch)
    what = "checksums and source files" if report.compared_with_source else "checksums"
    if report.ok:
        log.info("%s: %d samples OK (%s)", report.store, report.samples_checked, what)
        return 0
    log.error("%s: %d mismatch(es) in %d samples (%s)", report.store, len(report.mismatches), report.samples_checked, what)
    from h5feed.conversion.repair import what_to_run

    log.error("%s", what_to_run(report.store))
    return 1


def _cmd_repair(args: argparse.Namespace) -> int:
    from h5feed.conversion.repair import repair

    report = repair(args.store, args.source, progress=not args.quiet, durable=not args.no_fsync,
                    drop_unrecoverable=args.drop_unrecoverable)
    for path in report.rebuilt:
        log.info("rebuilt %s", path)
    for problem in report.unrecoverable:
        log.error("UNRECOVERABLE %s", problem)
    for dropped in report.dropped:
        log.warning("DROPPED %s", dropped)
    done = f"repaired {len(report.repaired)} sample(s) ({report.shards_replaced} shard file(s) replaced)"
    if report.dropped:
        done += (f", dropped {len(report.dropped)} from the index (recorded as skipped: `h5feed inspect "
                 f"{report.store}` lists them)")
    if not report.ok:
        drop = "" if args.drop_unrecoverable else ", or pass --drop-unrecoverable to drop them from the index"
        log.error("%s: %s; %d could not be repaired and are left as they were: restore their source files as they "
                  "were converted and run the same command again%s, or convert the store again", report.store, done,
                  len(report.unrecoverable), drop)
        return 1
    if report.repaired or report.rebuilt or report.dropped:
        rebuilt = f", {len(report.rebuilt)} file(s) rebuilt" if report.rebuilt else ""
        log.info("%s: %s%s; all %d samples check out now", report.store, done, rebuilt,
                 report.samples_checked - len(report.dropped))
    else:
        log.info("%s: nothing to repair: %d samples OK", report.store, report.samples_checked)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from h5feed.verify import describe_store

    _refuse_while_converting(args.store)
    summary = describe_store(args.store, **location_options(args))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        if key == "skipped":
            value = len(value)
            for skipped in summary["skipped"]:
                _show(f"  skipped {skipped['path']}: {skipped['problem']}")
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            _show(f"{key:<{width}}  {len(value)}")  # one line each below: extra arrays, companions
            for name, entry in value.items():
                _show(f"  {name}: {_readable(name, entry)}")
            continue
        _show(f"{key:<{width}}  {_readable(key, value)}")
    return 0


def _show(line: str) -> None:
    """Print one line of `inspect`: its strings come from the store's attributes, which whoever wrote the store
    chose, so they are shown printable (`--json` escapes them as JSON does)."""
    print(printable(line))


def _readable(key: str, value: Any) -> str:
    """One figure of `inspect` as a person reads it (`--json` keeps the raw values)."""
    if value is None:
        return "none"
    if key.endswith("_bytes") and isinstance(value, int):
        return f"{_size(value)} ({value:,} bytes)"
    if key == "codec" and isinstance(value, dict):
        shuffle = {"shuffle": "byte shuffle", "bitshuffle": "bit shuffle", "noshuffle": "no shuffle"}
        parts = [" ".join(str(value[k]) for k in ("name", "cname") if k in value)]
        parts += [f"level {value['clevel']}"] if "clevel" in value else []
        parts += [shuffle.get(str(value["shuffle"]), str(value["shuffle"]))] if "shuffle" in value else []
        parts += [f"{_size(value['blocksize'], binary=True)} blocks"] if value.get("blocksize") else []
        return ", ".join(parts)
    if key == "compression_ratio":
        return f"{value}x (raw bytes / stored bytes)"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_readable(k, v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def _size(n: int, binary: bool = False) -> str:
    """Bytes as kB/MB/GB/TB (or KiB/MiB/GiB with binary=True)."""
    step, units = (1024, ("bytes", "KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("bytes", "kB", "MB", "GB", "TB"))
    amount, unit = float(n), 0
    while amount >= step and unit < len(units) - 1:
        amount, unit = amount / step, unit + 1
    return f"{n} bytes" if unit == 0 else f"{amount:.3g} {units[unit]}"


EXAMPLES = {
    "convert": """examples:
  h5feed convert /data/hidden_states /data/hs.zarr                   # detect the format, all cores
  h5feed convert dumps/ hs.zarr --last-state-norm post --workers 8   # Model-Optimizer HF dumps
  h5feed convert /shared/vllm-hs hs.zarr --last-state-norm pre       # vLLM's {req_id}.safetensors
  h5feed convert s3://runs/hs s3://stores/hs.zarr --storage-option endpoint_url=http://minio:9000
  h5feed convert /data/hidden_states /data/hs-fp8.zarr --precision fp8  # lossy, about half the size
  (run the same command again to resume after a kill, or to append files added to SRC)""",
    "verify": """examples:
  h5feed verify /data/hs.zarr                                # every checksum
  h5feed verify /data/hs.zarr --against /data/hidden_states  # every tensor against its source file""",
    "repair": """examples:
  h5feed repair /data/hs.zarr                                # re-encode damaged samples from the recorded SRC
  h5feed repair /data/hs.zarr --from /mnt/old/hidden_states  # the source folder, moved since conversion
  h5feed repair /data/hs.zarr --drop-unrecoverable           # drop samples whose source file is gone""",
    "inspect": """examples:
  h5feed inspect /data/hs.zarr
  h5feed inspect s3://stores/hs.zarr --cache-dir /nvme/h5feed-cache --json""",
}


def _subcommand(sub: Any, name: str, help: str, description: str) -> argparse.ArgumentParser:
    """A subcommand whose --help says what it does and shows examples (kept as written: hence the raw formatter,
    and the description filled here)."""
    return sub.add_parser(name, help=help, description=textwrap.fill(description, 100), epilog=EXAMPLES.get(name),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    from h5feed import __version__

    parser = argparse.ArgumentParser(
        prog="h5feed", description="Feed large per-sample hidden states (EAGLE-3 drafter training) to a GPU trainer: "
        "convert trainers' files into one checked, compressed Zarr store, verify, repair and inspect it, bench the "
        "loaders on this machine, watch a training run's data wait.",
        epilog="`h5feed COMMAND --help` shows a command's options and examples.")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--version", action="version", version=f"h5feed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = _subcommand(sub, "convert", "convert per-sample .pt/.ckpt/.safetensors files (vLLM's too, or a NeMo cache) into "
                    "one Zarr store",
                    "Convert every sample file under SRC (any supported trainer's format, detected) into one chunked, "
                    "compressed Zarr v3 store, bit for bit, in parallel, crash-safe and resumable.")
    p.add_argument("src", help="folder of sample files (searched recursively), or a URL (s3://bucket/prefix, ...)")
    p.add_argument("dst", help="the store to write (a folder, or a URL: converted in --staging-dir, then uploaded); "
                   "an unfinished one is resumed, and new files in SRC are appended to a complete one")
    p.add_argument("--format", type=one_of("format", FORMATS), metavar="FORMAT",
                   help=f"input format, one of {', '.join(FORMATS)} (default: detected)")
    p.add_argument("--last-state-norm", choices=["pre", "post"], default=None,
                   help="whether the files' last hidden state is taken before (pre) or after (post) the verifier's "
                   "final norm; required for files that do not say it (Model-Optimizer's vLLM and HF dumps, "
                   "AngelSlim's vLLM backend; vLLM's own files: pre, when their last layer is the model's final "
                   "one), refused where it contradicts them")
    p.add_argument("--workers", type=int, default=None,
                   help=f"worker processes of the local pool or of --dask; 0 converts in this process "
                   f"(default: the {os.cpu_count() or 1} cores)")
    cluster = p.add_mutually_exclusive_group()
    cluster.add_argument("--scheduler", metavar="ADDRESS",
                         help="convert on the Dask cluster of this scheduler (tcp://HOST:8786), whose workers reach "
                         "SRC and DST by the same paths; 'local' is --dask (needs h5feed[dask])")
    cluster.add_argument("--dask", action="store_true",
                         help="convert on a Dask LocalCluster of --workers processes (its dashboard shows the tasks)")
    p.add_argument("--codec", choices=["zstd", "lz4", "none"], default="zstd",
                   help="zstd: Blosc zstd-1, byte shuffle, 1 MiB blocks; lz4: Blosc lz4 + bitshuffle (default: %(default)s)")
    p.add_argument("--chunk-tokens", type=int, default=256,
                   help="tokens per chunk, the unit of decoding (default: %(default)s)")
    p.add_argument("--shard-tokens", type=int, default=None,
                   help="tokens per shard, the unit of storage, a multiple of --chunk-tokens (default: the longest "
                   "sample rounded up, at most 8192: one object per sample and array)")
    p.add_argument("--precision", choices=["exact", "fp8"], default="exact",
                   help="exact: the hidden states bit for bit (default); fp8: LOSSY, quantized to float8_e4m3fn with "
                   "one float32 scale per token, exactly as hs-connectors' fp8 backend does (speculators' "
                   "--hidden-states-backend fp8), about half the size; reads give them in bfloat16 as its "
                   "FP8Transfer does")
    p.add_argument("--no-fsync", action="store_true",
                   help="skip the fsyncs that make journaled samples survive a power loss (faster on some disks)")
    p.add_argument("--skip-bad", action="store_true", help="skip unreadable files and record them in the store")
    p.add_argument("--lock-timeout", type=float, default=DEFAULT_LOCK_TIMEOUT_S, metavar="SECONDS",
                   help="how long to wait for files vLLM is still writing (their .lock held); then an error, or with "
                   "--skip-bad a recorded skip that a rerun appends (default: %(default)g)")
    p.add_argument("--retry-skipped", action="store_true",
                   help="on a complete DST, try the files it skipped, while planning or converting, again (repaired "
                   "since): those that load now are appended; with --skip-bad the others stay recorded")
    p.add_argument("--overwrite", action="store_true", help="delete DST first")
    add_storage_option(p)
    p.add_argument("--staging-dir", metavar="DIR",
                   help="local folder where a bucket DST is converted before upload (keep it to resume; default: "
                   "~/.cache/h5feed/staging/<digest of DST>), and where workers fetch a bucket SRC's files")
    p.set_defaults(func=_cmd_convert)

    p = _subcommand(sub, "verify", "check a store's checksums, or compare it bit for bit with its sources",
                    "Read every sample of STORE and check it against the checksums written at conversion; with "
                    "--against, also compare every tensor with the source file it came from.")
    p.add_argument("store", help="a local path or a URL (s3://, gs://, az://, https://, ...)")
    p.add_argument("--against", metavar="SRC", help="the source folder to compare every tensor with")
    add_location_options(p)
    p.set_defaults(func=_cmd_verify)

    p = _subcommand(sub, "repair", "mend a damaged store in place from its source files, without converting it again",
                    "Find the damage `h5feed verify` finds in STORE (a local store made by `h5feed convert`) and mend "
                    "it in place: each damaged sample is converted again from its source file into the same bytes, "
                    "damaged array metadata, attributes and index are rebuilt from the conversion's plan and journal. "
                    " A source file that changed since conversion, or is gone, leaves its sample as it was (reported, "
                    "exit status 1), or with --drop-unrecoverable drops it from the index, recorded as skipped.  Safe "
                    "to kill: run it again to finish.")
    p.add_argument("store", help="the local store to repair")
    p.add_argument("--from", dest="source", metavar="SRC",
                   help="the folder the store was converted from (default: the one it recorded)")
    p.add_argument("--drop-unrecoverable", action="store_true",
                   help="drop each sample whose source file is gone or changed from the index (recorded in the store "
                   "as skipped, with why: `h5feed inspect` lists it); the samples after it move up by one")
    p.add_argument("--no-fsync", action="store_true",
                   help="skip the fsyncs that make each repaired file survive a power loss")
    p.set_defaults(func=_cmd_repair)

    p = _subcommand(sub, "inspect", "what a store holds: samples, tokens, shapes, codec, compression; cache state",
                    "Describe STORE: samples, tokens, shapes, dtype, last-state norm, codec and compression, "
                    "skipped files, companions; for a URL with --cache-dir, the node cache's state.")
    p.add_argument("store", help="a local path or a URL (s3://, gs://, az://, https://, ...)")
    add_location_options(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_inspect)
    from h5feed.bench.cli import add_bench_parser  # here: h5feed.bench's CLI imports this package's options

    add_bench_parser(sub)
    add_watch_parser(sub)
    add_report_parser(sub)
    add_trace_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `h5feed` alone: what it can do
        parser.print_help()
        return 0
    if args.command == "convert" and args.scheduler and args.workers is not None:
        parser.error(f"--workers sets the size of the local pool or of --dask; the cluster at {args.scheduler} "
                     "has the workers it has")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return int(args.func(args))
    except H5feedError as exc:  # its message may quote a lock holder's host, a log's name: shown printable
        said = explained(exc) if isinstance(exc, NotAStoreError) else exc  # a folder of sample files named so
        log.error("h5feed %s: error: %s", args.command, printable(str(said), lines=True))
        return 1
    except BrokenPipeError:  # `h5feed inspect STORE | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        log.error("h5feed %s: interrupted; run the same command again to resume", args.command)
        return 130


if __name__ == "__main__":
    sys.exit(main())
