"""Extraction straight into a store, and a drafter training on it while extraction runs: no `.pt` file at all.

A causal LM (here a small Llama with random weights, made on the spot; `run(..., model=...)` takes any of
transformers' causal LMs) runs over prompts with `output_hidden_states=True`.  For each prompt the
EAGLE-3 inputs are kept as speculators' `.pt` files hold them (`hidden_states`: K aux layers, then the
last layer's output before the final norm, taken by a hook) and appended to the store by
`h5feed.open_writer`.  A trainer in the same script follows the store (`Follow`) and trains the tiny
drafter of examples/speculators_04.py on each sample as soon as it is published.

    python examples/extract_and_train.py /tmp/hs.zarr --prompts 32 --tokens 64:256

It needs transformers beside h5feed (`pip install transformers`); the tiny model runs on the CPU, no GPU needed.

A vLLM or SGLang connector would be the same: its `save_kv_layer` / hidden-state hook calls
`writer.append(input_ids=..., hidden_states=[...])` per finished request.
"""

from __future__ import annotations

import argparse
import importlib.util
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import h5feed

AUX_LAYERS = (1, 2, 3)  # EAGLE-3's low, middle and high layers, of the tiny model's 4


@dataclass
class Extraction:
    samples: int = 0
    tokens: int = 0
    model_seconds: float = 0.0  # the forward passes
    writer_seconds: float = 0.0  # what append() added to the loop (with write_behind: checks and a copy)


def tiny_llama(hidden_size: int, layers: int, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=4096)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def extract(model: Any, store: Path, prompts: int, tokens: tuple[int, int], seed: int, **writer_options: Any) -> Extraction:
    """Run the model over random prompts and append each sample's EAGLE-3 inputs to `store`."""
    done = Extraction()
    last_layer: list[torch.Tensor] = []
    hook = model.model.layers[-1].register_forward_hook(lambda _m, _i, out: last_layer.append(out[0] if isinstance(out, tuple) else out))
    rng = torch.Generator().manual_seed(seed)
    try:
        with h5feed.open_writer(store, **writer_options) as writer, torch.no_grad():
            for i in range(prompts):
                length = int(torch.randint(tokens[0], tokens[1] + 1, (1,), generator=rng))
                ids = torch.randint(0, model.config.vocab_size, (1, length), generator=rng)
                t0 = time.perf_counter()
                out = model(input_ids=ids, output_hidden_states=True)
                aux = [out.hidden_states[layer][0] for layer in AUX_LAYERS]  # [T, H] each
                t1 = time.perf_counter()
                writer.append(input_ids=ids[0], hidden_states=[*aux, last_layer.pop()[0]],
                              loss_mask=torch.ones(length, dtype=torch.long), name=f"prompt-{i}")
                done.model_seconds += t1 - t0
                done.writer_seconds += time.perf_counter() - t1
                done.samples, done.tokens = done.samples + 1, done.tokens + length
    finally:
        hook.remove()
    return done


def tiny_drafter_class() -> Any:
    """The drafter of examples/speculators_04.py (loaded from the file beside this one)."""
    spec = importlib.util.spec_from_file_location("speculators_04_example", Path(__file__).with_name("speculators_04.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.TinyDrafter


def train_following(store: Path, max_len: int, poll_s: float = 0.05) -> list[float]:
    """The tiny drafter, one sample per step, on each sample as soon as the writer publishes it."""
    following = h5feed.ScheduleOptions(shuffle=False, follow=h5feed.Follow(poll_s=poll_s))
    stream = h5feed.HiddenStatesStream(store, max_len=max_len, hidden_states_dtype=torch.bfloat16, schedule=following)
    info = stream.store.info
    drafter = tiny_drafter_class()(info.hidden_size, info.num_aux_layers)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    collate = h5feed.trainer_collate("speculators-legacy", max_len)
    losses = []
    for item in h5feed.StreamLoader(stream, batch_size=1, collate_fn=collate):
        loss = drafter(**item)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def run(store: Path, prompts: int = 16, tokens: tuple[int, int] = (32, 128), hidden_size: int = 64, seed: int = 0,
        max_len: int = 256, model: Any = None) -> tuple[Extraction, list[float]]:
    """Extraction on a thread, training following it on this one; returns both sides' figures."""
    model = model if model is not None else tiny_llama(hidden_size, 4, seed)
    result: dict[str, Any] = {}

    def extraction() -> None:
        try:
            result["done"] = extract(model, store, prompts, tokens, seed,
                                     settings=h5feed.StoreSettings(chunk_tokens=64, shard_tokens=512),
                                     writing=h5feed.WriteOptions(publish_every=1, write_behind=2))
        except BaseException as exc:  # noqa: BLE001 (re-raised on the trainer's thread)
            result["error"] = exc

    thread = threading.Thread(target=extraction, name="extraction")
    thread.start()
    while not _published(store) and thread.is_alive():  # the trainer starts on the first published sample
        time.sleep(0.02)
    losses = train_following(store, max_len) if "error" not in result else []
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["done"], losses


def _published(store: Path) -> bool:
    try:
        return len(h5feed.Store(store)) > 0
    except (h5feed.StoreError, FileNotFoundError):
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", type=Path)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", default="32:128", help="prompt lengths, MIN:MAX")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    args = p.parse_args()
    if importlib.util.find_spec("transformers") is None:  # said before a store is made, not at the model's import
        raise SystemExit(f"{Path(__file__).name}: the model is made with transformers, which is not installed: "
                         "pip install transformers")
    low, high = (int(x) for x in args.tokens.split(":"))
    done, losses = run(args.store, args.prompts, (low, high), args.hidden_size, max_len=args.max_len)
    print(f"extracted {done.samples} samples ({done.tokens} tokens): model {done.model_seconds:.2f} s, "
          f"writer {done.writer_seconds:.2f} s ({1e3 * done.writer_seconds / max(done.samples, 1):.1f} ms/sample)")
    print(f"trained {len(losses)} steps while extracting; loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
