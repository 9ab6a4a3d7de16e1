"""Per-step bookkeeping of the monitor: running sums of step and wait time, and the GPU's idle time per step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields
from typing import Literal, NamedTuple

import torch

MAX_PENDING_STEPS = 1024  # CUDA event triples kept while the CPU runs ahead of the GPU


class GpuSpan(NamedTuple):
    """How long the GPU had no work over a span of the trainer's time, and how many steps the span ends: one,
    or none for the wait in the call that got the loader's end (which counts with the pass's last step)."""

    idle_s: float
    span_s: float
    steps: int


@dataclass
class StepTotals:
    """Running sums over completed steps; a window is the difference of two copies."""

    steps: int = 0
    step_s: float = 0.0
    wait_s: float = 0.0
    samples: int = 0
    batch_bytes: int = 0
    gpu_steps: int = 0  # steps whose GPU idle time is known (events complete)
    gpu_step_s: float = 0.0
    gpu_idle_s: float = 0.0

    def copy(self) -> StepTotals:
        return StepTotals(**self.__dict__)

    def __sub__(self, other: StepTotals) -> StepTotals:
        return StepTotals(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def add_gpu(self, spans: list[GpuSpan]) -> None:
        for span in spans:
            self.gpu_steps += span.steps
            self.gpu_step_s += span.span_s
            self.gpu_idle_s += span.idle_s


class GpuTimer:
    """How long the GPU had no work while the trainer waited for each batch, without waiting on the GPU.

    When the trainer asks for a batch, either its stream has finished all queued
    work (`query()`; e.g. after a `loss.item()`), and the GPU then idles exactly as
    long as `next()` blocks; or work is still queued (the CPU runs ahead), and CUDA
    events recorded at the call (C) and at hand-off (H) give the GPU's idle gap,
    read once H has completed.  Host time is the better clock in the first case:
    an event recorded while the pin-memory thread holds the driver (allocating
    pinned memory) gets a late timestamp.
    """

    def __init__(self) -> None:
        self._free: list[torch.cuda.Event] = []
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event, float, int]] = deque()
        self._mode: Literal["off", "host", "events"] = "off"  # how the current step is timed
        self._call: torch.cuda.Event | None = None
        self._handoff: torch.cuda.Event | None = None

    def _record(self) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def called(self) -> None:
        """The trainer asks for the next batch: everything of its step so far is queued."""
        if torch.cuda.current_stream().query():
            self._mode = "host"
        else:
            self._mode, self._call = "events", self._record()

    def handed_off(self) -> None:
        if self._mode == "events":
            self._handoff = self._record()

    def step_done(self, wait_s: float, step_s: float, steps: int = 1) -> list[GpuSpan]:
        """The spans known by now, the one that just ended (`steps` steps of `step_s`) included if it can be."""
        if self._mode == "host":
            return [GpuSpan(wait_s, step_s, steps)]
        if self._mode == "events" and self._call is not None and self._handoff is not None:
            self._pending.append((self._call, self._handoff, step_s, steps))
            if len(self._pending) > MAX_PENDING_STEPS:
                self._pending.popleft()
        return self.collect()

    def collect(self, wait: bool = False) -> list[GpuSpan]:
        """Spans whose events have completed; `wait` blocks (end of iteration only)."""
        done = []
        while self._pending and (wait or self._pending[0][1].query()):
            call, handoff, step_s, steps = self._pending.popleft()
            handoff.synchronize()
            done.append(GpuSpan(call.elapsed_time(handoff) / 1e3, step_s, steps))
            self._free += [call, handoff]
        return done
