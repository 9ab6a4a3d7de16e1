"""SpecForge offline EAGLE-3 (`OfflineEagle3Dataset` + `DataCollatorWithPadding`) trained from an h5feed store.

The swap, where `train_eagle3.py` builds its offline dataloader:

    # before: a .ckpt per sample (torch.load with weights_only=False), padded by the collate
    dataset = build_offline_eagle3_dataset(hidden_states_path, max_len=M)
    loader = prepare_dp_dataloaders(dataset, batch_size=B, num_workers=W, shuffle=True, process_group=...)

    # after: the same padded batches, decoded straight into page-locked, recycled batch buffers
    # (flavor="specforge-shifted" for SpecForge builds before 2026-01-22, whose dataset shifted)
    loader = h5feed.BatchLoader("/data/hs.zarr", flavor="specforge", max_len=M, batch_size=B, num_workers=4,
                                schedule=h5feed.ScheduleOptions(rank=dp_rank, world_size=dp_size))

    python examples/specforge.py /data/hs.zarr --max-len 2048 --workers 4 --steps 100
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

import h5feed


class TinyDrafter(nn.Module):
    """Stands in for the EAGLE-3 drafter: fuses the aux layers, adds the token, predicts the target state."""

    def __init__(self, hidden_size: int, aux_layers: int) -> None:
        super().__init__()
        self.fc = nn.Linear(aux_layers * hidden_size, hidden_size)
        self.embed = nn.Embedding(1024, hidden_size)

    def forward(self, hidden_state: torch.Tensor, input_ids: torch.Tensor, target: torch.Tensor,
                loss_mask: torch.Tensor, attention_mask: torch.Tensor, **_: Any) -> torch.Tensor:
        predicted = self.fc(hidden_state.float()) + self.embed(input_ids % 1024)
        error = (predicted - target.float()).square().mean(-1)
        weight = loss_mask * attention_mask
        return (error * weight).sum() / weight.sum().clamp(min=1)


def make_loader(store: str, loader: str, flavor: str, max_len: int, batch_size: int, workers: int, seed: int) -> Any:
    if loader == "batch":
        return h5feed.BatchLoader(store, flavor=flavor, max_len=max_len, batch_size=batch_size, num_workers=workers,
                                  schedule=h5feed.ScheduleOptions(seed=seed))
    stream = h5feed.HiddenStatesStream(store, flavor=flavor, max_len=max_len,
                                       schedule=h5feed.ScheduleOptions(seed=seed))
    return h5feed.StreamLoader(stream, batch_size=batch_size, num_workers=workers, pin_memory=torch.cuda.is_available(),
                               collate_fn=h5feed.trainer_collate(flavor, max_len))


def train(store: str, *, loader: str = "batch", flavor: str = "specforge", max_len: int = 2048, batch_size: int = 1,
          workers: int = 0, steps: int = 10, seed: int = 0, device: str | None = None) -> list[float]:
    """Train the tiny drafter for `steps` batches; returns the losses."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    info = h5feed.Store(store)
    torch.manual_seed(seed)
    model = TinyDrafter(info.hidden_size, info.num_aux_layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_loader(store, loader, flavor, max_len, batch_size, workers, seed)
    losses: list[float] = []
    epoch = 0
    while len(losses) < steps:
        batches.dataset.set_epoch(epoch)  # the stream: same order on every rank, new each epoch
        for batch in batches:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
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
    parser.add_argument("--flavor", choices=["specforge", "specforge-shifted"], default="specforge")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    losses = train(args.store, loader=args.loader, flavor=args.flavor, max_len=args.max_len,
                   batch_size=args.batch_size, workers=args.workers, steps=args.steps)
    for step, loss in enumerate(losses):
        print(f"step {step} loss {loss:.6f}")
    return losses


if __name__ == "__main__":
    main()
