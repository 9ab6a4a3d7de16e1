"""What the h5feed-tap backend costs a streamed epoch, and what its store saves the next one.

A real `mooncake_master` on 127.0.0.1 and a producer that puts each sample into it as vLLM's hs-connectors
MooncakeHiddenStatesConnector does (`h5feed.integrations.mooncake_local`: one object per sample, hs-connectors'
`packed_layout` and `put_sample`) stand in for the inference server; the samples are synthetic speculators
files (Arrow dataset + hs_{i}.safetensors, made once under --out).  What is timed is what speculators'
`ArrowDataset` calls on its transfer for a row, in the trainer's process:

- streamed epoch, per sample: ``get_cached(i)`` (a miss) + ``get_generated(manifest)`` + ``delete(handle)``,
  through the plain `mooncake` backend's `MooncakeTransfer` and through the tap's `TapTransfer` (which also checks
  the sample as speculators does and appends it into the store, written behind on the writer's thread); the
  producer's put before each is not counted, nor `--step-ms`, a training step's time after each sample (a sleep),
  during which the tap's writer compresses and writes behind (0: none, so the writer's throughput bounds the
  tap's).  Then the time the tap's writer still needs at the epoch's end to write and publish what is behind
  (`close()`).
- second epoch, per sample: the tap's ``get_cached(i)`` from the store, against regenerating the sample through
  Mooncake: the producer's put + the plain backend's get and delete (the transport alone), plus `--verifier-ms`
  for the verifier's forward pass that regeneration also costs (0 by default: the figure is then a lower bound).

Each side runs `--repeat` times, alternating, each into a fresh store; the medians of the per-sample times are
printed, with the figures as JSON in --out/tap_bench.json.

    python bench/training/tap_bench.py --samples 32 --hidden-size 1024 --tokens 400:600 --out /tmp/tap_bench
    python bench/training/tap_bench.py --samples 16 --hidden-size 4096 --tokens 1000:1400 --step-ms 300 --out /tmp/tap_bench
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from hs_connectors import FileTransfer
from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
from hs_connectors.transfer import MooncakeTransfer

from h5feed.integrations.mooncake_local import LocalMaster, MooncakeProducer, ProducerOptions
from h5feed.integrations.speculators_tap import TapOptions, TapTransfer, prepare_store
from h5feed.testing.synthetic import write_synthetic


def trainer_client(master: str, segment_bytes: int) -> MooncakeTransfer:
    """The trainer's Mooncake transfer, as the mooncake backend builds it (its settings, this loopback's host)."""
    return MooncakeTransfer(MooncakeHiddenStatesStore(MooncakeStoreConfig(
        local_hostname="127.0.0.1", master_server_address=master, global_segment_size=segment_bytes,
        local_buffer_size=segment_bytes)))


def streamed_epoch(transfer, producer: MooncakeProducer, samples: list[dict], tag: str, step_s: float) -> list[float]:
    """Seconds per sample that `transfer` spends serving each row the producer has just put (then a step's time)."""
    transfer.setup()
    seconds = []
    for i, sample in enumerate(samples):
        manifest = producer.put(f"{tag}-{i}", sample["hidden_states"], sample["token_ids"])
        t0 = time.perf_counter()
        assert transfer.get_cached(i) is None
        got = transfer.get_generated(manifest)
        transfer.delete(manifest["handle"])
        seconds.append(time.perf_counter() - t0)
        assert got["hidden_states"].shape == sample["hidden_states"].shape
        time.sleep(step_s)
    return seconds


def regenerated_epoch(transfer: MooncakeTransfer, producer: MooncakeProducer, samples: list[dict], tag: str,
                      verifier_s: float) -> list[float]:
    """Seconds per sample to have each sample again through Mooncake: put, get, delete (+ the verifier's time)."""
    seconds = []
    for i, sample in enumerate(samples):
        t0 = time.perf_counter()
        manifest = producer.put(f"{tag}-{i}", sample["hidden_states"], sample["token_ids"])
        transfer.get_generated(manifest)
        transfer.delete(manifest["handle"])
        seconds.append(time.perf_counter() - t0 + verifier_s)
    return seconds


def from_store(transfer: TapTransfer, n: int) -> list[float]:
    seconds = []
    for i in range(n):
        t0 = time.perf_counter()
        assert transfer.get_cached(i) is not None
        seconds.append(time.perf_counter() - t0)
    return seconds


def median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--aux-layers", type=int, default=3)
    parser.add_argument("--tokens", default="400:600", help="LO:HI tokens per sample")
    parser.add_argument("--write-behind", type=int, default=2)
    parser.add_argument("--publish-every", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="a training step's time after each sample of the streamed epoch (default 0)")
    parser.add_argument("--verifier-ms", type=float, default=0.0,
                        help="the verifier's forward pass per sample, added to regenerating (default 0: transport only)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
    lo, hi = (int(v) for v in args.tokens.split(":"))
    data = args.out / "data"
    if not (data / "state.json").exists():
        write_synthetic(data, "speculators-safetensors", args.samples, args.hidden_size,
                        num_aux_layers=args.aux_layers, lengths=(lo, hi), seed=1)
    files = FileTransfer(data / "hidden_states")
    samples = [files.get_cached(i) for i in range(args.samples)]
    sample_bytes = max(s["hidden_states"].nbytes + s["token_ids"].nbytes for s in samples)
    segment = max(64 << 20, 8 * sample_bytes)

    figures: dict[str, list[float]] = {"mooncake": [], "tap": [], "tap_close": [], "store": [], "regenerate": []}
    with LocalMaster(args.out / "master.log") as master:
        producer = MooncakeProducer(master.address, ProducerOptions(segment, segment))
        plain = trainer_client(master.address, segment)
        for r in range(args.repeat):
            figures["mooncake"] += streamed_epoch(plain, producer, samples, f"plain{r}", args.step_ms / 1e3)
            store = args.out / f"hs-{r}.zarr"
            shutil.rmtree(store, ignore_errors=True)
            options = TapOptions(str(store), str(data), write_behind=args.write_behind,
                                 publish_every=args.publish_every)
            prepare_store(options)
            tap = TapTransfer(trainer_client(master.address, segment), options)
            figures["tap"] += streamed_epoch(tap, producer, samples, f"tap{r}", args.step_ms / 1e3)
            t0 = time.perf_counter()
            tap.close()
            figures["tap_close"].append(time.perf_counter() - t0)
            second = TapTransfer(trainer_client(master.address, segment), options)  # another run: no Mooncake setup
            figures["store"] += from_store(second, args.samples)
            figures["regenerate"] += regenerated_epoch(plain, producer, samples, f"again{r}", args.verifier_ms / 1e3)
            del tap, second
            gc.collect()  # their Mooncake clients leave while the master runs
        del plain, producer
        gc.collect()

    mb = sample_bytes / 1e6
    result = {
        "samples": args.samples, "hidden_size": args.hidden_size, "aux_layers": args.aux_layers, "tokens": args.tokens,
        "largest_sample_mb": round(mb, 2), "repeat": args.repeat, "write_behind": args.write_behind,
        "publish_every": args.publish_every, "step_ms": args.step_ms, "verifier_ms": args.verifier_ms,
        "mooncake_ms": median_ms(figures["mooncake"]), "tap_ms": median_ms(figures["tap"]),
        "tap_close_ms": median_ms(figures["tap_close"]), "store_ms": median_ms(figures["store"]),
        "regenerate_ms": median_ms(figures["regenerate"]), "cpus": os.cpu_count(),
    }
    (args.out / "tap_bench.json").write_text(json.dumps(result, indent=1))
    extra = result["tap_ms"] - result["mooncake_ms"]
    print(f"{args.samples} samples of up to {mb:.1f} MB (H={args.hidden_size}, K={args.aux_layers}, {args.tokens} "
          f"tokens), {args.repeat} passes each, a {args.step_ms:g} ms step after each sample, medians per sample:")
    print(f"  streamed epoch   mooncake {result['mooncake_ms']:8.2f} ms   h5feed-tap {result['tap_ms']:8.2f} ms "
          f"({extra:+.2f} ms, {100 * extra / result['mooncake_ms']:+.0f}%); at the epoch's end the tap's writer "
          f"needs {result['tap_close_ms']:.0f} ms more")
    regen = "put + get + delete" + (f" + {args.verifier_ms:g} ms verifier" if args.verifier_ms else ", no verifier")
    print(f"  second epoch     from the store {result['store_ms']:8.2f} ms   regenerating ({regen}) "
          f"{result['regenerate_ms']:8.2f} ms")


if __name__ == "__main__":
    main()
