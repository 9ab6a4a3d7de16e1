"""What `h5feed bench` reports: one result per pass, the whole run, and its plain-text table."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from h5feed.bench.loaders import LOADER_LABELS, WorkerStats


@dataclass
class PassResult:
    loader: str
    cache: str  # "cold" or "warm"
    samples: int
    tokens: int  # tokens of the items delivered (after the shift)
    seconds: float
    samples_per_s: float
    hidden_bytes: int  # bytes of hidden-state tensors delivered
    gb_per_s: float
    bytes_read: int  # from storage: store chunks (h5feed) or whole files (baseline)
    peak_memory_bytes: int
    memory_metric: str  # "pss" or "rss"
    workers: list[WorkerStats] = field(default_factory=list)
    cpu_seconds: float = 0.0  # CPU (user + system) of the main process and its workers during the pass
    other_cpu_share: float = 0.0  # share of the machine's CPUs other processes used meanwhile (disturbance)
    ratio: float | None = None  # samples/s over the baseline's, same cache state
    check: float = 0.0  # sum of the touched elements: equal for every loader when the items agree


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
    max_len: int | None
    flavor: str
    hidden_states_dtype: str
    memory_metric: str
    cold: bool  # cold passes were measured
    machine: dict[str, Any]
    passes: list[PassResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    targets: list[dict[str, Any]] = field(default_factory=list)

    def get(self, loader: str, cache: str) -> PassResult | None:
        for p in self.passes:
            if p.loader == loader and p.cache == cache:
                return p
        return None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def table(self) -> str:
        """The plain-text report: one row per loader x cache state, then targets and notes."""
        metric = self.memory_metric.upper()
        header = ["loader", "cache", "samples", "samples/s", "GB/s", "x baseline", f"peak mem ({metric})",
                  "per-worker samples/s", "CPU s/sample", "other CPU"]
        rows = [header]
        for p in self.passes:
            rows.append([
                LOADER_LABELS.get(p.loader, p.loader),
                p.cache,
                str(p.samples),
                f"{p.samples_per_s:.2f}",
                f"{p.gb_per_s:.2f}",
                "-" if p.ratio is None else f"{p.ratio:.2f}x",
                f"{p.peak_memory_bytes / 1e9:.2f} GB",
                " ".join(f"{w.samples_per_s:.2f}" for w in p.workers) or "-",
                f"{p.cpu_seconds / max(p.samples, 1):.3f}",
                f"{100 * p.other_cpu_share:.0f}%",
            ])
        out = [
            (f"store  {self.store} ({self.num_samples} samples, {self.num_tokens} tokens, H={self.hidden_size}, "
             f"K={self.num_aux_layers}, {self.store_bytes / 1e9:.2f} GB)"),
            f"source {self.source_root} ({self.source_format}"
            + (f", {self.source_bytes / 1e9:.2f} GB)" if self.source_bytes else ")"),
            (f"DataLoader num_workers={self.workers}, batch_size=None, max_len={self.max_len}, flavor={self.flavor}, "
             f"hidden_states_dtype={self.hidden_states_dtype}; machine: {self.machine.get('cpus')} cores, "
             f"{self.machine.get('memory_bytes', 0) / 2**30:.0f} GiB"),
            "",
            *format_table(rows, right={2, 3, 4, 5, 6, 8, 9}),
        ]
        if self.targets:
            out.append("")
            for t in self.targets:
                verdict = "met" if t["met"] else "NOT met"
                scope = "" if t["applies"] else " (targets are for H=7168, 4 workers, max_len 2048: indicative only)"
                out.append(f"DESIGN.md target {t['cache']} >= {t['target']:.1f}x baseline: {LOADER_LABELS[t['loader']]} "
                           f"{t['ratio']:.2f}x -> {verdict}{scope}")
        for note in self.notes:
            out.append(f"note: {note}")
        return "\n".join(out)


def format_table(rows: list[list[str]], right: set[int]) -> list[str]:
    """Plain-text columns: the first row is the header, a rule under it; columns in `right` align right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return [line(rows[0]), line(["-" * w for w in widths]), *(line(r) for r in rows[1:])]
