"""Stall reports: what a stall is (from the trainer's wait and the workers' progress) and what each worker is doing."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import psutil

from h5feed.observe.renderer import Record, num

RECENT_S = 10.0  # the window of a stall report's "recent" throughput

Verdict = Literal["bottleneck", "stuck", "idle", "waiting", "writer"]


def classify(trainer_wait_s: float | None, worker_quiet_s: list[float] | None, stall_after: float,
             waiting_for_writer: bool = False) -> Verdict | None:
    """What a stall is, from how long the trainer has waited and how long each worker has gone without progress.

    `worker_quiet_s` is None when the loader has no counters; `waiting_for_writer`: a worker of a following
    stream has read every published sample and waits for the writer (then the writer sets the pace, not the
    disk).  None: no stall.
    """
    waited = trainer_wait_s is not None and trainer_wait_s > stall_after
    if waiting_for_writer:  # quiet workers are not idle then: they wait for samples to exist
        return "writer" if waited else None
    if worker_quiet_s is None:
        return "waiting" if waited else None
    quiet = all(q > stall_after for q in worker_quiet_s)  # no worker started counts as quiet
    if waited:
        return "stuck" if quiet else "bottleneck"
    if quiet and worker_quiet_s and trainer_wait_s is None:  # idle: nobody asks; a short wait may yet become one
        return "idle"
    return None


@dataclass
class StallEpisode:
    """One stretch of the trainer waiting for one batch (`waiting_since` its start), or of not waiting (None),
    and the verdicts reported in it.

    Each verdict is reported once per episode, and one called STUCK is not called a BOTTLENECK when a
    worker moves again: a worker reading one chunk now and then must not flip the verdict each second.
    The episode ends when the batch comes (the monitor says so, and after how long)."""

    waiting_since: float | None
    step: int  # batches the trainer had when the episode began
    reported: list[Verdict] = field(default_factory=list)

    def should_report(self, verdict: Verdict | None) -> bool:
        if verdict is None or verdict in self.reported or (verdict == "bottleneck" and "stuck" in self.reported):
            return False
        self.reported.append(verdict)
        return True

    @property
    def held_the_trainer(self) -> bool:
        """Whether a stall of the trainer's wait was reported (an idle loader holds nobody up)."""
        return any(v != "idle" for v in self.reported)


def verdict_text(verdict: Verdict, wait: float | None, quiet: float | None, step: int, recent: Record | None) -> str:
    batch = f"batch {step + 1}"
    if verdict == "stuck":
        progress = "no worker has started" if quiet is None else f"no worker has made progress for {quiet:.1f} s"
        return f"the input pipeline is STUCK: the trainer has waited {wait:.1f} s for {batch} and {progress}"
    if verdict == "bottleneck":
        rates = ""
        if recent is not None:
            rates = (f" ({num(recent['samples_per_s'], '.2f')} samples/s, {num(recent['read_GBps'], '.3f')} GB/s "
                     f"over the last {RECENT_S:.0f} s)")
        return (f"the input pipeline is the BOTTLENECK: the trainer has waited {wait:.1f} s for {batch} while "
                f"workers are still reading{rates}")
    if verdict == "writer":
        return (f"the trainer has waited {wait:.1f} s for {batch}: the loader has read every sample published so far "
                "and WAITS FOR THE WRITER to publish more")
    if verdict == "idle":
        return (f"the input pipeline is IDLE: no worker has made progress for {quiet:.1f} s and the trainer is not "
                "asking for batches (queues full or workers done: the trainer is busy elsewhere)")
    return (f"the trainer has waited {wait:.1f} s for {batch}; this loader has no h5feed counters, so what its "
            "workers do cannot be seen")


def advice(verdict: Verdict, rows: list[Record]) -> str:
    """What to do about a stall, in one sentence ("" when nothing needs doing)."""
    in_hand = [r for r in rows if r["sample"] is not None]
    if verdict == "stuck" and in_hand:
        pids = " ".join(f"py-spy dump --pid {r['pid']}" for r in in_hand[:2])
        return (f"to see where a worker is blocked: `{pids}`; a hung network mount or bucket looks like this, and "
                "a worker that waits on a lock (a second loader over the same files) too")
    if verdict == "stuck":
        who = "no worker has started: one still starting (spawn imports take seconds)" if not rows else \
            "no worker holds a sample: one"
        return (f"{who} or one that died: its error is in this process's log; DataLoader(timeout=...) turns a "
                "worker that never answers into an error")
    if verdict == "bottleneck":
        return ("loading is slower than the step: more DataLoader workers (num_workers) or reader threads (threads), "
                "or a faster disk; `h5feed bench STORE` measures the loaders on this machine")
    if verdict == "writer":
        return ("extraction is slower than training: the trainer goes at the writer's pace (more extraction "
                "servers, or start training later); nothing is wrong with the loader")
    if verdict == "waiting":
        return (f"`py-spy dump --pid {os.getpid()}` shows where the loader is; h5feed's datasets count what their "
                "workers do, and the monitor then names the one that holds the trainer up")
    return ""


def process_state(pid: int) -> tuple[str, float | None]:
    """The worker's process state (running, sleeping, disk-sleep...) and CPU seconds, as `ps` would say."""
    try:
        proc = psutil.Process(pid)
        cpu = proc.cpu_times()
        return proc.status(), cpu.user + cpu.system
    except (psutil.Error, OSError):
        return "gone", None


def worker_sentence(row: Record) -> str:
    state = f"pid {row['pid']}, {row['state']}" + (f", {row['cpu_s']:.1f} s CPU" if row.get("cpu_s") is not None else "")
    if row["sample"] is not None:
        where = f" ({row['object']})" if row["object"] else ""
        doing = (f"sample {row['sample']}{where} for {row['sample_s']:.1f} s, {row['sample_MB']:.1f} MB read so far, "
                 f"no progress for {num(row['since_progress_s'], '.1f', ' s')}")
    else:
        doing = f"no sample in hand, last progress {num(row['since_progress_s'], '.1f', ' s')} ago"
    return (f"  worker {row['worker']} ({state}): {doing}; {row['samples']} samples done, recent "
            f"{num(row['samples_per_s'], '.2f')} samples/s, {num(row['read_MBps'], '.1f')} MB/s, "
            f"queue {row['queue_depth']}")
