"""The training step `h5feed bench` runs beside each loader: a representative EAGLE-3 drafter step, or the user's.

A loader is judged by what it leaves the trainer: samples/s with the step against the step
alone.  Data wait cannot show what a loader takes from the step itself (its GPU kernels beside
the step's, its threads holding the trainer's interpreter), so the bench runs a real step at the
store's shape: `DrafterStep`, an EAGLE-3 drafter (fc from K*H to H over the aux hidden states,
one Llama-style decoder layer on cat[embedding(input_ids), hidden], 2H -> H: RMSNorm, rotary
attention through `scaled_dot_product_attention`, SwiGLU MLP; lm_head to the draft vocabulary;
3 training-time-test steps, each a loss against the soft targets of a frozen verifier head;
fused AdamW, bf16 autocast), with the many small kernel launches a real step makes.  Kimi-K2's
shape (H=7168) takes 60-80 ms a step on one H200.

A user's own step: `--step package.module:function`, where ``function(store, device)`` returns
a callable that runs one training step on a batch as the loader yields it (`TrainingStep`).
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from h5feed.errors import H5feedError
from h5feed.store import Store
from h5feed.testing.baseline import create_collate_fn

DRAFT_VOCAB = 32000
EMBED_VOCAB = 32768  # the verifier's embedding: covers the synthetic sets' token ids (the draft vocabulary may be smaller)
TTT_STEPS = 3
Batch = dict[str, torch.Tensor]
TrainingStep = Callable[[dict[str, Any]], object]  # one optimizer step on the trainer's batch, as the loader yields it
REPRESENTATIVE = "drafter"  # --step's name for `DrafterStep` at the store's shape


@dataclass(frozen=True)
class StepOptions:
    """The training step `h5feed bench` runs beside every loader, as a trainer's loop runs it.

    name: "drafter" (`REPRESENTATIVE`, the default), the representative EAGLE-3 drafter step at the store's shape,
        or "package.module:function" (your own: function(store, device) returns a callable that runs one step).
    device: where it runs (default: the GPU, where CUDA is; without it no step runs unless a device is given, as
        tests give the CPU).
    """

    name: str = REPRESENTATIVE
    device: torch.device | str | None = None


@dataclass(frozen=True)
class Shape:
    hidden: int
    aux_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int = DRAFT_VOCAB

    @classmethod
    def for_hidden(cls, hidden: int, aux_layers: int) -> Shape:
        """Kimi-K2 / DeepSeek-V3 proportions: H=7168 -> 56 heads of 128, 8 KV heads, a SwiGLU of 18432."""
        head_dim = min(128, max(8, hidden // 4))
        heads = hidden // head_dim
        return cls(hidden, aux_layers, heads, max(1, heads // 7), head_dim, hidden * 18 // 7)


class RMSNorm(nn.RMSNorm):
    """Computed in float32 as Llama's is (the fused kernel also needs input and weight of one dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).to(x.dtype)


def _rotary(position_ids: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    freqs = position_ids[..., None].float() * inv_freq  # [B, T, d/2]
    angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, d]
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class DecoderLayer(nn.Module):
    """EAGLE-3's Llama layer: attention reads [norm(embeds), norm(hidden)] (2H wide); the residual is the hidden."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s = s
        self.input_norm, self.hidden_norm, self.post_norm = (RMSNorm(s.hidden, eps=1e-6) for _ in range(3))
        self.q = nn.Linear(2 * s.hidden, s.heads * s.head_dim, bias=False)
        self.k = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.gate = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = hidden.shape
        x = torch.cat([self.input_norm(embeds), self.hidden_norm(hidden)], dim=-1)
        q = self.q(x).view(b, t, self.s.heads, self.s.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.s.kv_heads, self.s.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.s.kv_heads, self.s.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        groups = self.s.heads // self.s.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = hidden + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        y = self.post_norm(h)
        return h + self.down(F.silu(self.gate(y)) * self.up(y))


def _shift(x: torch.Tensor) -> torch.Tensor:
    """One token further ahead along the sequence, zero at the end."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


class Drafter(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(EMBED_VOCAB, s.hidden).requires_grad_(False)  # the verifier's, frozen
        self.fc = nn.Linear(s.aux_layers * s.hidden, s.hidden, bias=False)
        self.layer = DecoderLayer(s)
        self.norm = RMSNorm(s.hidden, eps=1e-6)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        self.verifier_norm = RMSNorm(s.hidden, eps=1e-6).requires_grad_(False)
        self.verifier_head = nn.Linear(s.hidden, s.vocab, bias=False).requires_grad_(False)

    def forward(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            target = torch.softmax(self.verifier_head(self.verifier_norm(batch["verifier_last_hidden_states"])).float(), -1)
        mask = batch["loss_mask"].float()
        embeds = self.embed(batch["input_ids"])
        hidden = self.fc(batch["hidden_states"])
        cos, sin = _rotary(batch["position_ids"], self.s.head_dim)
        loss = hidden.new_zeros((), dtype=torch.float32)
        for k in range(TTT_STEPS):
            hidden = self.layer(embeds, hidden, cos, sin)
            logp = torch.log_softmax(self.lm_head(self.norm(hidden)).float(), dim=-1)
            loss = loss + (-(target * logp).sum(-1) * mask).sum() / mask.sum().clamp(min=1)
            if k + 1 < TTT_STEPS:
                embeds, target, mask = _shift(embeds), _shift(target), _shift(mask)
        return loss / TTT_STEPS


class DrafterStep:
    """One EAGLE-3 training step of `Drafter` on the trainer's batch: forward with 3 training-time-test steps,
    backward, gradient clipping and a fused AdamW step (bf16 autocast on a GPU).  Called with a batch as the
    loader yields it (on the CPU or already on the device); returns the loss, on the device."""

    def __init__(self, s: Shape, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        with device:
            self.model = Drafter(s)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-4, fused=self.cuda)
        self.params = params

    def __call__(self, batch: dict[str, Any]) -> torch.Tensor:
        dtype = torch.bfloat16 if self.cuda else torch.float32
        batch = {k: v.to(self.device, non_blocking=True) for k, v in drafter_inputs(batch).items()}
        batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
            loss = self.model(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def drafter_inputs(batch: dict[str, Any]) -> Batch:
    """The drafter's inputs from a trainer's batch: speculators' as they are; Model-Optimizer's
    (`EagleOfflineDataCollator`: the hidden states under `base_model_outputs`) and SpecForge's (`hidden_state`,
    `target`) mapped onto them, the positions 0..T-1 of each row as their models compute them."""
    if "hidden_states" in batch:
        return batch
    if "base_model_outputs" in batch:
        outputs = batch["base_model_outputs"]
        aux, last = outputs["aux_hidden_states"], outputs["base_model_hidden_states"]
    elif "hidden_state" in batch and "target" in batch:
        aux, last = batch["hidden_state"], batch["target"]
    else:
        raise ValueError(f"the representative drafter step takes speculators', SpecForge's or Model-Optimizer's "
                         f"batches, not one with the keys {sorted(batch)}: pass your own step (--step module:function)")
    input_ids = batch["input_ids"]
    return {"input_ids": input_ids, "loss_mask": batch["loss_mask"], "hidden_states": aux,
            "verifier_last_hidden_states": last,
            "position_ids": torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)}


def warm_batch(shape: Shape, max_len: int) -> Batch:
    """A full-length batch of random values (speculators 0.4's collate) to calibrate and warm the step on."""
    return create_collate_fn(max_len)([{
        "input_ids": torch.randint(0, EMBED_VOCAB, (max_len,)),
        "hidden_states": torch.randn(max_len, shape.aux_layers * shape.hidden, dtype=torch.bfloat16),
        "verifier_last_hidden_states": torch.randn(max_len, shape.hidden, dtype=torch.bfloat16),
        "loss_mask": torch.ones(max_len, dtype=torch.long),
        "lengths": torch.tensor([max_len]),
        "position_ids": torch.arange(max_len),
    }])


def training_step(name: str, store: Store, device: torch.device) -> TrainingStep:
    """The step `name` names: `REPRESENTATIVE` (`DrafterStep` at the store's hidden size and aux layers), or
    "package.module:function", whose ``function(store, device)`` returns the user's step."""
    if name == REPRESENTATIVE:
        return DrafterStep(Shape.for_hidden(store.hidden_size, store.num_aux_layers), device)
    module_name, _, function_name = name.partition(":")
    if not module_name or not function_name:
        raise H5feedError(f"--step {name}: give {REPRESENTATIVE!r} or your step's maker as package.module:function")
    try:
        make = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as e:
        raise H5feedError(f"--step {name}: cannot import it ({e}); is its package on PYTHONPATH?") from e
    step = make(store, device)
    if not callable(step):
        raise H5feedError(f"--step {name}: {function_name}(store, device) returned {type(step).__name__}, not a "
                          "callable that runs one training step on a batch")
    return step


@dataclass(frozen=True)
class StepAlone:
    """The step with its batch already on the device, no loader running: the speed a loader is measured against.
    `cpu_seconds`: this process's CPU a step (the step's own kernel launches), taken off a pass's CPU so that
    what is left is the loader's."""

    name: str
    device: str
    seconds: float
    cpu_seconds: float

    @property
    def samples_per_s(self) -> float:
        return 1.0 / self.seconds


class StepRunner:
    """Runs the training step on each batch a loader yields, as a trainer does: the step, then a wait for the
    step's stream (trainers take the loss's value every step to log it)."""

    def __init__(self, name: str, step: TrainingStep, device: torch.device) -> None:
        self.name, self.step, self.device = name, step, device

    def __call__(self, batch: dict[str, Any]) -> None:
        self.step(batch)
        if self.device.type == "cuda":  # the step's stream only, as `loss.item()` waits: not a GPU loader's own
            torch.cuda.current_stream(self.device).synchronize()

    def alone(self, batch: dict[str, Any], steps: int, warm_up: int = 3) -> StepAlone:
        """The step timed `steps` times on `batch`, moved to the device first, after `warm_up` steps (kernels,
        the allocator, the optimizer's state)."""
        staged = on_device(batch, self.device)
        for _ in range(warm_up):
            self(staged)
        wall, cpu = time.perf_counter(), _process_cpu()
        for _ in range(steps):
            self(staged)
        where = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
        return StepAlone(self.name, where, (time.perf_counter() - wall) / steps, (_process_cpu() - cpu) / steps)


def on_device(batch: Any, device: torch.device, copy: bool = False) -> Any:
    """A batch (tensors, in dicts and lists) moved to `device`; with `copy`, always a copy (a loader's batch may
    live in memory it reuses for a later batch)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, copy=copy)
    if isinstance(batch, dict):
        return {key: on_device(value, device, copy) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(on_device(value, device, copy) for value in batch)
    return batch


def _process_cpu() -> float:
    t = os.times()
    return t.user + t.system
