"""What `h5feed bench` reports: one result per pass, the whole run, and its plain-text table."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from h5feed.bench.loaders import BASELINE, LOADER_LABELS, USABLE, WorkerStats

TABLE_COLUMNS = ("loader", "cache", "samples", "samples/s", "x baseline", "CPU s/sample", "CPU cores", "GB/s",
                 "peak mem", "per-worker samples/s", "batches", "other CPU")


@dataclass
class PassResult:
    loader: str
    cache: str  # "cold" or "warm"
    samples: int
    seconds: float  # from the creation of the loader's iterator to its last batch
    samples_per_s: float
    hidden_bytes: int  # bytes of the hidden-state tensors delivered (batches: max_len rows, pads included)
    gb_per_s: float
    bytes_read: int  # from storage: store chunks (h5feed) or whole files (baseline)
    peak_memory_bytes: int
    memory_metric: str  # "pss" or "rss"
    workers: list[WorkerStats] = field(default_factory=list)
    cpu_seconds: float = 0.0  # CPU (user + system) of the main process and its workers, until they are reaped
    other_cpu_share: float = 0.0  # share of the machine's CPUs other processes used meanwhile (disturbance)
    ratio: float | None = None  # samples/s over the baseline's, same cache state (trainer-path loaders only)

    @property
    def cpu_per_sample(self) -> float:
        return self.cpu_seconds / max(self.samples, 1)


@dataclass
class BenchResult:
    store: str
    source_root: str
    source_format: str
    num_samples: int
    num_tokens: int
    hidden_size: int
    num_aux_layers: int
    store_bytes: int
    source_bytes: int | None
    workers: int
    max_len: int
    flavor: str
    collate: str  # the trainer's collate every trainer-path loader delivers
    hidden_states_dtype: str
    memory_metric: str
    cold: bool  # cold passes were measured
    machine: dict[str, Any]
    passes: list[PassResult] = field(default_factory=list)
    checks: dict[str, str] = field(default_factory=dict)  # loader -> "reference", "equal" or what differs
    notes: list[str] = field(default_factory=list)

    def get(self, loader: str, cache: str) -> PassResult | None:
        for p in self.passes:
            if p.loader == loader and p.cache == cache:
                return p
        return None

    def fastest(self) -> str | None:
        """The trainer-path loader with the best ratio to the baseline, over the cache states measured (the
        mean of its ratios), among those whose batches were checked equal to the baseline's; None if none."""
        ratios: dict[str, list[float]] = {}
        for p in self.passes:
            if p.ratio is not None and p.loader in USABLE and self.checks.get(p.loader, "equal") == "equal":
                ratios.setdefault(p.loader, []).append(p.ratio)
        return max(ratios, key=lambda name: sum(ratios[name]) / len(ratios[name]), default=None)

    def recommendation(self) -> str:
        """What to use on this machine, measured here: the fastest loader, its ratios and CPU, its settings."""
        best = self.fastest()
        if best is None:
            return ""
        passes = [p for p in self.passes if p.loader == best]
        base = {p.cache: p for p in self.passes if p.loader == BASELINE}
        figures = ", ".join(f"{p.ratio:.2f}x the .pt loader {p.cache}" for p in passes if p.ratio is not None)
        cpu = max(p.cpu_per_sample for p in passes)
        base_cpu = max((p.cpu_per_sample for p in base.values()), default=float("nan"))
        settings = USABLE[best].format(flavor=self.flavor, max_len=self.max_len, workers=self.workers,
                                       dtype=self.hidden_states_dtype)
        return (f"Fastest here: {LOADER_LABELS[best]}: {figures}, {cpu:.3f} CPU s/sample (the .pt loader: "
                f"{base_cpu:.3f}).\nTo use it: {settings}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def rows(self) -> list[list[str]]:
        """The table's cells, header first: one row per loader x cache state."""
        rows = [list(TABLE_COLUMNS)]
        rows[0][TABLE_COLUMNS.index("peak mem")] = f"peak mem ({self.memory_metric.upper()})"
        for p in self.passes:
            rows.append([
                LOADER_LABELS.get(p.loader, p.loader),
                p.cache,
                str(p.samples),
                f"{p.samples_per_s:.2f}",
                "-" if p.ratio is None else f"{p.ratio:.2f}x",
                f"{p.cpu_per_sample:.3f}",
                f"{p.cpu_seconds / p.seconds:.2f}",
                f"{p.gb_per_s:.2f}",
                f"{p.peak_memory_bytes / 1e9:.2f} GB",
                " ".join(f"{w.samples_per_s:.2f}" for w in p.workers) or "-",
                self.checks.get(p.loader, "not checked"),
                f"{100 * p.other_cpu_share:.0f}%",
            ])
        return rows

    def table(self) -> str:
        """The plain-text report: the settings, one row per pass, notes, and last what to use here."""
        load = self.machine.get("load_average", {})
        out = [
            (f"store  {self.store} ({self.num_samples} samples, {self.num_tokens} tokens, H={self.hidden_size}, "
             f"K={self.num_aux_layers}, {self.store_bytes / 1e9:.2f} GB)"),
            f"source {self.source_root} ({self.source_format}"
            + (f", {self.source_bytes / 1e9:.2f} GB)" if self.source_bytes else ")"),
            (f"trainer path: batch_size=1, num_workers (or threads)={self.workers}, collate={self.collate}, "
             f"pin_memory=True, max_len={self.max_len}, flavor={self.flavor}, "
             f"hidden_states_dtype={self.hidden_states_dtype}, store order"),
            (f"machine: {self.machine.get('cpus')} cores, {self.machine.get('memory_bytes', 0) / 2**30:.0f} GiB, "
             f"CUDA {'yes' if self.machine.get('cuda') else 'no'}; load average (1 min) "
             f"{load.get('start', float('nan')):.2f} at the start, {load.get('end', float('nan')):.2f} at the end"),
            "",
            *format_table(self.rows(), right={2, 3, 4, 5, 6, 7, 8, 11}),
        ]
        for note in self.notes:
            out.append(f"note: {note}")
        advice = self.recommendation()
        if advice:
            out += ["", advice]
        return "\n".join(out)


def format_table(rows: list[list[str]], right: set[int]) -> list[str]:
    """Plain-text columns: the first row is the header, a rule under it; columns in `right` align right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return [line(rows[0]), line(["-" * w for w in widths]), *(line(r) for r in rows[1:])]
