"""What an FP8 store saves: the same source set converted exactly and with --precision fp8, sizes and errors.

Writes a synthetic source set (by default the shape of `h5feed bench`'s Kimi set, fewer samples: its values
are synthetic, not real activations, so the ratios say how the codec does on them, not on a model's), converts
it twice, and prints the stored bytes against raw bf16, the FP8 error per token (the RMS error over all of
a token's hidden states, and relative to their RMS) beside speculators 0.4's training noise (uniform,
std 0.05), and what a read costs (CPU seconds per sample of a HiddenStatesDataset in this process, one thread,
warm page cache: FP8's includes its dequantization).

    python bench/convert/fp8_sizes.py --work /tmp/fp8-sizes [--samples 4] [--hidden-size 7168] [--src FOLDER]

`--src` measures an existing source folder (real activations) instead of writing a synthetic one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import h5feed
from h5feed.bench.synthetic_set import DEFAULT_SPEC
from h5feed.store import RawSample, Store, plain_allocator
from h5feed.store.fp8 import dequantized
from h5feed.testing.synthetic import write_synthetic

NOISE_STD = 0.05  # speculators 0.4's AddUniformNoise (examples/speculators_04.py): uniform in [-std, std]
NOISE_RMS = NOISE_STD / 3**0.5  # the RMS of that uniform noise: 0.029
HIDDEN_ARRAYS = ("aux_hidden_states", "last_hidden_states")
FP8_SCALES_ARRAY = "hidden_states_scales"


def figures(values: torch.Tensor) -> dict[str, float]:
    """Median, p99 and max of a 1-d tensor: an error's typical size and its tail."""
    values = values.float()
    return {"median": round(float(values.median()), 5), "p99": round(float(values.quantile(0.99)), 5),
            "max": round(float(values.max()), 5)}


def hidden_rows(raw: RawSample) -> torch.Tensor:
    """[T, (K+1)*H]: a sample's hidden states side by side, the aux layers then the last state."""
    return torch.cat([raw.aux_hidden_states, raw.last_hidden_state], dim=1)


def token_errors(want: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of rows [T, W] (all of a token's hidden states side by side): the RMS of got - want, and that
    RMS over want's own RMS (what the error is to the activations, whatever their scale)."""
    want, got = want.float(), got.float()
    squared = ((got - want) ** 2).mean(dim=1)
    return squared.sqrt(), (squared / (want**2).mean(dim=1)).sqrt()


def store_token_errors(exact: Store, fp8: Store) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_errors` of every token of an FP8 store (read dequantized, as loaders deliver it) against the
    exact store of the same samples."""
    absolute, relative = [], []
    for i in range(len(exact)):
        a, r = token_errors(hidden_rows(exact.read_sample(i)),
                            hidden_rows(dequantized(fp8.read_sample(i), plain_allocator)))
        absolute.append(a)
        relative.append(r)
    return torch.cat(absolute), torch.cat(relative)


def hidden_state_bytes(store: Store) -> int:
    """Bytes on disk of a store's hidden states (an FP8 store's with its per-token scales)."""
    names = (*HIDDEN_ARRAYS, FP8_SCALES_ARRAY) if store.info.fp8 else HIDDEN_ARRAYS
    return sum(f.stat().st_size for n in names for f in (Path(store.path) / n).rglob("*") if f.is_file())


def _read_cpu_s_per_sample(store: Store, rounds: int = 3) -> float:
    """The median over `rounds` passes of a speculators HiddenStatesDataset's CPU seconds per item."""
    dataset = h5feed.HiddenStatesDataset(store, "speculators")
    for i in range(len(dataset)):  # warm-up: page cache, buffers
        dataset[i]
    passes = []
    for _ in range(rounds):
        cpu = time.process_time()
        for i in range(len(dataset)):
            dataset[i]
        passes.append((time.process_time() - cpu) / len(dataset))
    return round(statistics.median(passes), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--src", type=Path, help="a source folder to measure (default: write a synthetic one)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=DEFAULT_SPEC.hidden_size)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    src = args.src or args.work / "src"
    if args.src is None and not src.exists():
        write_synthetic(src, DEFAULT_SPEC.format, args.samples, args.hidden_size, DEFAULT_SPEC.num_aux_layers,
                        DEFAULT_SPEC.tokens, DEFAULT_SPEC.seed)
    stores = {}
    for precision in ("exact", "fp8"):
        report = h5feed.convert(src, args.work / precision, workers=args.workers, progress=False,
                                settings=h5feed.StoreSettings(precision=precision))
        stores[precision] = Store(report.store)
    exact, fp8 = stores["exact"], stores["fp8"]
    tokens = int(exact.sample_lengths.sum())
    values = (exact.info.num_aux_layers + 1) * exact.info.hidden_size
    raw_bf16 = tokens * values * 2
    absolute, relative = store_token_errors(exact, fp8)  # per token, over all its hidden states
    read_cpu = {name: _read_cpu_s_per_sample(store) for name, store in stores.items()}
    exact_hidden, fp8_hidden = hidden_state_bytes(exact), hidden_state_bytes(fp8)
    print(json.dumps({
        "samples": len(exact), "tokens": tokens, "hidden_size": exact.info.hidden_size,
        "num_aux_layers": exact.info.num_aux_layers, "source": str(src), "synthetic": args.src is None,
        "raw_bf16_hidden_bytes": raw_bf16,
        "exact_hidden_bytes": exact_hidden,
        "fp8_hidden_and_scale_bytes": fp8_hidden,
        "exact_store_bytes": exact.stored_nbytes(), "fp8_store_bytes": fp8.stored_nbytes(),
        "raw_bf16_over_exact_hidden": round(raw_bf16 / exact_hidden, 3),
        "raw_bf16_over_fp8_hidden": round(raw_bf16 / fp8_hidden, 3),
        "fp8_over_exact_store": round(fp8.stored_nbytes() / exact.stored_nbytes(), 3),
        "rms_error_per_token": figures(absolute), "relative_rms_error_per_token": figures(relative),
        "speculators_04_noise_rms": round(NOISE_RMS, 4),
        "read_cpu_s_per_sample": read_cpu,
    }, indent=2))


if __name__ == "__main__":
    main()
