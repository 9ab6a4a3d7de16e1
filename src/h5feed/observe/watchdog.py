"""Verdicts on loading: what a stall is (from the trainer's wait and the workers' progress), what each worker is
doing, whether a pass or a report's window was held back by loading (its steps waited `BOTTLENECK_PCT` of their
time for data) and why, and what limits the loader (`diagnose`: the storage, the CPU, too few or too many
workers) with the one change that would help most.

Why a diagnosis rather than a hint: "more workers may help" is wrong as often as right.  With 32 workers on 2
cores more workers only take turns on the cores; with the storage at its rate they only queue more reads; with
the cores busy decoding they only share them.  The workers' own counters say which it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import psutil

from h5feed.observe.metrics import LoaderSnapshot
from h5feed.observe.renderer import Record, num

RECENT_S = 10.0  # the window of a stall report's "recent" throughput
BOTTLENECK_PCT = 5.0  # a pass whose steps waited this share of their time for data was held back by loading
STARTUP_SHARE = 0.5  # of a bottleneck pass's wait, the first batch's share that makes start-up the thing to fix
READ_BOUND = 0.6  # reading takes this share of the workers' busy time: the storage (or the network) sets the pace
CPU_BOUND = 0.8  # decoding keeps this share of the cores busy: the CPU sets the pace
BUSY_BOUND = 0.5  # workers busy less than this share of the time do not set the pace: what is after them does

Verdict = Literal["bottleneck", "stuck", "idle", "waiting", "writer"]
Limit = Literal["oversubscribed", "handover", "storage", "network", "cpu", "workers"]


def classify_stall(trainer_wait_s: float | None, worker_quiet_s: list[float] | None, stall_after: float,
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


@dataclass(frozen=True)
class LoaderSetup:
    """What the loader reads with: its DataLoader worker processes (0: it reads in the trainer's process), the
    cores this process may use (`os.sched_getaffinity`), and what is known of the store it reads (`fp8` None:
    not an h5feed store)."""

    workers: int
    cores: int
    remote: bool = False
    fp8: bool | None = None


@dataclass(frozen=True)
class LoaderWork:
    """What the loader's workers did over a window, from their counters: the seconds they spent reading (the
    disk, the network) and decoding (the CPU), summed over the workers and their threads, and the bytes read."""

    seconds: float
    read_s: float
    decode_s: float
    bytes_read: int

    @classmethod
    def between(cls, before: LoaderSnapshot, now: LoaderSnapshot) -> LoaderWork:
        def grown(name: str) -> float:  # a worker started since `before` counts from nothing
            return now.total(name) - before.total(name)

        return cls(now.time - before.time, grown("read_seconds"), grown("decode_seconds"), int(grown("bytes_read")))

    @property
    def busy_s(self) -> float:
        return self.read_s + self.decode_s


@dataclass(frozen=True)
class Diagnosis:
    """What limits loading, and the one change that would help most with its expected effect, in a sentence."""

    limit: Limit
    text: str


def _counted(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def diagnose(setup: LoaderSetup, work: LoaderWork | None) -> Diagnosis | None:
    """What limits the loader, from what it reads with and what its workers did (`work`; None: no window of
    counters).  None when nothing can be said: no counters and no more workers than cores, or an idle window.

    Oversubscription comes first: it needs no counters, and until it is fixed the rest measures workers that
    take turns.  Workers idle most of the window are not what the trainer waits for: the hand-over after them
    is (or their start-up).  Then the workers' time: mostly reading, the storage (or the network) is the limit;
    otherwise decoding, and either the cores are all busy (the CPU is the limit) or more workers would use the
    idle ones.
    """
    workers, cores = setup.workers, setup.cores
    if workers > cores:
        return Diagnosis("oversubscribed", f"{_counted(workers, 'worker')} on {_counted(cores, 'core')}: use {cores}; "
                                           "workers beyond the cores only take turns on them, and each one started "
                                           "delays the first batch")
    if work is None or work.seconds <= 0 or work.busy_s <= 0:
        return None
    busy = work.busy_s / work.seconds  # cores' worth of reading and decoding
    if workers and busy < BUSY_BOUND * workers:
        return Diagnosis("handover", f"the workers read or decoded only {busy / workers:.0%} of the time, so they are "
                                     "not what the trainer waits for: handing their batches over is (collate, "
                                     "pin_memory, the copy between processes), or their start-up; h5feed's "
                                     "BatchLoader decodes into shared page-locked slots and passes only a slot's "
                                     "number between processes")
    whose = "the reading threads'" if not workers else "1 worker's" if workers == 1 else f"{workers} workers'"
    read_share = work.read_s / work.busy_s
    if read_share >= READ_BOUND:
        rate = work.bytes_read / work.seconds / 1e9
        source = "the network" if setup.remote else "the storage"
        return Diagnosis("network" if setup.remote else "storage",
                         f"reading takes {read_share:.0%} of {whose} time at {rate:.2f} GB/s: {source} is the limit, "
                         f"so more workers will not help; {_fewer_bytes(setup, read_share)}")
    decode_share = 1 - read_share
    doing = (f"decoding takes {decode_share:.0%} of {whose} time" if decode_share >= READ_BOUND
             else f"reading takes {read_share:.0%} and decoding {decode_share:.0%} of {whose} time")
    decoding_cores = work.decode_s / work.seconds
    readers = workers or max(1, round(busy))  # threads in the trainer's process: as many as were busy
    on_gpu = "BatchLoader(decode='cuda') decodes on the GPU instead and leaves the cores to the trainer"
    if decoding_cores >= CPU_BOUND * cores:
        return Diagnosis("cpu", f"{doing}, keeping {decoding_cores:.1f} of {_counted(cores, 'core')} busy: the CPU is "
                                f"the limit, so more workers will not help; {on_gpu}")
    if readers >= cores:
        return Diagnosis("cpu", f"{doing}, with as many {'workers' if workers else 'reading threads'} as cores "
                                f"({cores}): more would only take turns on them; {on_gpu}")
    more = min(cores, 2 * readers)
    effect = "roughly double the rate" if more == 2 * readers else f"raise the rate about {more / readers:.1f}x"
    change = f"{more} workers" if workers else f"{more} DataLoader worker processes (num_workers={more})"
    return Diagnosis("workers", f"{doing} on {_counted(cores, 'core')}: {change} would {effect}")


def diagnose_between(setup: LoaderSetup, before: LoaderSnapshot | None, now: LoaderSnapshot | None
                     ) -> Diagnosis | None:
    """What limits loading, from the workers' counters between two snapshots (and without them, whether there are
    more workers than cores)."""
    work = LoaderWork.between(before, now) if before is not None and now is not None else None
    return diagnose(setup, work)


def note_diagnosis(rec: Record, diagnosis: Diagnosis | None) -> None:
    """Put the diagnosis in the record, for `h5feed watch` and whoever reads the file."""
    rec["limit"], rec["diagnosis"] = (diagnosis.limit, diagnosis.text) if diagnosis is not None else (None, None)


def window_verdict(rec: Record, setup: LoaderSetup, before: LoaderSnapshot | None, now: LoaderSnapshot | None
                   ) -> str:
    """A report line's verdict, when its window's steps waited for data: what limits the loader ("" when they did
    not, or nothing can be said); the record gets it too."""
    wait = rec["data_loading(%)"]
    if wait is None or wait < BOTTLENECK_PCT:
        return ""
    diagnosis = diagnose_between(setup, before, now)
    if diagnosis is None:
        return ""
    note_diagnosis(rec, diagnosis)
    return f" | the step waited for data {wait:.1f}% of this window: {diagnosis.text}"


def wait_cause(first_batch_s: float | None, wait_s: float, diagnosis: Diagnosis | None, counted: bool) -> str:
    """Why a pass waited for data and what to change: its start-up, when the first batch was most of the wait,
    else what limits the loader (`counted`: the loader has h5feed's counters, so a diagnosis could be made)."""
    first = first_batch_s or 0.0
    if first >= STARTUP_SHARE * wait_s:
        fix = (diagnosis.text if diagnosis is not None and diagnosis.limit == "oversubscribed" else
               "fewer DataLoader workers start sooner, and persistent_workers=True starts them once for the run")
        return f"{first:.2f} s of the {wait_s:.2f} s was the first batch, the loader's start-up; {fix}"
    if diagnosis is not None:
        return diagnosis.text
    if not counted:
        return ("this loader has no h5feed counters, so what limits it cannot be seen; `h5feed bench STORE` "
                "measures h5feed's loaders on this machine")
    return "`h5feed bench STORE` measures the loaders on this machine"


def _fewer_bytes(setup: LoaderSetup, read_share: float) -> str:
    """The change for a loader the storage holds back: fewer bytes to read, or a faster place to read them from."""
    if setup.fp8 is False:
        faster = 1 / (1 - read_share / 2)  # the reads take half as long, the decoding as long as before
        return (f"an FP8 store (`h5feed convert --precision fp8`, lossy) reads half the bytes: about {faster:.1f}x "
                "the samples per second")
    already = "the store is FP8 already: " if setup.fp8 else ""
    if setup.remote:
        return f"{already}a node cache (cache_dir=) on a local disk reads each object from the network once"
    return f"{already}a faster disk, or a copy of the store on local NVMe, is what helps"


def advice(verdict: Verdict, rows: list[Record], diagnosis: Diagnosis | None = None) -> str:
    """What to do about a stall, in a sentence or two ("" when nothing needs doing); `diagnosis` (of the recent
    window) says what limits a loader that is slower than the step, and too many workers whatever the verdict."""
    in_hand = [r for r in rows if r["sample"] is not None]
    text = ""
    if verdict == "stuck" and in_hand:
        pids = " ".join(f"py-spy dump --pid {r['pid']}" for r in in_hand[:2])
        text = (f"to see where a worker is blocked: `{pids}`; a hung network mount or bucket looks like this, and "
                "a worker that waits on a lock (a second loader over the same files) too")
    elif verdict == "stuck":
        who = ("no worker has started yet: one may still be starting (spawn imports take seconds)" if not rows else
               "no worker holds a sample, so none is reading: the batch may be held up after the workers")
        text = (f"{who}, or a worker died and its error is in this process's log; DataLoader(timeout=...) turns a "
                "worker that never answers into an error")
    elif verdict == "bottleneck":
        if diagnosis is not None:
            return diagnosis.text
        text = "loading is slower than the step; `h5feed bench STORE` measures the loaders on this machine"
    elif verdict == "writer":
        text = ("extraction is slower than training: the trainer goes at the writer's pace (more extraction "
                "servers, or start training later); nothing is wrong with the loader")
    elif verdict == "waiting":
        text = (f"`py-spy dump --pid {os.getpid()}` shows where the loader is; h5feed's datasets count what their "
                "workers do, and the monitor then names the one that holds the trainer up")
    if diagnosis is not None and diagnosis.limit == "oversubscribed" and verdict in ("stuck", "waiting"):
        text = f"{text}; {diagnosis.text}" if text else diagnosis.text
    return text


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
            f"{num(row['samples_per_s'], '.2f')} samples/s, {num(row['read_MBps'], '.1f')} MB/s")
