"""Where the monitor's scalars go besides its lines and JSON: TensorBoard's events file, a Weights & Biases run.

Each sink takes one set of scalars per report window, named as torchtitan names
them (`time_metrics/data_loading(%)`, ...), at the run's count of completed steps.  One sink per
backend; `scalar_sinks` makes the ones asked for, and says what to install when a
backend that was asked for by name is missing.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal, Protocol

from h5feed.observe.renderer import Record

Wanted = bool | Literal["auto"]

# the record's figures each report sends, by tag
STEP_SCALARS = {"time_metrics/data_loading(s)": "data_loading(s)", "time_metrics/data_loading(%)": "data_loading(%)",
                "time_metrics/step_time(s)": "step_time(s)", "time_metrics/gpu_idle(%)": "gpu_idle(%)",
                "throughput(steps/s)": "throughput(steps/s)", "throughput(samples/s)": "throughput(samples/s)"}
LOADER_SCALARS = ("samples_per_s", "read_GBps", "decoded_GBps", "queue_depth")


def report_scalars(rec: Record) -> dict[str, float]:
    """The scalars of one report record: the step figures, the loader's rates and each worker's samples/s."""
    scalars = {tag: rec[key] for tag, key in STEP_SCALARS.items() if rec.get(key) is not None}
    if rec.get("loader") is not None:
        scalars |= {f"loader/{key}": rec["loader"][key] for key in LOADER_SCALARS if rec["loader"].get(key) is not None}
        scalars |= {f"loader/worker{row['worker']}/samples_per_s": row["samples_per_s"]
                    for row in rec["workers"] if row["samples_per_s"] is not None}
    return scalars


class ScalarSink(Protocol):
    def write(self, prefix: str, scalars: dict[str, float], step: int) -> None:
        """Record `scalars` (tags under `prefix`) at the run's global `step`."""

    def flush(self) -> None: ...


class TensorBoardSink:
    """One events file in `log_dir` for the whole run (its steps only increase)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, prefix: str, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(f"{prefix}/{tag}", value, step)

    def flush(self) -> None:
        self.writer.flush()


class WandbSink:
    """The trainer's own W&B run (`wandb.run`).  h5feed's scalars are plotted against their own step metric,
    `{prefix}/global_step`, and logged with `commit=False`: they join the trainer's next row and never move
    the run's step, so a trainer that logs with `step=` of its own loses nothing."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._defined: set[str] = set()

    def write(self, prefix: str, scalars: dict[str, float], step: int) -> None:
        if prefix not in self._defined:
            self.run.define_metric(f"{prefix}/global_step")
            self.run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/global_step")
            self._defined.add(prefix)
        self.run.log({f"{prefix}/global_step": step} | {f"{prefix}/{tag}": v for tag, v in scalars.items()},
                     commit=False)

    def flush(self) -> None:
        """W&B sends in the background; the trainer's `wandb.finish()` flushes."""


def tensorboard_sink(wanted: Wanted, log_dir: Path | None) -> TensorBoardSink | None:
    if not wanted:
        return None
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        if wanted == "auto":
            return None
        raise ImportError("h5feed.monitor(tensorboard=True) needs the tensorboard package: pip install tensorboard") from None
    if log_dir is None:
        if wanted == "auto":
            return None
        raise ValueError("h5feed.monitor(tensorboard=True) needs log_dir")
    return TensorBoardSink(log_dir)


def wandb_sink(wanted: Wanted) -> WandbSink | None:
    """The active W&B run's sink.  "auto": only when the trainer imported wandb and called `wandb.init()`
    (h5feed never imports wandb itself then: it takes seconds)."""
    if not wanted:
        return None
    wandb = sys.modules.get("wandb")
    if wandb is None and wanted is True:
        try:
            import wandb
        except ImportError:
            raise ImportError("h5feed.monitor(wandb=True) needs the wandb package: pip install wandb") from None
    run = getattr(wandb, "run", None)
    if run is None:
        if wanted == "auto":
            return None
        raise ValueError("h5feed.monitor(wandb=True) logs to the active W&B run: call wandb.init() before it")
    return WandbSink(run)
