"""speculators 0.4 (`Eagle3SampleFileDataset` + `create_collate_fn`) trained from an h5feed store.

The swap, in the trainer's `setup_dataloader`:

    # before: ~100 MB .pt per sample; cat + pad, a copy into shared memory, a pin_memory copy
    dataset = Eagle3SampleFileDataset(file_list=files, max_len=M, transform=AddUniformNoise(...))
    loader = DataLoader(dataset, batch_sampler=..., num_workers=8, pin_memory=True, collate_fn=create_collate_fn(M))

    # after: the same batches, decoded once, straight into page-locked, recycled batch buffers
    loader = h5feed.BatchLoader("/data/hs.zarr", flavor="speculators-legacy", max_len=M, batch_size=B, num_workers=4)

    # or keep a DataLoader (h5feed's items and the trainer's collate, one copy per batch)
    stream = h5feed.HiddenStatesStream("/data/hs.zarr", flavor="speculators-legacy", max_len=M)
    loader = h5feed.StreamLoader(stream, batch_size=B, num_workers=4, pin_memory=True,
                                 collate_fn=h5feed.trainer_collate("speculators-legacy", M))

0.4's `Trainer` takes the loader as its train_loader (it calls `len()`, `batch_sampler.set_epoch`
and iterates).  0.4 adds its noise to each item; BatchLoader builds no items, so the noise goes onto the
batch's rows instead (`add_uniform_noise`): the same distribution, drawn on the device.

    python examples/speculators_04.py /data/hs.zarr --max-len 2048 --workers 4 --steps 100
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

import h5feed

FLAVOR = "speculators-legacy"


class TinyDrafter(nn.Module):
    """Stands in for the EAGLE-3 drafter: fuses the aux layers, adds the next token, predicts the verifier's state."""

    def __init__(self, hidden_size: int, aux_layers: int) -> None:
        super().__init__()
        self.fc = nn.Linear(aux_layers * hidden_size, hidden_size)
        self.embed = nn.Embedding(1024, hidden_size)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, verifier_last_hidden_states: torch.Tensor,
                loss_mask: torch.Tensor, **_: Any) -> torch.Tensor:
        predicted = self.fc(hidden_states.float()) + self.embed(input_ids % 1024)
        error = (predicted - verifier_last_hidden_states.float()).square().mean(-1)
        return (error * loss_mask).sum() / loss_mask.sum().clamp(min=1)


def add_uniform_noise(batch: dict[str, Any], std: float) -> None:
    """0.4 train.py's `AddUniformNoise(std, tensors=("hidden_states", "verifier_last_hidden_states"))`, on the
    batch: every packed row gets noise, the pad rows stay zero, as when it was added to each item."""
    used = int(batch["lengths"].sum())
    for key in ("hidden_states", "verifier_last_hidden_states"):
        rows = batch[key][:, :used]
        rows.add_(2 * (torch.rand_like(rows) - 0.5) * std)


def make_loader(store: str, loader: str, max_len: int, batch_size: int, workers: int, seed: int) -> Any:
    if loader == "batch":
        return h5feed.BatchLoader(store, flavor=FLAVOR, max_len=max_len, hidden_states_dtype=torch.bfloat16,
                                  batch_size=batch_size, num_workers=workers,
                                  schedule=h5feed.ScheduleOptions(seed=seed))
    stream = h5feed.HiddenStatesStream(store, flavor=FLAVOR, max_len=max_len, hidden_states_dtype=torch.bfloat16,
                                       schedule=h5feed.ScheduleOptions(seed=seed))
    return h5feed.StreamLoader(stream, batch_size=batch_size, num_workers=workers, pin_memory=torch.cuda.is_available(),
                               collate_fn=h5feed.trainer_collate(FLAVOR, max_len))


def train(store: str, *, loader: str = "batch", max_len: int = 2048, batch_size: int = 1, workers: int = 0,
          steps: int = 10, noise_std: float = 0.05, seed: int = 0, device: str | None = None) -> list[float]:
    """Train the tiny drafter for `steps` batches; returns the losses."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    info = h5feed.Store(store)
    torch.manual_seed(seed)
    model = TinyDrafter(info.hidden_size, info.num_aux_layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_loader(store, loader, max_len, batch_size, workers, seed)
    losses: list[float] = []
    epoch = 0
    while len(losses) < steps:
        batches.dataset.set_epoch(epoch)  # the stream: same order on every rank, new each epoch
        for batch in batches:
            batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            if noise_std:
                add_uniform_noise(batch, noise_std)
            loss = model(**batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
        epoch += 1
    return losses


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("--loader", choices=["batch", "dataloader"], default="batch")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--noise-std", type=float, default=0.05)
    args = parser.parse_args(argv)
    losses = train(args.store, loader=args.loader, max_len=args.max_len, batch_size=args.batch_size,
                   workers=args.workers, steps=args.steps, noise_std=args.noise_std)
    for step, loss in enumerate(losses):
        print(f"step {step} loss {loss:.6f}")
    return losses


if __name__ == "__main__":
    main()
