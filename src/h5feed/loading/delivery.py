"""A delivery thread: what the trainer's `next()` would otherwise do (take a filled slot from the workers or
threads, wrap it as the batch's tensors, queue its copy to the GPU), done one batch ahead in a thread of its own.

The trainer's thread then only takes a batch that is ready.  The thread stays one batch in
front of the trainer: each batch it holds is a slot of the ring that no writer may fill.  Whatever the thread raises (a damaged sample, a dead worker) is
raised on the trainer's thread at the batch where it happened.

What must happen on the trainer's thread (its CUDA stream made to wait for the batch) runs
before the thread is let go on to the next batch: those calls release the GIL, and a
delivery thread let go first took it then and held it for its Python work, up to the
interpreter's switch interval (5 ms), at every tenth `next()` or so on the H200 box.

Nor does the thread start on the next batch the moment the trainer takes one (`Pacing`): that is
when the trainer launches its step's first kernels onto an idle GPU, and every millisecond the
thread's Python work holds the GIL then is a millisecond the GPU waits.  While the trainer keeps
finding its batch ready, the thread waits up to half a step (at most 0.1 s) first, into the part of the step
where the GPU has work queued (or the trainer waits for its loss, the GIL let go).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

Delivered = TypeVar("Delivered")


@dataclass(frozen=True)
class _Failure:
    """What the source raised, to be raised on the trainer's thread."""

    error: BaseException


_END = object()  # the source is exhausted


@dataclass
class Pacing:
    """When the delivery thread starts on the next result, learnt from the trainer's takes.

    The trainer's thread reports each take (`took`); the delivery thread asks how long to wait
    before it works on the next result (`pause`): half the trainer's step (the shorter of its last
    two intervals between takes, so that one long pause of the trainer's, a checkpoint or an
    evaluation, does not set it; at most `MAX_PAUSE`), less what has passed since, and never so
    long that the result, made in the time the last one took (`made`), would come later than the
    trainer's next take.  No wait while the trainer waited for its last batch: a loader that is
    behind makes each result as soon as it can."""

    MAX_PAUSE: ClassVar[float] = 0.1  # s; a step's launches onto an idle GPU take some 20 ms at Kimi's shape

    last_take: float | None = None
    intervals: tuple[float, float] = (0.0, 0.0)  # the trainer's last two intervals between takes
    trainer_waited: bool = True
    making: float = 0.0  # how long the thread took to make its last result

    def took(self, now: float, waited: bool) -> None:
        if self.last_take is not None:
            self.intervals = (self.intervals[1], now - self.last_take)
        self.last_take, self.trainer_waited = now, waited

    def made(self, seconds: float) -> None:
        self.making = seconds

    def pause(self, now: float) -> float:
        if self.trainer_waited or self.last_take is None:
            return 0.0
        step = min(self.intervals)
        start = min(step / 2, step - 2 * self.making, self.MAX_PAUSE)  # after the take: room for the work, twice
        return max(0.0, start - (now - self.last_take))


class Delivery(Generic[Delivered]):
    """Runs `source()` in a thread of its own, one result in front of the trainer's thread.

    Iterate on the trainer's thread; `on_take(result)` runs there for each result before the
    thread goes on.  `close()` stops the thread (once what it is doing now is done: a read in
    flight is not cut) and closes the source in it.  A source must not refer to the Delivery, so
    that a loader nobody holds any more can go.
    """

    def __init__(self, source: Callable[[], Iterator[Delivered]], *,
                 on_take: Callable[[Delivered], None] | None = None, name: str = "h5feed-delivery") -> None:
        self._on_take = on_take
        # one token: taken by the thread for each result, given back as the trainer takes it (a SimpleQueue rather
        # than a Semaphore: its put runs in C, with no Python-level lock, on the trainer's thread)
        self._room: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._room.put(None)
        self._ready: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._pacing = Pacing()
        self._thread = threading.Thread(target=_deliver, args=(source, self._room, self._ready, self._stop,
                                                               self._pacing), name=name, daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[Delivered]:
        """The source's results, in order, on the trainer's thread; what it raised, raised here."""
        while True:
            waited = self._ready.empty()
            delivered = self._ready.get()
            self._pacing.took(time.perf_counter(), waited)
            try:
                if delivered is _END:
                    return
                if isinstance(delivered, _Failure):
                    raise delivered.error
                if self._on_take is not None:
                    self._on_take(delivered)  # type: ignore[arg-type]
            finally:
                self._room.put(None)  # the thread goes on to the next while the trainer uses this one
            yield delivered  # type: ignore[misc]

    def close(self) -> None:
        """Stop the thread and wait for it (it closes the source)."""
        self._stop.set()
        self._room.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()


class TrainerStream:
    """The CUDA stream the trainer's kernels run on, as its thread had it when the pass began.

    The delivery thread marks each batch's GPU memory as used by that stream as soon as the batch
    exists (`adopt`), so that taking a batch (`take`) is a stream lookup, a comparison and an event
    query on the trainer's thread, whatever the number of tensors in the batch."""

    def __init__(self, device: torch.device | None) -> None:
        # the index, resolved once: given torch.device("cuda"), torch.cuda.current_stream looks the current device
        # up through several layers of Python at every call
        device = torch.device("cuda") if device is None else torch.device(device)
        self.device_index = torch.cuda.current_device() if device.index is None else device.index
        self.stream = torch.cuda.current_stream(self.device_index)  # on the trainer's thread: its current stream

    def adopt(self, batch: Mapping[str, Any]) -> None:
        """The batch's GPU memory, made on another stream, is kept for the trainer's stream's work (any thread)."""
        _record_on(batch, self.stream)

    def take(self, batch: Mapping[str, Any], ready: torch.cuda.Event) -> None:
        """The trainer's current stream waits for `ready` (the batch's copy or decode); call it on the trainer's
        thread as it takes the batch.  A trainer that has switched streams since the pass began gets the batch's
        memory kept for its new stream too.  A completed event needs no wait (what it follows is done)."""
        consumer = torch.cuda.current_stream(self.device_index)
        if consumer != self.stream:
            _record_on(batch, consumer)
        if not ready.query():
            consumer.wait_event(ready)


def _record_on(batch: Mapping[str, Any], stream: torch.cuda.Stream) -> None:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.is_cuda:
            value.record_stream(stream)


def _deliver(source: Callable[[], Iterator[Delivered]], room: queue.SimpleQueue[None],
             ready: queue.SimpleQueue[object], stop: threading.Event, pacing: Pacing) -> None:
    """The thread: one result of the source per free place, until the source ends, fails or is stopped."""
    try:
        results = source()
        try:
            while True:
                room.get()
                if stop.wait(pacing.pause(time.perf_counter())):
                    return
                started = time.perf_counter()
                result = next(results, _END)
                pacing.made(time.perf_counter() - started)
                ready.put(result)
                if result is _END:
                    return
        finally:
            close = getattr(results, "close", None)
            if close is not None:
                close()
    except BaseException as error:  # noqa: BLE001  (handed to the trainer's thread, raised there)
        ready.put(_Failure(error))
