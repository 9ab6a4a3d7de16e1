"""Where `h5feed convert`'s per-sample tasks run, and what their processes leave behind when killed.

The driver (plan, journal, finalize) stays in the process that runs `convert`; the per-sample work runs
in a task pool (`TaskPool`): a local pool of spawned worker processes (the default), this process
(`workers=0`), or a Dask cluster (`h5feed.conversion.cluster`).  `PoolMaker` starts the pool on first
use, so a run with nothing left to convert starts none.

Two mechanisms keep a killed converter from leaving anything behind, and they are kept together here
because each covers what the other cannot:

- a worker dies with the converter.  Its interpreter runs `_DIE_WITH_CONVERTER` before it imports
  anything (Linux's PR_SET_PDEATHSIG, set by a copy of CPython's spawn launch, `_WorkerPopen`), and
  where the kernel does not offer that, a thread of the worker watches its parent (`_init_worker`);
- the named POSIX semaphores a pool creates in /dev/shm (`sem.mp-*`) outlive a SIGKILL of the
  converter, its workers and Python's resource tracker at once.  The converter records the ones its
  process maps in its lock (`mapped_semaphores`, through `WriterLock.record_semaphores`), and the
  next writer removes those still present that no living process maps (`remove_orphaned_semaphores`).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from multiprocessing import popen_spawn_posix, reduction, resource_tracker, spawn, util
from multiprocessing.context import SpawnContext, SpawnProcess, set_spawning_popen
from pathlib import Path
from typing import Any, Protocol

import torch

_SHM = Path("/dev/shm")


class TaskPool(Protocol):
    """Where the per-sample tasks run: a local process pool, this process, or a Dask cluster."""

    shares_page_cache: bool  # whether the workers read files through this machine's page cache

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]: ...
    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], chunksize: int = 1) -> Iterable[Any]: ...
    def slots(self) -> int: ...  # tasks it runs at once
    def __enter__(self) -> TaskPool: ...
    def __exit__(self, *exc: object) -> Any: ...


class PoolMaker:
    """The task pool, started on first use (a run with nothing left to convert starts none), stopped on exit.

    `started` is called once the pool runs: the converter records the pool's semaphores in its lock then."""

    def __init__(self, workers: int, scheduler: str | None, started: Callable[[], None]) -> None:
        self.workers, self.scheduler, self.started = workers, scheduler, started
        self._pool: TaskPool | None = None

    def __call__(self) -> TaskPool:
        if self._pool is None:
            if self.scheduler is not None:
                from h5feed.conversion.cluster import DaskPool

                self._pool = DaskPool(self.scheduler, self.workers).__enter__()
            else:
                self._pool = (_InlinePool() if self.workers == 0 else _ProcessPool(self.workers)).__enter__()
            self.started()
        return self._pool

    def __enter__(self) -> PoolMaker:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.__exit__(*exc)


class _ProcessPool(ProcessPoolExecutor):
    """Spawned worker processes (safe whatever threads torch or zarr started here), that die with the converter."""

    shares_page_cache = True

    def __init__(self, workers: int) -> None:
        super().__init__(max_workers=workers, mp_context=_WorkerContext(), initializer=_init_worker,
                         initargs=(os.getpid(),))
        self._workers = workers

    def slots(self) -> int:
        return self._workers


# The first lines a worker's interpreter runs, before it imports anything: Linux kills the worker when the converter
# dies (PR_SET_PDEATHSIG, which fires when the thread that started the worker ends: the driver's, which submits every
# task and lives as long as the conversion), and a worker whose converter died before that exits.  Any later (in the
# initializer) is seconds too late: a spawned worker imports h5feed and torch first (unpickling the initializer, and
# re-running the `h5feed` script), and a converter SIGKILLed meanwhile left it running, with the pool's semaphores.
_DIE_WITH_CONVERTER = """\
import ctypes, os, signal
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (AttributeError, OSError):  # not Linux: _exit_when_orphaned watches, once h5feed is imported
    pass
if os.getppid() != {converter}:
    os._exit(1)
"""


class _WorkerPopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn (its `_launch`, as of Python 3.10 to 3.13), with `_DIE_WITH_CONVERTER` run first."""

    def _launch(self, process_obj: Any) -> None:
        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        data = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(spawn.get_preparation_data(process_obj._name), data)
            reduction.dump(process_obj, data)
        finally:
            set_spawning_popen(None)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        try:
            command = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            if command[-3:-2] == ["-c"]:  # [python, flags..., "-c", program, "--multiprocessing-fork"]
                command[-2] = _DIE_WITH_CONVERTER.format(converter=os.getpid()) + command[-2]
            self._fds.extend([child_r, child_w])
            self.pid = util.spawnv_passfds(spawn.get_executable(), command, self._fds)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(data.getbuffer())
        finally:
            self.finalizer = util.Finalize(self, util.close_fds, (parent_r, parent_w))
            os.close(child_r)
            os.close(child_w)


class _WorkerProcess(SpawnProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _WorkerPopen:
        return _WorkerPopen(process_obj)


class _WorkerContext(SpawnContext):
    """The spawn start method, with workers that die with the converter (`_WorkerPopen`)."""

    Process = _WorkerProcess


class _InlinePool(Executor):
    """Runs each task at submit time: `workers=0`, for debugging and small jobs."""

    shares_page_cache = True

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def slots(self) -> int:
        return 1


def _init_worker(parent: int) -> None:
    """One core's worth of work per process (the processes are the parallelism); and where the kernel does not kill
    a worker with the converter (`_DIE_WITH_CONVERTER`), a worker exits within a second of the converter's death."""
    from numcodecs import blosc

    torch.set_num_threads(1)
    blosc.set_nthreads(1)
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def worker_name() -> str:
    """Who runs this task: a Dask worker's address, or host:pid."""
    if "distributed" in sys.modules:
        from distributed import get_worker

        with contextlib.suppress(ValueError):  # not in a Dask worker
            return str(get_worker().address)
    return f"{socket.gethostname()}:{os.getpid()}"


def _mapped_shm_inodes(pid: int | str) -> set[int]:
    """Inodes of the /dev/shm files a process maps.  A named POSIX semaphore is such a file, mapped
    under the temporary name glibc created it with (since deleted): only its inode tells which it is."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return {int(line.split()[4]) for line in maps.splitlines() if " /dev/shm/" in line}


def _semaphores_by_inode() -> dict[int, str]:
    found = {}
    for name in os.listdir(_SHM):
        if name.startswith("sem."):
            try:
                found[os.stat(_SHM / name).st_ino] = name
            except FileNotFoundError:
                continue
    return found


def mapped_semaphores(pid: int | str) -> list[list[str | int]]:
    """[name, inode] of the named semaphores a process maps now: what a writer's lock records."""
    mapped = _mapped_shm_inodes(pid)
    return [[name, inode] for inode, name in _semaphores_by_inode().items() if inode in mapped]


def remove_orphaned_semaphores(recorded: list[list[str | int]]) -> list[str]:
    """Remove the recorded semaphores that still exist (same name, same inode) and that no living
    process maps; return their names."""
    present = _semaphores_by_inode()
    candidates = {int(inode): str(name) for name, inode in recorded if present.get(int(inode)) == name}
    if not candidates:
        return []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for inode in _mapped_shm_inodes(pid) & candidates.keys():
            del candidates[inode]
    for name in candidates.values():
        (_SHM / name).unlink(missing_ok=True)
    return sorted(candidates.values())
