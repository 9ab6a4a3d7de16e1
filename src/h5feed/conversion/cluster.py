"""Conversion on a Dask cluster (`h5feed convert --scheduler`): the converter's task pool, on distributed.

Only the per-sample work runs on the cluster, as plain tasks through
distributed's own `concurrent.futures` executor (`Client.get_executor`); the
driver (plan, journal, finalize, the writer's lock) stays in the process that
runs `convert`.  Workers read SRC and write DST by the paths the driver uses:
mount them at the same place on every machine, and install h5feed there.

A task that raises (a failed write on a flaky mount) is retried `retries`
times; one whose worker dies is given to another worker by the scheduler (up to
`distributed.scheduler.allowed-failures` times).  Either way a sample may be
written twice, or by a task its driver no longer waits for: each shard is
renamed into place whole, and every try writes the same bytes, so the store is
the same.  Bad source files come back as values, and are never retried.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from typing import Any

from h5feed.errors import H5feedError

log = logging.getLogger(__name__)

RETRIES = 2
_SLOTS_TTL = 2.0  # seconds between asking the scheduler how many threads its workers have


class DaskPool(Executor):
    """Tasks on the cluster of `scheduler` ("tcp://HOST:PORT"), or on a `LocalCluster` of `workers`
    processes that this pool starts and stops ("local")."""

    shares_page_cache = False  # workers may sit on other machines: no read-ahead from here

    def __init__(self, scheduler: str, workers: int | None = None, *, retries: int = RETRIES) -> None:
        distributed = require_distributed()
        self._cluster = None
        if scheduler == "local":
            self._cluster = local_cluster(workers or os.cpu_count() or 1)
            self._client = distributed.Client(self._cluster)
        else:
            try:
                self._client = distributed.Client(scheduler)
            except OSError as exc:
                raise H5feedError(f"cannot reach the Dask scheduler at {scheduler}: {exc}") from exc
        if not self._client.nthreads():
            log.info("waiting for the first Dask worker to join %s", self._client.scheduler.address)
            self._client.wait_for_workers(1)
        self._executor = self._client.get_executor(pure=False, retries=retries)
        self._slots, self._slots_at = 0, -_SLOTS_TTL
        log.info("Dask: %d worker thread(s) at %s; dashboard %s", self.slots(), self._client.scheduler.address,
                 self._client.dashboard_link)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return self._executor.submit(fn, *args, **kwargs)

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float | None = None,
            chunksize: int = 1) -> Iterator[Any]:
        return self._executor.map(fn, *iterables, timeout=timeout)

    def slots(self) -> int:
        """Tasks the cluster runs at once: its workers' threads (asked again every few seconds, as workers come and go)."""
        if time.monotonic() - self._slots_at > _SLOTS_TTL:
            self._slots = max(1, sum(self._client.nthreads().values()))
            self._slots_at = time.monotonic()
        return self._slots

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Wait for the tasks in flight (or cancel them), then disconnect, and stop a cluster this pool started."""
        try:
            self._executor.shutdown(wait=wait and not cancel_futures)
        finally:
            self._client.close()
            if self._cluster is not None:
                self._cluster.close()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.shutdown(cancel_futures=exc_type is not None)  # a failed or interrupted run leaves nothing running


def local_cluster(workers: int, **kwargs: Any) -> Any:
    """A `distributed.LocalCluster` of `workers` single-thread processes, as `--dask` starts it.

    Its workers keep glibc's adaptive malloc: distributed sets MALLOC_TRIM_THRESHOLD_
    in the workers it spawns, which makes every chunk buffer a fresh mmap, and costs
    the conversion ~20% more CPU (page faults in system time).  Start the workers of
    a cluster of your own with it unset too (docs/pipelines.md, "Converting on a cluster").
    """
    import dask

    distributed = require_distributed()
    with dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}):
        return distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, **kwargs)


def require_distributed() -> Any:
    """The `distributed` module, or an error that says how to install it."""
    try:
        import distributed
    except ImportError as exc:
        raise H5feedError(
            "converting on Dask needs Dask distributed, which is not installed: pip install 'h5feed[dask]'"
        ) from exc
    return distributed
