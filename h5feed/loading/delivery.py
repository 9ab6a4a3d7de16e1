"""A delivery thread: what the trainer's `next()` would otherwise do (take a filled slot from the workers or
threads, wrap it as the batch's tensors, queue its copy to the GPU), done one batch ahead in a thread of its own.

The trainer's thread then only takes a batch that is ready.  The thread stays one batch in
front of the trainer: each batch it holds is a slot of the ring that no writer may fill.  Whatever the thread raises (a damaged sample, a dead worker) is
raised on the trainer's thread at the batch where it happened.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

Delivered = TypeVar("Delivered")


@dataclass(frozen=True)
class _Failure:
    """What the source raised, to be raised on the trainer's thread."""

    error: BaseException


_END = object()  # the source is exhausted


class Delivery(Generic[Delivered]):
    """Runs `source()` in a thread of its own, one result in front of the trainer's thread.

    Iterate on the trainer's thread; `close()` stops the thread (once what it is doing now is done:
    a read in flight is not cut) and closes the source in it.  A source must not refer to the
    Delivery, so that a loader nobody holds any more can go.
    """

    def __init__(self, source: Callable[[], Iterator[Delivered]], *, name: str = "h5feed-delivery") -> None:
        self._room = threading.Semaphore(1)  # taken by the thread for each result, given back as the trainer takes it
        self._ready: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_deliver, args=(source, self._room, self._ready, self._stop),
                                        name=name, daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[Delivered]:
        """The source's results, in order, on the trainer's thread; what it raised, raised here."""
        while True:
            delivered = self._ready.get()
            self._room.release()  # the thread goes on to the next while the trainer uses this one
            if delivered is _END:
                return
            if isinstance(delivered, _Failure):
                raise delivered.error
            yield delivered  # type: ignore[misc]

    def close(self) -> None:
        """Stop the thread and wait for it (it closes the source)."""
        self._stop.set()
        self._room.release()
        if self._thread is not threading.current_thread():
            self._thread.join()


def _deliver(source: Callable[[], Iterator[Delivered]], room: threading.Semaphore, ready: queue.SimpleQueue[object],
             stop: threading.Event) -> None:
    """The thread: one result of the source per free place, until the source ends, fails or is stopped."""
    try:
        results = source()
        try:
            while True:
                room.acquire()
                if stop.is_set():
                    return
                result = next(results, _END)
                ready.put(result)
                if result is _END:
                    return
        finally:
            close = getattr(results, "close", None)
            if close is not None:
                close()
    except BaseException as error:  # noqa: BLE001  (handed to the trainer's thread, raised there)
        ready.put(_Failure(error))
