"""`monitor(headspace=N)`: what data costs the training step, from N steps on a replayed batch against the loaded ones.

Why apart from the monitor: it is a measurement of its own (SPDL's headspace analysis), with its own sums and its
own sentence; the monitor only says which kind each step was and hands the batch over again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from h5feed.observe.renderer import Record

NOTHING_PCT = 1.0  # a headspace below this: data costs the step nothing measurable

StepKind = Literal["first", "loaded", "replayed"]  # the pass's first step (the loader's start-up), or not


@dataclass
class Headspace:
    """The steps' time with the loader's batches and on a replayed one (`headspace=`): what data costs the step.

    The pass's first step is left out of the loaded ones: its wait is the loader's start-up, a cost of its own
    (`first_batch(s)`), not the steady state that the replayed steps are measured in."""

    loaded_steps: int = 0
    loaded_s: float = 0.0
    replayed_steps: int = 0
    replayed_s: float = 0.0

    def add(self, kind: StepKind, step_s: float) -> None:
        if kind == "loaded":
            self.loaded_steps += 1
            self.loaded_s += step_s
        elif kind == "replayed":
            self.replayed_steps += 1
            self.replayed_s += step_s

    def figures(self) -> Record:
        loaded = self.loaded_s / self.loaded_steps if self.loaded_steps else None
        replayed = self.replayed_s / self.replayed_steps if self.replayed_steps else None
        faster = 100 * (loaded / replayed - 1) if loaded is not None and replayed else None
        return {"headspace(%)": faster, "step_loaded(s)": loaded, "step_replayed(s)": replayed,
                "replayed_steps": self.replayed_steps}


def headspace_text(rec: Record, measured_before: bool, batches: int, replays: int) -> str:
    """The end line's headspace (`rec` holds `Headspace.figures`): how much faster the step would be if data cost
    nothing, or why it is not known (measured in an earlier pass of the run, or a pass of `batches` too few for
    the replay of `replays` steps to begin)."""
    faster = rec["headspace(%)"]
    if faster is None:
        if measured_before:
            return "headspace measured in an earlier pass of this run"
        return f"headspace not measured: the pass had {batches} batches, and the replay begins after {replays + 1}"
    times = (f"a step took {rec['step_loaded(s)']:.4f} s with the loader's batches, "
             f"{rec['step_replayed(s)']:.4f} s on {rec['replayed_steps']} replayed ones")
    if faster < NOTHING_PCT:
        return f"data costs the step nothing measurable: {times}"
    return f"training would run {faster:.0f}% faster if data cost nothing: {times}"
