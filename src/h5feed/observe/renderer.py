"""The monitor's figures: step figures of a window, per-worker rows from counter snapshots, and their text.

Shared by the monitor's log lines, its stall reports and `h5feed watch`, so that all three say the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from h5feed.observe.metrics import LoaderSnapshot
from h5feed.observe.timers import StepTotals

Record = dict[str, Any]


def step_figures(t: StepTotals) -> Record:
    """The trainer-side figures of a window, named as torchtitan names them."""
    return {
        "steps": t.steps,
        "throughput(steps/s)": t.steps / t.step_s if t.step_s else None,
        "step_time(s)": t.step_s / t.steps if t.steps else None,
        "data_loading(s)": t.wait_s / t.steps if t.steps else None,
        "data_loading(%)": 100 * t.wait_s / t.step_s if t.step_s else None,
        "gpu_idle(s)": t.gpu_idle_s / t.gpu_steps if t.gpu_steps else None,
        "gpu_idle(%)": 100 * t.gpu_idle_s / t.gpu_step_s if t.gpu_step_s else None,
        "throughput(samples/s)": t.samples / t.step_s if t.step_s else None,
        "batches(GB/s)": t.batch_bytes / t.step_s / 1e9 if t.step_s else None,
    }


def worker_rows(
    snap: LoaderSnapshot, before: LoaderSnapshot | None, object_of: Callable[[int], str | None]
) -> list[Record]:
    """One row per started worker; rates against `before` (None: no rates yet); `object_of`: where its sample is."""
    old = {w.worker: w for w in before.workers} if before is not None else {}
    dt = snap.time - before.time if before is not None else 0.0
    rows = []
    for w in snap.workers:
        o = old.get(w.worker)
        done = w.samples - (o.samples if o else 0)
        busy = w.read_seconds + w.decode_seconds - ((o.read_seconds + o.decode_seconds) if o else 0.0)
        rows.append({
            "worker": w.worker,
            "pid": w.pid,
            "samples": w.samples,
            "samples_per_s": done / dt if dt > 0 else None,
            # a worker's own pace: under DataLoader's round robin every worker hands over at the slowest one's
            # rate, so samples/s cannot tell a slow worker from one waiting for a free slot
            "busy_s_per_sample": busy / done if done > 0 else None,
            "read_MBps": (w.bytes_read - (o.bytes_read if o else 0)) / dt / 1e6 if dt > 0 else None,
            "decoded_MBps": (w.bytes_delivered - (o.bytes_delivered if o else 0)) / dt / 1e6 if dt > 0 else None,
            "queue_depth": w.queue_depth,
            "corrupt": w.corrupt,
            "network_MBps": (w.network_bytes - (o.network_bytes if o else 0)) / dt / 1e6 if dt > 0 else None,
            "requests_per_s": (w.requests - (o.requests if o else 0)) / dt if dt > 0 else None,
            "requests": w.requests,
            "retries": w.retries,
            "cache_hits": w.cache_hits,
            "cache_misses": w.cache_misses,
            "sample": w.current_sample,
            "object": object_of(w.current_sample) if w.current_sample is not None else None,
            "sample_s": w.current_seconds if w.current_sample is not None else None,
            "sample_MB": w.current_bytes / 1e6 if w.current_sample is not None else None,
            "since_progress_s": w.seconds_since_progress,
            "writer_wait_s": w.writer_wait_seconds - (o.writer_wait_seconds if o else 0.0),
            "waiting_for_writer_s": w.waiting_for_writer_s,
        })
    return rows


def loader_figures(rows: list[Record], ahead: int | None = None) -> Record:
    """The loader's figures, summed over its workers' rows.  `ahead`: samples the workers have finished and the
    trainer has not yet taken (None: unknown).  It is also the record's `queue_depth`, which `h5feed watch` and
    the scalars show: the workers' own count of that name moves only where a reader reads ahead in its own
    threads, and stays 0 under a DataLoader over a map-style dataset, whatever happens."""

    def total(key: str) -> float | None:
        values = [r[key] for r in rows if r[key] is not None]
        return sum(values) if values else None

    read, decoded, network = total("read_MBps"), total("decoded_MBps"), total("network_MBps")
    return {
        "samples_per_s": total("samples_per_s"),
        "read_GBps": read / 1e3 if read is not None else None,
        "decoded_GBps": decoded / 1e3 if decoded is not None else None,
        "queue_depth": ahead if ahead is not None else sum(r["queue_depth"] for r in rows),
        "samples_ahead": ahead,
        "corrupt": sum(r["corrupt"] for r in rows),
        "network_GBps": network / 1e3 if network is not None else None,
        "requests_per_s": total("requests_per_s"),
        "requests": sum(r["requests"] for r in rows),
        "retries": sum(r["retries"] for r in rows),
        "cache_hits": sum(r["cache_hits"] for r in rows),
        "cache_misses": sum(r["cache_misses"] for r in rows),
        "workers": len(rows),
        "reading": sum(r["sample"] is not None for r in rows),
        "writer_wait_s": sum(r.get("writer_wait_s") or 0.0 for r in rows),  # a following stream's, summed
        "waiting_for_writer": sum(r.get("waiting_for_writer_s") is not None for r in rows),
    }


def num(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def label(name: str, rank: int, world_size: int) -> str:
    """How a monitor's lines begin: `h5feed[train]`, or `h5feed[train rank 1/2]` in a run of several ranks."""
    return f"h5feed[{name}]" if world_size == 1 else f"h5feed[{name} rank {rank}/{world_size}]"


def format_line(rec: Record) -> str:
    """The one-line report shared by the log, `h5feed watch` and the tests."""
    head = label(rec["name"], rec.get("rank", 0), rec.get("world_size", 1))
    waiting = rec.get("waiting(s)")
    loader = rec.get("loader")
    if rec["step"] == 0:
        line = f"{head} waiting for the first batch ({num(waiting, '.0f', ' s')} so far)"
        if loader is None:
            return line + "; this loader has no h5feed counters"
        if not loader["workers"]:
            return line + "; no worker has started reading yet"
        return line + f"; {loader['workers']} worker(s) started, {loader['reading']} reading a sample"
    where = f"epoch {rec['epoch']} step {rec['global_step']}" if "global_step" in rec else f"step {rec['step']}"
    if rec["steps"]:
        line = (
            f"{head} {where} | {num(rec['throughput(steps/s)'], '.2f')} steps/s, "
            f"step {num(rec['step_time(s)'], '.3f', ' s')} | data_loading {num(rec['data_loading(s)'], '.3f', ' s')} "
            f"({num(rec['data_loading(%)'], '.1f', '%')}) | GPU idle {num(rec['gpu_idle(%)'], '.1f', '%')}"
        )
    else:
        line = f"{head} {where} | no step finished in the last {rec['window(s)']:.1f} s"
    if loader is not None:
        line += (
            f" | loader {num(loader['samples_per_s'], '.1f')} samples/s, {num(loader['read_GBps'], '.2f')} GB/s read, "
            f"{num(loader['decoded_GBps'], '.2f')} GB/s decoded"
        )
        if loader.get("samples_ahead") is not None:
            ahead = loader["samples_ahead"]
            line += f", {ahead} sample{'' if ahead == 1 else 's'} ready ahead of the trainer"
        if loader.get("requests") or loader.get("cache_hits") or loader.get("cache_misses"):
            line += network_text(loader)
        if loader.get("writer_wait_s"):
            line += (f" | workers waited {loader['writer_wait_s']:.1f} s for the writer to publish samples"
                     f"{' (waiting now)' if loader.get('waiting_for_writer') else ''}")
        if loader.get("corrupt"):
            line += f" | {loader['corrupt']} DAMAGED sample(s) skipped (on_corrupt='skip'; run `h5feed verify`)"
    elif rec["steps"]:
        line += f" | batches {num(rec['batches(GB/s)'], '.2f')} GB/s (no loader counters)"
    if waiting is not None and waiting >= 1.0:
        line += f" | waiting {waiting:.0f} s for batch {rec['step'] + 1}"
    return line


def network_text(loader: Record) -> str:
    """A remote store's share of the report line: network rate, requests, retries, node-cache hits."""
    text = (f" | network {num(loader.get('network_GBps'), '.2f')} GB/s, {num(loader.get('requests_per_s'), '.0f')} "
            f"requests/s, {loader.get('retries', 0)} retries")
    cached = loader.get("cache_hits", 0) + loader.get("cache_misses", 0)
    if cached:
        text += f", cache {100 * loader['cache_hits'] / cached:.0f}% hits ({loader['cache_misses']} downloaded)"
    return text


Column = tuple[str, str, str]  # heading, record key, format spec

_WORKER_COLUMNS: list[Column] = [
    ("worker", "worker", "d"), ("pid", "pid", "d"), ("samples", "samples", "d"), ("samples/s", "samples_per_s", ".2f"),
    ("read MB/s", "read_MBps", ".1f"), ("sample", "sample", "d"),
    ("for s", "sample_s", ".1f"), ("MB so far", "sample_MB", ".1f"), ("no progress s", "since_progress_s", ".1f"),
]


def format_record_table(columns: list[Column], rows: list[Record], last: tuple[str, str]) -> list[str]:
    """Rows as right-aligned columns ("-" for None), then the `last` (heading, key) column left-aligned."""
    if not rows:
        return []
    cells = [[h for h, _, _ in columns] + [last[0]]]
    cells += [[num(r[key], spec) if r[key] is not None else "-" for _, key, spec in columns] + [r.get(last[1]) or "-"]
              for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return ["  ".join(c[i].rjust(widths[i]) for i in range(len(columns))) + "  " + c[-1] for c in cells]


def format_workers(rows: list[Record]) -> list[str]:
    """Per-worker rows as an aligned table (the store object of its sample last; the rank first if rows have one)."""
    ranked = any("rank" in r for r in rows)
    return format_record_table([("rank", "rank", "d")] * ranked + _WORKER_COLUMNS, rows, ("reading", "object"))


def slowest_worker(paces: dict[str, float]) -> str | None:
    """The sentence naming the worker that takes longest per sample, from {who: seconds reading per sample};
    None with fewer than two.  Its own pace, not samples/s: under DataLoader's round robin every worker
    hands over at the slowest one's rate."""
    if len(paces) < 2:
        return None
    slow = max(paces, key=lambda who: paces[who])
    return f"slowest worker: {slow}, {paces[slow]:.3f} s reading per sample (the fastest: {min(paces.values()):.3f} s)"
