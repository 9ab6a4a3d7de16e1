"""speculators 0.7+ (`ArrowDataset` + `CollateFn(preprocess=shift_batch)`) trained from an h5feed store.

The swap, in `create_train_val_loaders` / `_setup_dataloader`:

    # before: a safetensors file per sample; CollateFn copies each item into zeroed buffers,
    # the DataLoader copies the batch into shared memory, pin_memory copies it again
    dataset = ArrowDataset(max_len=M, datapath=data_path, split="train", ...)
    loader = DataLoader(dataset, batch_sampler=..., num_workers=W, pin_memory=True,
                        collate_fn=CollateFn(M, hidden_size, num_target_layers=3, dtype=torch.bfloat16,
                                             preprocess=shift_batch))

    # after: the same batches (document_ids, error_records included), decoded straight into
    # page-locked, recycled batch buffers
    loader = h5feed.BatchLoader("/data/hs.zarr", flavor="speculators", max_len=M, batch_size=B, num_workers=4)

speculators' `Trainer(model, config, train_loader=loader)` takes it as it is: it calls
`len(loader)`, `loader.batch_sampler.set_epoch(epoch)` and iterates, and moves each batch
with `v.to(local_rank, non_blocking=True)`: with BatchLoader that copy is a DMA from the
page-locked slot, and the slot is reused only once the GPU has finished it.

    python examples/speculators_09.py /data/hs.zarr --max-len 2048 --workers 4 --steps 100
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

import h5feed

FLAVOR = "speculators"


class TinyDrafter(nn.Module):
    """Stands in for the EAGLE-3 drafter: fuses the aux layers, adds the next token, predicts the verifier's state."""

    def __init__(self, hidden_size: int, aux_layers: int) -> None:
        super().__init__()
        self.fc = nn.Linear(aux_layers * hidden_size, hidden_size)
        self.embed = nn.Embedding(1024, hidden_size)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, verifier_last_hidden_states: torch.Tensor,
                loss_mask: torch.Tensor, document_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        predicted = self.fc(hidden_states.float()) + self.embed(input_ids % 1024)
        error = (predicted - verifier_last_hidden_states.float()).square().mean(-1)
        weight = loss_mask * (document_ids >= 0)  # pad positions carry document id -1
        return (error * weight).sum() / weight.sum().clamp(min=1)


def make_loader(store: str, loader: str, max_len: int, batch_size: int, workers: int, seed: int) -> Any:
    if loader == "batch":
        return h5feed.BatchLoader(store, flavor=FLAVOR, max_len=max_len, batch_size=batch_size, num_workers=workers,
                                  schedule=h5feed.ScheduleOptions(seed=seed))
    stream = h5feed.HiddenStatesStream(store, flavor=FLAVOR, max_len=max_len,
                                       schedule=h5feed.ScheduleOptions(seed=seed))
    return h5feed.StreamLoader(stream, batch_size=batch_size, num_workers=workers, pin_memory=torch.cuda.is_available(),
                               collate_fn=h5feed.trainer_collate(FLAVOR, max_len))


def train(store: str, *, loader: str = "batch", max_len: int = 2048, batch_size: int = 1, workers: int = 0,
          steps: int = 10, seed: int = 0, device: str | None = None) -> list[float]:
    """Train the tiny drafter for `steps` batches, as speculators' Trainer.train_epoch feeds its model; returns the losses."""
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
            gpu_batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                         for k, v in batch.items()}
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                loss = model(**gpu_batch)
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
    args = parser.parse_args(argv)
    losses = train(args.store, loader=args.loader, max_len=args.max_len, batch_size=args.batch_size,
                   workers=args.workers, steps=args.steps)
    for step, loss in enumerate(losses):
        print(f"step {step} loss {loss:.6f}")
    return losses


if __name__ == "__main__":
    main()
