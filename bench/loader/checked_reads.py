"""What checked reads cost: every inner chunk's crc32c verified before it is decoded.

Reads every sample of a store on one thread, with checks on and off, alternating
passes so the machine's noise hits both alike; cold passes drop the page cache
first (root only).  Prints CPU seconds and wall seconds per sample and the ratio.

    python bench/loader/checked_reads.py [STORE] --passes 3 [--cold]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from h5feed.bench import DEFAULT_CACHE_DIR, SyntheticSpec, drop_page_cache
from h5feed.store import BufferPool, ReadStats, Store


def one_pass(store: Store, pool: BufferPool, cold: bool) -> dict[str, float]:
    if cold:
        drop_page_cache()
    stats = ReadStats()
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(len(store)):
        store.read_sample(i, allocate=pool, stats=stats)
    n = len(store)
    return {"wall_s_per_sample": (time.perf_counter() - wall) / n, "cpu_s_per_sample": (time.process_time() - cpu) / n,
            "GB_read": stats.bytes_read / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", nargs="?", help="default: the embedded synthetic Kimi-shaped set of `h5feed bench`")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every pass")
    args = parser.parse_args()
    path = args.store or (DEFAULT_CACHE_DIR.expanduser() / SyntheticSpec().name / "store")
    stores = {"checked": Store(path), "unchecked": Store(path, checked=False)}
    pool = BufferPool(capacity=4)
    one_pass(stores["checked"], pool, cold=False)  # warm-up: buffers, page cache
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in stores}
    for _ in range(args.passes):
        for name, store in stores.items():
            runs[name].append(one_pass(store, pool, args.cold))
    result = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    for key in ("wall_s_per_sample", "cpu_s_per_sample"):
        result[f"cost_{key}"] = result["checked"][key] / result["unchecked"][key] - 1
    print(json.dumps({"store": str(path), "samples": len(stores["checked"]), "cold": args.cold, **result}, indent=2))


if __name__ == "__main__":
    main()
