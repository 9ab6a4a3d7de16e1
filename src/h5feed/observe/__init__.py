"""Seeing where a training run's time goes: the monitor around the trainer's loader, its stall watchdog, `h5feed watch`.

The per-worker counters it reads live in `h5feed.observe.metrics` (written by the datasets).
"""

from h5feed.observe.monitor import Monitor, monitor

__all__ = ["Monitor", "monitor"]
