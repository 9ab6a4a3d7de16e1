"""What `h5feed bench` reports: one result per pass, the whole run, its plain-text table and its HTML page."""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h5feed.bench.loaders import BASELINE, LOADER_LABELS, SHORT_LABELS, USABLE, WorkerPass
from h5feed.bench.step import StepAlone
from h5feed.observe.page import Section, bullets, figure_png, image, page_html, preformatted, pyplot, table

TABLE_COLUMNS = ("loader", "cache", "samples", "samples/s", "of step alone", "running", "step x alone",
                 "first batch s", "data wait", "next() ms", "x baseline", "CPU s/sample", "CPU cores", "loader cores", "GPU ms/sample", "GB/s", "peak mem",
                 "per-worker samples/s", "batches", "other CPU")  # --verbose
SHORT_COLUMNS = ("loader", "cache", "samples/s", "x baseline", "CPU s/sample", "peak mem", "batches")  # the default
STEP_COLUMNS = ("loader", "cache", "samples/s", "of step alone", "running", "step x alone", "first batch s", "data wait",
                "loader cores", "next() ms", "peak mem", "batches")  # the default with a training step
STEP_ONLY = {"of step alone", "running", "step x alone"}  # columns that need a training step
SAME_SPEED = 0.01  # loaders within this share of the step alone of the best are equals: the fewest cores wins
SAME_RATIO = 0.05  # without a step, loaders within this of the best ratio are equals (one pass each: the noise)
TEXT_COLUMNS = ("loader", "cache", "per-worker samples/s", "batches")  # aligned left; the figures align right
CACHES = ("cold", "warm")  # the cache states, in the order they are measured
WIDTH = 120  # the report's lines, but for paths and the code to copy


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
    workers: list[WorkerPass] = field(default_factory=list)
    cpu_seconds: float = 0.0  # CPU (user + system) of the main process and its workers, until they are reaped
    other_cpu_share: float = 0.0  # share of the machine's CPUs other processes used meanwhile (disturbance)
    ratio: float | None = None  # samples/s over the baseline's, same cache state (trainer-path loaders only)
    data_wait: float = 0.0  # share of the pass spent waiting in next(), every batch's wait counted
    next_median_ms: float = 0.0  # the median wait in next()
    step_share: float | None = None  # with a training step: samples/s over the step alone's, the whole pass
    first_batch_s: float = 0.0  # from the pass's start (its workers' start included) to the first batch
    running_share: float | None = None  # the same once the first batch is in: what a long epoch runs at
    step_mean_ms: float | None = None  # the training step's own mean time beside this loader (its waits excluded): a
    # GPU loader's decode slows the steps it runs beside, not the median one
    step_slowdown: float | None = None  # that over the step alone's: what the loader takes from the step itself
    loader_cores: float = 0.0  # CPU cores of the process and its workers, less the training step's own CPU
    gpu_decode_ms_per_sample: float = 0.0  # GPU time spent decoding a sample: what it takes from the step's GPU

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
    step: StepAlone | None = None  # the training step alone, when one ran beside the loaders
    step_after: StepAlone | None = None  # the same, timed again after every loader's passes (the GPU's drift)

    def get(self, loader: str, cache: str) -> PassResult | None:
        for p in self.passes:
            if p.loader == loader and p.cache == cache:
                return p
        return None

    def ranking(self) -> tuple[str | None, list[str]]:
        """The trainer-path loader to use here, and the others as good within the noise, among the loaders whose
        batches were checked equal to the reference's (or are the reference: with no baseline, the first loader's).  With a training step: the one that leaves it fastest once
        running (the mean over the cache states measured of its share of the step alone after the first batch,
        which a long epoch runs at); of those within `SAME_SPEED` of the best, the one on the fewest cores.
        Without: the best ratio to the baseline, others within `SAME_RATIO` of it its equals."""
        usable = [p for p in self.passes
                  if p.loader in USABLE and self.checks.get(p.loader, "equal") in ("equal", "reference")]
        if self.step is not None:
            figure, cores = _means(usable, lambda p: p.running_share), _means(usable, lambda p: p.loader_cores)
            best = max(figure.values(), default=None)
            equals = [name for name in figure if best is not None and figure[name] >= best - SAME_SPEED]
            chosen = min(equals, key=lambda name: cores[name], default=None)
        else:
            figure = _means(usable, lambda p: p.ratio)
            chosen = max(figure, key=lambda name: figure[name], default=None)
            equals = [name for name in figure if chosen is not None and figure[name] >= figure[chosen] * (1 - SAME_RATIO)]
        return chosen, [name for name in equals if name != chosen]

    def fastest(self) -> str | None:
        """The trainer-path loader to use here (`ranking`); None if none was measured so."""
        return self.ranking()[0]

    def recommendation(self) -> str:
        """What to use on this machine, measured here: the loader `ranking` picks, its figures, its settings, and
        the loaders within the noise of it."""
        best, equals = self.ranking()
        if best is None:
            return ""
        passes = [p for p in self.passes if p.loader == best]
        on_gpu = self.step is not None and self.step.device != "CPU"
        settings = USABLE[best].format(flavor=self.flavor, max_len=self.max_len, workers=self.workers,
                                       dtype=self.hidden_states_dtype, device=', device="cuda"' if on_gpu else "")
        if self.step is not None:
            figures = "; ".join(f"{p.cache}: {100 * p.running_share:.1f}% of the step alone once running, first "
                                f"batch after {p.first_batch_s:.2f} s, {p.loader_cores:.2f} loader cores"
                                for p in passes if p.running_share is not None)
            advice = f"Best for this training step here: {SHORT_LABELS[best]}: {figures}."
            within = f"within {100 * SAME_SPEED:.0f} point of the step alone, on more cores"
        else:
            base = {p.cache: p for p in self.passes if p.loader == BASELINE}
            figures = ", ".join(f"{p.ratio:.2f}x the .pt loader {p.cache}" for p in passes if p.ratio is not None)
            cpu = max(p.cpu_per_sample for p in passes)
            base_cpu = max((p.cpu_per_sample for p in base.values()), default=float("nan"))
            advice = (f"Fastest here: {SHORT_LABELS[best]}: {figures}, {cpu:.3f} CPU s/sample (the .pt loader: "
                      f"{base_cpu:.3f}).")
            within = f"within {100 * SAME_RATIO:.0f}%, the run-to-run noise of a busy machine"
        if equals:
            advice += f"\nAs good within the noise: {', '.join(SHORT_LABELS[name] for name in equals)} ({within})."
        return f"{advice}\nTo use it: {settings}"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def rows(self, verbose: bool = False) -> list[list[str]]:
        """The table's cells, header first: one row per loader x cache state (`verbose`: every column, long names)."""
        columns = self.columns(verbose)
        rows = [[f"peak mem ({self.memory_metric.upper()})" if c == "peak mem" else c for c in columns]]
        for p in self.passes:
            cells = {
                "loader": (LOADER_LABELS if verbose else SHORT_LABELS).get(p.loader, p.loader),
                "cache": p.cache,
                "samples": str(p.samples),
                "samples/s": f"{p.samples_per_s:.2f}",
                "x baseline": "-" if p.ratio is None else f"{p.ratio:.2f}x",
                "of step alone": "-" if p.step_share is None else f"{100 * p.step_share:.1f}%",
                "running": "-" if p.running_share is None else f"{100 * p.running_share:.1f}%",
                "step x alone": "-" if p.step_slowdown is None else f"{p.step_slowdown:.3f}x",
                "first batch s": f"{p.first_batch_s:.2f}",
                "data wait": f"{100 * p.data_wait:.1f}%",
                "next() ms": f"{p.next_median_ms:.2f}",
                "loader cores": f"{p.loader_cores:.2f}",
                "GPU ms/sample": f"{p.gpu_decode_ms_per_sample:.1f}",
                "CPU s/sample": f"{p.cpu_per_sample:.3f}",
                "CPU cores": f"{p.cpu_seconds / p.seconds:.2f}",
                "GB/s": f"{p.gb_per_s:.2f}",
                "peak mem": f"{p.peak_memory_bytes / 1e9:.2f} GB",
                "per-worker samples/s": " ".join(f"{w.samples_per_s:.2f}" for w in p.workers) or "-",
                "batches": self.checks.get(p.loader, "not checked"),
                "other CPU": f"{100 * p.other_cpu_share:.0f}%",
            }
            rows.append([cells[c] for c in columns])
        return rows

    def columns(self, verbose: bool) -> tuple[str, ...]:
        """The table's columns: every one (`verbose`), or the default set, with the step's figures when one ran."""
        if verbose:
            return TABLE_COLUMNS if self.step is not None else tuple(c for c in TABLE_COLUMNS if c not in STEP_ONLY)
        return STEP_COLUMNS if self.step is not None else SHORT_COLUMNS

    def settings_lines(self) -> list[str]:
        """What was measured and where, for the table's head and the page: the store, its source, the trainer's
        settings, the machine and its load."""
        load = self.machine.get("load_average", {})
        return [
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
            (f"training step: {self.step.name}, run on every batch; alone, its batch already on the {self.step.device}: "
             f"{1e3 * self.step.seconds:.1f} ms ({self.step.samples_per_s:.2f} samples/s, "
             f"{self.step.cpu_seconds / self.step.seconds:.2f} CPU cores)" + self._step_drift() if self.step is not None
             else "training step: none (each batch's data is touched and dropped)"),
        ]

    def _step_drift(self) -> str:
        if self.step is None or self.step_after is None:
            return ""
        drift = self.step_after.seconds / self.step.seconds - 1
        return (f"; again after the loaders: {1e3 * self.step_after.seconds:.1f} ms ({100 * drift:+.1f}%: shares of the "
                "step alone are good to about that)")

    def loader_names(self) -> list[str]:
        """Each loader benched, as "short name = full name": the short names are the table's and the plots'."""
        names = dict.fromkeys(p.loader for p in self.passes)
        return [f"{SHORT_LABELS.get(name, name)} = {LOADER_LABELS.get(name, name)}" for name in names]

    def table(self, verbose: bool = False) -> str:
        """The plain-text report: the settings, one row per pass, notes, and last what to use here."""
        store, source, settings, machine, step = self.settings_lines()
        rows = self.rows(verbose)
        columns = self.columns(verbose)
        right = {i for i, c in enumerate(columns) if c not in TEXT_COLUMNS}
        out = [store, source, *textwrap.wrap(settings, WIDTH, subsequent_indent="  "), machine,
               *textwrap.wrap(step, WIDTH, subsequent_indent="  "), "",
               *format_ruled_table(rows, right)]
        if not verbose:
            out += ["", "loaders:"]
            out += [line for name in self.loader_names()
                    for line in textwrap.wrap(name, WIDTH, initial_indent="  ", subsequent_indent="    ")]
            out += textwrap.wrap("(--verbose: every column (CPU cores, GB/s, each worker's samples/s, the other "
                                 "processes' CPU) and the untimed checking passes; --json: everything)", WIDTH,
                                 initial_indent="  ", subsequent_indent="  ")
        for note in self.notes:
            out += textwrap.wrap(f"note: {note}", WIDTH, subsequent_indent="  ")
        advice = self.recommendation()
        if advice:
            out += ["", advice]
        return "\n".join(out)

    def plot_png(self) -> bytes:
        """Samples/s, CPU s/sample and peak memory per loader as one PNG: bars, cold and warm side by side,
        the `.pt` baseline's bars hatched and its samples/s drawn across, so each loader reads against it."""
        plt = pyplot("h5feed bench --html")
        loaders = list(dict.fromkeys(p.loader for p in self.passes))
        caches = [c for c in CACHES if any(p.cache == c for p in self.passes)]
        colors = {"cold": "tab:blue", "warm": "tab:orange"}
        width = 0.8 / max(len(caches), 1)
        fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True, constrained_layout=True)
        figures = (("samples/s (higher is better)", lambda p: p.samples_per_s, "%.2f"),
                   ("CPU s per sample (lower is better)", lambda p: p.cpu_per_sample, "%.3f"),
                   (f"peak memory, GB ({self.memory_metric.upper()})", lambda p: p.peak_memory_bytes / 1e9, "%.2f"))
        for ax, (ylabel, value, fmt) in zip(axes, figures):
            for k, cache in enumerate(caches):
                at = [(i, p) for i, name in enumerate(loaders) if (p := self.get(name, cache)) is not None]
                bars = ax.bar([i + (k - (len(caches) - 1) / 2) * width for i, _ in at], [value(p) for _, p in at],
                              width, color=colors[cache])
                for bar, (_, p) in zip(bars, at):
                    if p.loader == BASELINE:
                        bar.set_hatch("//")
                ax.bar_label(bars, fmt=fmt, fontsize="small")
            ax.set_ylabel(ylabel)
            ax.grid(axis="y", alpha=0.3)
        keys = [plt.Rectangle((0, 0), 1, 1, facecolor=colors[cache], label=cache) for cache in caches]
        for cache in caches:
            base = self.get(BASELINE, cache)
            if base is not None:
                keys.append(axes[0].axhline(base.samples_per_s, color=colors[cache], linestyle="--", alpha=0.7,
                                            label=f".pt baseline, {cache}"))
        axes[0].legend(handles=keys, loc="upper left", fontsize="small")  # plain keys: the first bar may be hatched
        axes[-1].set_xticks(range(len(loaders)), [textwrap.fill(SHORT_LABELS.get(n, n), 16) for n in loaders])
        axes[0].set_title(f"{self.num_samples} samples, {self.workers} worker(s), max_len {self.max_len}, "
                          f"flavor {self.flavor} (hatched: the .pt baseline)")
        return figure_png(fig)

    def html(self, png: bytes) -> str:
        """The page: the settings, what to use here, the plots (`png`, from `plot_png`), every pass with every
        column, and the notes; one self-contained file to keep beside the run or attach to an issue."""
        machine = self.machine
        software = f"{machine.get('platform')}, Python {machine.get('python')}, torch {machine.get('torch')}"
        advice = self.recommendation() or ("No advice: it needs the .pt baseline measured and a trainer-path loader "
                                           "whose batches equal the baseline's (the notes say what was missing).")
        text_columns = [i for i, c in enumerate(self.columns(verbose=True)) if c in TEXT_COLUMNS]
        sections = [
            Section("Settings", bullets([*self.settings_lines(), software], "settings")),
            Section("What to use here", preformatted(advice, "recommendation")),
            Section("Plots", image(png, "plots", "samples/s, CPU s per sample and peak memory per loader, cold and "
                                                 "warm") + "\n" + bullets(self.loader_names(), "loaders")),
            Section("Every pass", table(self.rows(verbose=True), "passes", text_columns)),
        ]
        if self.notes:
            sections.append(Section("Notes", bullets(self.notes, "notes")))
        return page_html(f"h5feed bench: {self.store}", sections)

    def write_html(self, path: str | Path) -> Path:
        """Draw the plots and write the page to `path` (needs matplotlib: `pip install 'h5feed[report]'`)."""
        page = Path(path)
        page.write_text(self.html(self.plot_png()))
        return page


def _means(passes: list[PassResult], figure: Any) -> dict[str, float]:
    """Each loader's mean of `figure` over its passes (the cache states measured), where it has that figure."""
    values: dict[str, list[float]] = {}
    for p in passes:
        if (value := figure(p)) is not None:
            values.setdefault(p.loader, []).append(value)
    return {name: sum(v) / len(v) for name, v in values.items()}


def format_ruled_table(rows: list[list[str]], right: set[int]) -> list[str]:
    """Plain-text columns: the first row is the header, a rule under it; columns in `right` align right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return [line(rows[0]), line(["-" * w for w in widths]), *(line(r) for r in rows[1:])]
