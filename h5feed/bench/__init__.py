"""`h5feed bench`: the loaders against speculators 0.4's `.pt` loader, on the same samples (see `runner`).

- `synthetic_set`: the embedded default data set (built once, reused) and dropping the page cache;
- `loaders`: the loaders timed, and their per-worker figures;
- `runner`: the passes, cold and warm, with memory and CPU sampled;
- `report`: the results, as a table or JSON;
- `cli`: `h5feed bench`.
"""

from h5feed.bench.cli import add_bench_parser
from h5feed.bench.loaders import LOADER_LABELS, LOADERS, WorkerStats
from h5feed.bench.report import BenchResult, PassResult, format_table
from h5feed.bench.runner import MemorySampler, run_bench
from h5feed.bench.synthetic_set import DEFAULT_CACHE_DIR, SyntheticSpec, drop_page_cache, ensure_default_set

__all__ = [
    "DEFAULT_CACHE_DIR",
    "LOADERS",
    "LOADER_LABELS",
    "BenchResult",
    "MemorySampler",
    "PassResult",
    "SyntheticSpec",
    "WorkerStats",
    "add_bench_parser",
    "drop_page_cache",
    "ensure_default_set",
    "format_table",
    "run_bench",
]
