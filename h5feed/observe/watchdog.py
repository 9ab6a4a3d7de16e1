"""Stall reports: what a stall is (from the trainer's wait and the workers' progress) and what each worker is doing."""

from __future__ import annotations

from typing import Literal

import psutil

from h5feed.observe.renderer import Record, num

RECENT_S = 10.0  # the window of a stall report's "recent" throughput

Verdict = Literal["bottleneck", "stuck", "idle", "waiting"]


def classify(trainer_wait_s: float | None, worker_quiet_s: list[float] | None, stall_after: float) -> Verdict | None:
    """What a stall is, from how long the trainer has waited and how long each worker has gone without progress.

    `worker_quiet_s` is None when the loader has no counters.  None: no stall.
    """
    waited = trainer_wait_s is not None and trainer_wait_s > stall_after
    if worker_quiet_s is None:
        return "waiting" if waited else None
    quiet = all(q > stall_after for q in worker_quiet_s)  # no worker started counts as quiet
    if waited:
        return "stuck" if quiet else "bottleneck"
    if quiet and worker_quiet_s:
        return "idle"
    return None


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
    if verdict == "idle":
        return (f"the input pipeline is IDLE: no worker has made progress for {quiet:.1f} s and the trainer is not "
                "asking for batches (queues full or workers done: the trainer is busy elsewhere)")
    return (f"the trainer has waited {wait:.1f} s for {batch}; this loader has no h5feed counters, so what its "
            "workers do cannot be seen")


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
        where = f" ({row['path']})" if row["path"] else ""
        doing = (f"sample {row['sample']}{where} for {row['sample_s']:.1f} s, {row['sample_MB']:.1f} MB read so far, "
                 f"no progress for {num(row['since_progress_s'], '.1f', ' s')}")
    else:
        doing = f"no sample in hand, last progress {num(row['since_progress_s'], '.1f', ' s')} ago"
    return (f"  worker {row['worker']} ({state}): {doing}; {row['samples']} samples done, recent "
            f"{num(row['samples_per_s'], '.2f')} samples/s, {num(row['read_MBps'], '.1f')} MB/s, "
            f"queue {row['queue_depth']}")
