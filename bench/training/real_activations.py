"""FP8 against lossless on real activations: a small LM trained here, its EAGLE-3 inputs stored both ways.

Why: FP8 stores were measured on synthetic Gaussian activations only (bench/convert/fp8_sizes.py), and no
pretrained weights can be downloaded here.  A trained network's activations are not Gaussian (outlier channels, heavy
tails, a scale that grows with depth), and both FP8's error (one scale per token, set by its largest value)
and the codec's ratio depend on that.  So this trains a model itself, in the same process:

1. the corpus: the running Python's standard library (.py, .txt, .rst files), as bytes (vocabulary 256,
   no tokenizer), every 10th file (by a hash of its path) held out;
2. a small Llama (transformers' `LlamaForCausalLM`, from scratch) trained for `--train-seconds`, its
   held-out loss in bits per byte before and after;
3. EAGLE-3 inputs of held-out byte sequences, as vLLM and speculators pick them: the inputs of decoder
   layers (2, L//2, L-3) and the last layer's output before the final norm (a hook), written by
   `h5feed.open_writer` twice, exact and FP8; the same shape of synthetic data written beside them;
4. sizes against raw bf16, FP8's error per token beside speculators' training noise, and the statistics
   that tell trained activations from Gaussian ones;
5. the same small drafter, seeded identically, trained on each store through `h5feed.BatchLoader`, and
   evaluated on held-out samples of the exact store.

It writes real_activations.json, drafter_losses.csv and drafter_losses.png under --out, the stores under
--stores (default OUT/stores).  This is a small LM trained here on the Python standard library, not a
production model.

    python bench/training/real_activations.py --out /tmp/realacts            # CPU: tiny shapes, under a minute
    python bench/training/real_activations.py --out $OUT/realacts            # one H200: H=1024, 8 layers, ~5 min
"""

from __future__ import annotations

import argparse
import copy
import csv
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # the h5feed of this checkout
sys.path.append(str(Path(__file__).resolve().parents[1] / "convert"))  # fp8_sizes (last: shadows nothing)

from fp8_sizes import NOISE_RMS, figures, hidden_rows, hidden_state_bytes, store_token_errors

import h5feed
from h5feed.testing.synthetic import column_scales, make_sample

FLAVOR = "speculators-legacy"
VOCAB = 256  # bytes
CORPUS_SUFFIXES = (".py", ".txt", ".rst")
HOLDOUT_EVERY = 10  # one file in 10 (by a hash of its path) is held out
CHUNK_TOKENS = 256
SYNTHETIC_SAMPLES = 16  # the synthetic comparison set: enough tokens for its statistics
T0 = time.perf_counter()


def say(message: str) -> None:
    """A progress line, flushed: a log cut off by a time limit still says where the run got."""
    print(f"[{time.perf_counter() - T0:7.1f} s] {message}", flush=True)


# --- settings -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """The defaults of one device: the H200's fill its ~6 minutes, the CPU's make a smoke run of seconds."""

    hidden_size: int
    layers: int
    train_seconds: float
    train_len: int  # bytes per training sequence (the extraction's longest fits in it)
    batch_size: int
    samples: int
    tokens: str
    drafter_steps: int
    drafter_eval_samples: int
    loader_workers: int


PRESETS = {
    "cuda": Preset(hidden_size=1024, layers=8, train_seconds=150, train_len=2048, batch_size=16, samples=256,
                   tokens="512:2048", drafter_steps=1000, drafter_eval_samples=32, loader_workers=4),
    "cpu": Preset(hidden_size=64, layers=8, train_seconds=8, train_len=256, batch_size=8, samples=16,
                  tokens="64:256", drafter_steps=40, drafter_eval_samples=4, loader_workers=0),
}

PRESET_TYPES = {"int": int, "float": float, "str": str}  # a Preset field's annotation (a string here) -> its parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the folder of the JSON, CSV and PNG")
    p.add_argument("--stores", type=Path, help="a new folder for the four stores (default: OUT/stores)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for f in fields(Preset):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=PRESET_TYPES[f.type],
                       help="default: the device's preset (see PRESETS)")
    p.add_argument("--train-steps", type=int, help="train the LM for this many steps instead of --train-seconds")
    p.add_argument("--lr", type=float, default=1e-3, help="the LM's peak learning rate")
    p.add_argument("--drafter-lr", type=float, default=3e-4)
    p.add_argument("--max-corpus-mb", type=float, help="read at most this much of the standard library")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    preset = PRESETS["cuda" if args.device.startswith("cuda") else "cpu"]
    for f in fields(Preset):
        if getattr(args, f.name) is None:
            setattr(args, f.name, getattr(preset, f.name))
    lo, hi = (int(x) for x in args.tokens.split(":"))
    if not 2 <= lo <= hi <= args.train_len:
        raise SystemExit(f"--tokens {args.tokens}: need 2 <= LO <= HI <= --train-len ({args.train_len})")
    args.token_range = (lo, hi)
    if args.drafter_eval_samples >= args.samples:
        raise SystemExit(f"--drafter-eval-samples ({args.drafter_eval_samples}) must be below --samples "
                         f"({args.samples}): the drafters train on the rest")
    aux_layer_indices(args.layers)  # refuses too few layers before any work
    return args


# --- the corpus -----------------------------------------------------------------------------------


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 [bytes]
    heldout: torch.Tensor
    root: str
    train_files: int
    heldout_files: int


def read_corpus(max_bytes: int | None) -> Corpus:
    """The standard library's text files as bytes, in path order; a file is held out by a hash of its path, so
    the split is the same on every machine with the same Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*") if f.suffix in CORPUS_SUFFIXES and f.is_file()
                   and not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts))
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    total = 0
    for f in files:
        data = f.read_bytes()
        parts[zlib.crc32(f.relative_to(root).as_posix().encode()) % HOLDOUT_EVERY == 0].append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    train, heldout = (torch.frombuffer(bytearray(b"".join(parts[k])), dtype=torch.uint8) for k in (False, True))
    return Corpus(train, heldout, str(root), len(parts[False]), len(parts[True]))


def windows(data: torch.Tensor, length: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """int64 [count, length]: byte windows at random starts."""
    starts = torch.randint(0, len(data) - length, (count,), generator=generator)
    return data.unfold(0, length, 1)[starts].long()


# --- the language model ---------------------------------------------------------------------------


def llama_config(hidden_size: int, layers: int, max_len: int) -> Any:
    from transformers import LlamaConfig

    heads = max(2, hidden_size // 64)
    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=max(64, 8 * hidden_size // 3 // 64 * 64),
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=max_len, tie_word_embeddings=False, use_cache=False)


def aux_layer_indices(layers: int) -> tuple[int, int, int]:
    """vLLM's and speculators' EAGLE-3 default, (2, L//2, L-3): the inputs of those decoder layers, which are
    transformers' `hidden_states[i]` (index 0 is the embeddings)."""
    picked = (2, layers // 2, layers - 3)
    if len(set(picked)) < 3:
        raise SystemExit(f"--layers {layers}: EAGLE-3's aux layers (2, L//2, L-3) = {picked} need L >= 7")
    return picked


@dataclass
class LmTraining:
    parameters: int
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    bits_per_byte_before: float = 0.0
    bits_per_byte_after: float = 0.0
    tokens_per_s: float = 0.0


@torch.no_grad()
def bits_per_byte(model: Any, batches: torch.Tensor, device: torch.device) -> float:
    model.eval()
    losses = []
    for x in batches.split(max(1, 16384 // batches.shape[1])):  # 16k tokens a forward
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            losses.append(float(model(input_ids=x.to(device), labels=x.to(device)).loss))
    model.train()
    return sum(losses) / len(losses) / math.log(2)


def train_lm(model: Any, corpus: Corpus, args: argparse.Namespace, device: torch.device) -> LmTraining:
    """AdamW with warmup and a cosine decay over the time (or steps) given; bf16 autocast on the GPU."""
    g = torch.Generator().manual_seed(args.seed)
    heldout = windows(corpus.heldout, args.train_len, max(8, 65536 // args.train_len), g)
    done = LmTraining(sum(p.numel() for p in model.parameters()))
    done.bits_per_byte_before = bits_per_byte(model, heldout, device)
    say(f"LM: {done.parameters / 1e6:.1f} M parameters, held-out {done.bits_per_byte_before:.3f} bits/byte untrained")
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    warmup, start, last_log = 50, time.perf_counter(), time.perf_counter()
    model.train()
    while True:
        elapsed = time.perf_counter() - start
        progress = done.steps / args.train_steps if args.train_steps else elapsed / args.train_seconds
        if progress >= 1:
            break
        for group in opt.param_groups:  # warmup, then cosine to a tenth
            group["lr"] = args.lr * min(1.0, (done.steps + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        x = windows(corpus.train, args.train_len, args.batch_size, g).to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done.steps, done.tokens = done.steps + 1, done.tokens + x.numel()
        if time.perf_counter() - last_log >= 15 or done.steps == 1:
            last_log = time.perf_counter()
            say(f"LM step {done.steps}: train {float(loss.detach()) / math.log(2):.3f} bits/byte, "
                f"{done.tokens / (last_log - start):,.0f} tokens/s")
    if cuda:
        torch.cuda.synchronize()
    done.seconds = time.perf_counter() - start
    done.tokens_per_s = done.tokens / done.seconds
    done.bits_per_byte_after = bits_per_byte(model, heldout, device)
    say(f"LM trained: {done.steps} steps, {done.tokens / 1e6:.1f} M tokens in {done.seconds:.0f} s; held-out "
        f"{done.bits_per_byte_before:.3f} -> {done.bits_per_byte_after:.3f} bits/byte")
    return done


# --- extraction -----------------------------------------------------------------------------------


@dataclass
class Extraction:
    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0
    written_sha256: list[str] = field(default_factory=list)  # each sample's bf16 [T, (K+1)*H], as written


def digest(rows: torch.Tensor) -> str:
    """sha256 of a sample's hidden states side by side ([T, (K+1)*H] bf16 bits, `hidden_rows`)."""
    return hashlib.sha256(rows.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def writer_options(token_range: tuple[int, int], precision: str = "exact") -> dict[str, Any]:
    """`h5feed convert`'s layout defaults (a sample a shard); no fsync: these stores are measured, not kept."""
    shard = min(8192, -(-token_range[1] // CHUNK_TOKENS) * CHUNK_TOKENS)
    return {"settings": h5feed.StoreSettings(chunk_tokens=CHUNK_TOKENS, shard_tokens=shard, precision=precision),
            "writing": h5feed.WriteOptions(durable=False)}


def write_both(stores: dict[str, Path], samples: Iterator[tuple[torch.Tensor, list[torch.Tensor]]],
               token_range: tuple[int, int]) -> Extraction:
    """Append each (input_ids, [aux..., last]) sample to an exact and an FP8 store, as speculators' .pt dict."""
    done = Extraction()
    start = time.perf_counter()
    with (h5feed.open_writer(stores["exact"], **writer_options(token_range)) as exact,
          h5feed.open_writer(stores["fp8"], **writer_options(token_range, "fp8")) as fp8):
        for i, (ids, parts) in enumerate(samples):
            sample = {"input_ids": ids, "hidden_states": parts, "loss_mask": torch.ones_like(ids)}
            exact.append(sample, name=f"sample-{i}")
            fp8.append(sample, name=f"sample-{i}")
            done.written_sha256.append(digest(torch.cat(parts, dim=1)))
            done.samples, done.tokens = done.samples + 1, done.tokens + len(ids)
            if done.samples % 64 == 0:
                say(f"written {done.samples} samples ({done.tokens:,} tokens)")
    done.seconds = time.perf_counter() - start
    return done


@torch.no_grad()
def model_samples(model: Any, corpus: Corpus, args: argparse.Namespace,
                  device: torch.device) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Held-out byte sequences and their EAGLE-3 inputs (bf16, on the host), the model served in bf16.  Each
    sequence lies in a slot of its own, so the drafters' held-out samples share no text with their training ones."""
    lo, hi = args.token_range
    g = torch.Generator().manual_seed(args.seed + 1)
    slots = torch.randperm(len(corpus.heldout) // hi, generator=g)[:args.samples].tolist()
    if len(slots) < args.samples:
        raise SystemExit(f"the held-out text ({len(corpus.heldout):,} bytes) has room for {len(slots)} sequences of "
                         f"up to {hi} bytes, not --samples {args.samples}: read more of it (--max-corpus-mb)")
    last: list[torch.Tensor] = []
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: last.append(out[0] if isinstance(out, tuple) else out))
    try:
        for slot in slots:
            length = int(torch.randint(lo, hi + 1, (1,), generator=g))
            ids = corpus.heldout[slot * hi:slot * hi + length].long()[None]
            out = model(input_ids=ids.to(device), output_hidden_states=True)
            parts = [out.hidden_states[i][0] for i in aux_layer_indices(args.layers)] + [last.pop()[0]]
            yield ids[0], [p.to("cpu", torch.bfloat16) for p in parts]
    finally:
        hook.remove()


def synthetic_samples(lengths: list[int], hidden_size: int, layers: int,
                      seed: int) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
    """h5feed.testing.synthetic's values (Gaussian, a log-normal scale per channel) at the real samples' shape."""
    scales = column_scales(hidden_size, layers, seed)
    for i, length in enumerate(lengths):
        ids, _, parts = make_sample(i, length, scales, seed)
        yield ids % VOCAB, parts


# --- what tells trained activations from Gaussian ones --------------------------------------------


class ChannelMoments:
    """Running power sums of each channel of one layer (float64), for its RMS, tails and kurtosis."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.count = 0
        self.sums = torch.zeros(4, width, dtype=torch.float64, device=device)  # sum of x, x^2, x^3, x^4
        self.absmax = torch.zeros(width, dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor) -> None:
        x = x.double()
        self.count += x.shape[0]
        power = x.clone()
        for k in range(4):
            self.sums[k] += power.sum(0)
            power *= x
        self.absmax = torch.maximum(self.absmax, x.abs().amax(0))

    @staticmethod
    def excess_kurtosis(m: torch.Tensor) -> torch.Tensor:
        """From raw moments m [4, ...] (E x, E x^2, E x^3, E x^4): E[(x - mu)^4] / var^2 - 3 (0 for a Gaussian)."""
        mu = m[0]
        var = m[1] - mu**2
        central4 = m[3] - 4 * mu * m[2] + 6 * mu**2 * m[1] - 3 * mu**4
        return central4 / var.clamp(min=1e-30) ** 2 - 3

    def summary(self) -> dict[str, Any]:
        per_channel = self.sums / self.count
        channel_rms = per_channel[1].sqrt()
        crest = self.absmax / channel_rms.clamp(min=1e-30)
        return {
            "rms": round(float(per_channel[1].mean().sqrt()), 5),
            "channel_rms_max_over_median": round(float(channel_rms.max() / channel_rms.median()), 3),
            "channel_absmax_over_rms": {"median": round(float(crest.median()), 3), "max": round(float(crest.max()), 3)},
            "excess_kurtosis": round(float(self.excess_kurtosis(per_channel.mean(1))), 3),
            "channel_excess_kurtosis_median": round(float(self.excess_kurtosis(per_channel).median()), 3),
        }


def activation_stats(store: h5feed.Store, layer_names: list[str], device: torch.device) -> dict[str, Any]:
    """Per layer: RMS, outlier channels (a channel's RMS over the median one's; its max over its RMS), kurtosis
    pooled and per channel; per token over all its states, max over RMS: what sets FP8's per-token scale."""
    hidden = store.hidden_size
    moments = [ChannelMoments(hidden, device) for _ in layer_names]
    token_absmax, token_rms = [], []
    for i in range(len(store)):
        rows = hidden_rows(store.read_sample(i)).to(device).float()
        for k, m in enumerate(moments):
            m.add(rows[:, k * hidden:(k + 1) * hidden])
        token_absmax.append(rows.abs().amax(1).cpu())
        token_rms.append(rows.square().mean(1).sqrt().cpu())
    absmax, rms = torch.cat(token_absmax), torch.cat(token_rms).clamp(min=1e-30)
    return {"layers": {name: m.summary() for name, m in zip(layer_names, moments)},
            "token_absmax_over_rms": figures(absmax / rms), "token_rms": figures(rms),
            "speculators_04_noise_rms_over_token_rms": figures(NOISE_RMS / rms)}


def fp8_report(stores: dict[str, Path]) -> dict[str, Any]:
    """Sizes against raw bf16 and FP8's error per token, as bench/convert/fp8_sizes.py counts them."""
    exact, fp8 = h5feed.Store(stores["exact"]), h5feed.Store(stores["fp8"])
    tokens = int(exact.sample_lengths.sum())
    raw_bf16 = tokens * (exact.num_aux_layers + 1) * exact.hidden_size * 2
    exact_bytes, fp8_bytes = hidden_state_bytes(exact), hidden_state_bytes(fp8)
    absolute, relative = store_token_errors(exact, fp8)
    return {
        "samples": len(exact), "tokens": tokens,
        "raw_bf16_hidden_bytes": raw_bf16, "exact_hidden_bytes": exact_bytes, "fp8_hidden_and_scale_bytes": fp8_bytes,
        "raw_bf16_over_exact_hidden": round(raw_bf16 / exact_bytes, 3),
        "raw_bf16_over_fp8_hidden": round(raw_bf16 / fp8_bytes, 3),
        "fp8_over_exact_hidden": round(fp8_bytes / exact_bytes, 3),
        "rms_error_per_token": figures(absolute), "relative_rms_error_per_token": figures(relative),
        "speculators_04_noise_rms": round(NOISE_RMS, 4),
    }


# --- the drafter A/B ------------------------------------------------------------------------------


class VerifierHead(nn.Module):
    """The trained LM's final norm and lm_head, frozen, in float32: the drafter's targets from a last state."""

    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.norm = copy.deepcopy(lm.model.norm).float().requires_grad_(False)
        self.head = copy.deepcopy(lm.lm_head).float().requires_grad_(False)

    def forward(self, last_hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.head(self.norm(last_hidden_states.float())).float(), dim=-1)


class Drafter(nn.Module):
    """EAGLE-shaped: fc fuses the K aux layers, the next token's (frozen) embedding joins them, one Llama decoder
    layer, an lm_head started from the verifier's; trained against the verifier's next-token distribution."""

    def __init__(self, lm: Any, aux_layers: int) -> None:
        super().__init__()
        from transformers import LlamaModel

        hidden = lm.config.hidden_size
        self.embed = nn.Embedding.from_pretrained(lm.model.embed_tokens.weight.detach().float().clone(), freeze=True)
        self.fc = nn.Linear(aux_layers * hidden, hidden, bias=False)
        self.join = nn.Linear(2 * hidden, hidden, bias=False)
        self.decoder = LlamaModel(llama_config(hidden, 1, lm.config.max_position_embeddings))
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)
        self.lm_head.weight.data.copy_(lm.lm_head.weight.detach().float())

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.join(torch.cat([self.embed(input_ids), self.fc(hidden_states)], dim=-1))
        return self.lm_head(self.decoder(inputs_embeds=x, position_ids=position_ids).last_hidden_state).float()


@dataclass
class DrafterEval:
    step: int
    loss: float  # KL divergence from the verifier's next-token distribution to the drafter's, nats
    top1_agreement: float  # the drafter's argmax is the verifier's (what greedy speculation accepts)
    next_byte_accuracy: float  # the drafter's argmax is the text's next byte


@dataclass
class DrafterRun:
    store: str
    losses: list[float] = field(default_factory=list)
    evals: list[DrafterEval] = field(default_factory=list)
    seconds: float = 0.0


def drafter_loss(drafter: Drafter, head: VerifierHead, batch: dict[str, torch.Tensor],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, drafter logits, verifier probs, mask) of one speculators-legacy batch (already shifted: position t
    holds aux states through byte t, byte t+1 and the verifier's state at t+1, whose distribution is the target)."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        hidden = batch["hidden_states"] if device.type == "cuda" else batch["hidden_states"].float()
        logits = drafter(hidden, batch["input_ids"], batch["position_ids"])
    target = head(batch["verifier_last_hidden_states"])
    mask = batch["loss_mask"].float()
    per_token = F.kl_div(torch.log_softmax(logits, dim=-1), target, reduction="none").sum(-1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1), logits, target, mask


@torch.no_grad()
def evaluate(drafter: Drafter, head: VerifierHead, batches: list[dict[str, torch.Tensor]], step: int,
             device: torch.device) -> DrafterEval:
    drafter.eval()
    loss = agree = correct = weight = next_weight = 0.0
    for batch in batches:
        mean_loss, logits, target, mask = drafter_loss(drafter, head, batch, device)
        guess = logits.argmax(-1)
        n = float(mask.sum())
        loss, weight = loss + float(mean_loss) * n, weight + n
        agree += float(((guess == target.argmax(-1)).float() * mask).sum())
        next_mask = mask[:, :-1] * mask[:, 1:]  # the text's next byte is the next position's input
        correct += float(((guess[:, :-1] == batch["input_ids"][:, 1:]).float() * next_mask).sum())
        next_weight += float(next_mask.sum())
    drafter.train()
    return DrafterEval(step, loss / weight, agree / weight, correct / max(next_weight, 1.0))


def loader(store: Path, samples: list[int], args: argparse.Namespace, shuffle: bool = True) -> Any:
    decode = (h5feed.WorkersOptions(num_workers=args.loader_workers) if args.loader_workers
              else h5feed.ThreadsOptions(threads=1))
    return h5feed.BatchLoader(store, flavor=FLAVOR, max_len=args.token_range[1], batch_size=1,
                              hidden_states_dtype=torch.bfloat16, decode=decode,
                              schedule=h5feed.ScheduleOptions(samples=samples, seed=args.seed, shuffle=shuffle))


def eval_batches(store: Path, samples: list[int], args: argparse.Namespace,
                 device: torch.device) -> list[dict[str, torch.Tensor]]:
    """The held-out samples' batches, copied out of the loader's recycled buffers onto the device."""
    with loader(store, samples, args, shuffle=False) as batches:
        return [{k: v.to(device, copy=True) for k, v in b.items() if isinstance(v, torch.Tensor)} for b in batches]


def train_drafter(store: Path, train_samples: list[int], evals: list[dict[str, torch.Tensor]], lm: Any,
                  head: VerifierHead, args: argparse.Namespace, device: torch.device) -> DrafterRun:
    """`--drafter-steps` steps of one sample each, the drafter seeded by --seed and the order by --seed: on two
    stores of the same samples, the only difference is what the stores give back."""
    torch.manual_seed(args.seed)
    aux = h5feed.Store(store).num_aux_layers
    drafter = Drafter(lm, aux).to(device)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=args.drafter_lr)
    run = DrafterRun(str(store), evals=[evaluate(drafter, head, evals, 0, device)])
    every = max(1, args.drafter_steps // 4)
    start = time.perf_counter()
    with loader(store, train_samples, args) as batches:
        epoch = 0
        while len(run.losses) < args.drafter_steps:
            batches.set_epoch(epoch)
            for batch in batches:
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
                loss = drafter_loss(drafter, head, batch, device)[0]
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                run.losses.append(float(loss.detach()))
                step = len(run.losses)
                if step % every == 0 or step == args.drafter_steps:
                    run.evals.append(evaluate(drafter, head, evals, step, device))
                    say(f"drafter on {store.name}: step {step}, train {run.losses[-1]:.4f}, held-out "
                        f"{run.evals[-1].loss:.4f}, top-1 agreement {run.evals[-1].top1_agreement:.3f}")
                if step == args.drafter_steps:
                    break
            epoch += 1
    run.seconds = time.perf_counter() - start
    return run


# --- the outputs ----------------------------------------------------------------------------------


def write_curves(out: Path, runs: dict[str, DrafterRun]) -> None:
    with open(out / "drafter_losses.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *(f"train_loss_{name}" for name in runs)])
        for step, losses in enumerate(zip(*(r.losses for r in runs.values())), 1):
            writer.writerow([step, *(f"{loss:.6f}" for loss in losses)])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), sharey=True)
    for ax, (name, run) in zip(axes, runs.items()):
        steps = range(1, len(run.losses) + 1)
        window = max(1, len(run.losses) // 25)
        smooth = torch.tensor(run.losses).unfold(0, window, 1).mean(1).tolist()
        ax.plot(steps, run.losses, alpha=0.3, label="train (per step)")
        if window > 1:
            ax.plot(range(window, len(run.losses) + 1), smooth, label=f"train (mean of {window} steps)")
        ax.plot([e.step for e in run.evals], [e.loss for e in run.evals], "o-", label="held-out, exact store")
        ax.set_title(f"{name} store: held-out {run.evals[-1].loss:.4g}, top-1 {run.evals[-1].top1_agreement:.3f}")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.legend()
    axes[0].set_ylabel("KL(verifier || drafter), nats")
    fig.suptitle("the same drafter on a small LM trained here on the Python standard library: exact vs FP8 store")
    fig.tight_layout()
    fig.savefig(out / "drafter_losses.png", dpi=110)
    plt.close(fig)


def ab_summary(runs: dict[str, DrafterRun]) -> dict[str, Any]:
    exact, fp8 = runs["exact"], runs["fp8"]
    tail = max(1, len(exact.losses) // 10)

    def last_tenth(run: DrafterRun) -> float:
        return sum(run.losses[-tail:]) / tail

    return {
        "first_train_loss": {name: r.losses[0] for name, r in runs.items()},
        "train_loss_last_tenth_mean": {name: last_tenth(r) for name, r in runs.items()},
        "final_eval": {name: asdict(r.evals[-1]) for name, r in runs.items()},
        "final_eval_loss_fp8_minus_exact": fp8.evals[-1].loss - exact.evals[-1].loss,
        "final_top1_agreement_fp8_minus_exact": fp8.evals[-1].top1_agreement - exact.evals[-1].top1_agreement,
        "train_loss_last_tenth_fp8_minus_exact": last_tenth(fp8) - last_tenth(exact),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    stores_dir = args.stores or args.out / "stores"
    if stores_dir.exists():
        raise SystemExit(f"{stores_dir} exists (an earlier run's stores): remove it, or give another --out or --stores")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    import transformers
    from transformers import LlamaForCausalLM

    corpus = read_corpus(int(args.max_corpus_mb * 1e6) if args.max_corpus_mb else None)
    say(f"corpus: {corpus.root}: {len(corpus.train) / 1e6:.1f} MB in {corpus.train_files} files for training, "
        f"{len(corpus.heldout) / 1e6:.1f} MB in {corpus.heldout_files} held out")
    lm = LlamaForCausalLM(llama_config(args.hidden_size, args.layers, args.train_len)).to(device)
    training = train_lm(lm, corpus, args, device)
    head = VerifierHead(lm)  # float32 copies, before the model is served in bf16
    lm.to(torch.bfloat16).eval()

    aux = aux_layer_indices(args.layers)
    layer_names = [f"aux_input_of_layer_{i}" for i in aux] + ["last_pre_norm"]
    real = {"exact": stores_dir / "exact", "fp8": stores_dir / "fp8"}
    say(f"extracting {args.samples} held-out sequences of {args.tokens} bytes: layers {aux} + the last pre-norm")
    extraction = write_both(real, model_samples(lm, corpus, args, device), args.token_range)
    say(f"extracted and written twice in {extraction.seconds:.1f} s")
    exact_store = h5feed.Store(real["exact"])
    reads_equal = [digest(hidden_rows(exact_store.read_sample(i))) for i in range(len(exact_store))]
    lengths = exact_store.sample_lengths.tolist()[:SYNTHETIC_SAMPLES]
    synthetic = {"exact": stores_dir / "synthetic-exact", "fp8": stores_dir / "synthetic-fp8"}
    write_both(synthetic, synthetic_samples(lengths, args.hidden_size, len(aux) + 1, args.seed), args.token_range)
    say("measuring sizes, FP8 error and activation statistics")
    fp8_real, fp8_synthetic = fp8_report(real), fp8_report(synthetic)
    stats = {"real": activation_stats(exact_store, layer_names, device),
             "synthetic": activation_stats(h5feed.Store(synthetic["exact"]), layer_names, device)}

    eval_samples = list(range(args.samples - args.drafter_eval_samples, args.samples))
    train_samples = list(range(args.samples - args.drafter_eval_samples))
    evals = eval_batches(real["exact"], eval_samples, args, device)
    runs = {name: train_drafter(path, train_samples, evals, lm, head, args, device) for name, path in real.items()}
    write_curves(args.out, runs)

    result = {
        "what": "a small Llama trained here from scratch on the Python standard library's text (bytes), not a "
                "production model; its EAGLE-3 inputs stored exactly and as FP8",
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "aux_layers": list(aux), "corpus_root": corpus.root, "corpus_train_bytes": len(corpus.train),
                   "corpus_heldout_bytes": len(corpus.heldout)},
        "machine": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
                    or "cpu", "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")},
        "lm": asdict(training),
        "extraction": {k: v for k, v in asdict(extraction).items()},
        "exact_reads_equal_written": reads_equal == extraction.written_sha256,
        "fp8": fp8_real,
        "fp8_synthetic_same_shape": fp8_synthetic,
        "activation_stats": stats,
        "drafter": {"runs": {name: {"store": r.store, "seconds": r.seconds, "evals": [asdict(e) for e in r.evals]}
                             for name, r in runs.items()}, **ab_summary(runs)},
        "seconds": time.perf_counter() - T0,
    }
    (args.out / "real_activations.json").write_text(json.dumps(result, indent=2))
    print_summary(result)
    return result


def print_summary(r: dict[str, Any]) -> None:
    lm, real, syn, ab = r["lm"], r["fp8"], r["fp8_synthetic_same_shape"], r["drafter"]
    stats = r["activation_stats"]
    print(f"\n{r['what']}", flush=True)
    print(f"LM: {lm['parameters'] / 1e6:.1f} M parameters, {lm['steps']} steps in {lm['seconds']:.0f} s; held-out "
          f"{lm['bits_per_byte_before']:.3f} -> {lm['bits_per_byte_after']:.3f} bits/byte")
    print(f"stores of {real['samples']} samples, {real['tokens']:,} tokens: raw bf16 / exact {real['raw_bf16_over_exact_hidden']}x, "
          f"raw bf16 / FP8 {real['raw_bf16_over_fp8_hidden']}x (synthetic, same shape: "
          f"{syn['raw_bf16_over_exact_hidden']}x, {syn['raw_bf16_over_fp8_hidden']}x)")
    print(f"FP8 error per token: RMS {real['rms_error_per_token']}, relative {real['relative_rms_error_per_token']} "
          f"(synthetic relative {syn['relative_rms_error_per_token']}); speculators' noise RMS {real['speculators_04_noise_rms']}, "
          f"relative to these activations {stats['real']['speculators_04_noise_rms_over_token_rms']}")
    for name in ("real", "synthetic"):
        print(f"{name}: token max/RMS {stats[name]['token_absmax_over_rms']}")
        for layer, s in stats[name]["layers"].items():
            print(f"  {layer}: RMS {s['rms']}, channel RMS max/median {s['channel_rms_max_over_median']}, channel "
                  f"max/RMS {s['channel_absmax_over_rms']}, kurtosis {s['excess_kurtosis']} (per channel, median "
                  f"{s['channel_excess_kurtosis_median']})")
    print(f"drafter: final held-out {ab['final_eval']}; FP8 - exact: loss {ab['final_eval_loss_fp8_minus_exact']:+.5f}, "
          f"top-1 agreement {ab['final_top1_agreement_fp8_minus_exact']:+.4f}; exact reads equal written: "
          f"{r['exact_reads_equal_written']}; {r['seconds']:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
