"""`h5feed bench`: the trainer's path, h5feed's loaders against speculators 0.4's `.pt` loader (see `runner`).

- `synthetic_set`: the embedded default data set (built once, reused) and dropping the page cache;
- `loaders`: the loaders timed, their per-worker figures, and the digest their batches are compared by;
- `runner`: the passes, cold and warm, with memory and CPU sampled;
- `report`: the results, as a table, JSON or an HTML page with plots;
- `cli`: `h5feed bench`.
"""

from h5feed.bench.cli import add_bench_parser
from h5feed.bench.loaders import DEFAULT_LOADERS, LOADER_LABELS, LOADERS, WorkerPass
from h5feed.bench.report import BenchResult, PassResult, format_ruled_table
from h5feed.bench.runner import MemorySampler, Passes, run_bench
from h5feed.bench.step import StepOptions
from h5feed.bench.synthetic_set import (
    DEFAULT_CACHE_DIR,
    DefaultSet,
    SyntheticSpec,
    drop_page_cache,
    ensure_default_set,
)

__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEFAULT_LOADERS",
    "LOADERS",
    "LOADER_LABELS",
    "BenchResult",
    "DefaultSet",
    "MemorySampler",
    "PassResult",
    "Passes",
    "StepOptions",
    "SyntheticSpec",
    "WorkerPass",
    "add_bench_parser",
    "drop_page_cache",
    "ensure_default_set",
    "format_ruled_table",
    "run_bench",
]
