"""Which failures of a request are worth another try, and how long to wait before it.

Transient failures (a reset or dropped connection, a timeout, a partial body, HTTP 408/429/5xx,
S3's SlowDown and BadDigest, bytes that went wrong in transit) are retried with exponential backoff
and full jitter, a bounded number of times, and counted.  Permanent ones (403, 404, a missing object
or bucket) raise at once an ObjectError that names the object and what to do.  The libraries' own
silent retries are switched off where they can be (see `fsspec_store`), so that every retry is counted here.

A try may wait `timeout` seconds (H5FEED_REQUEST_TIMEOUT, 30 by default) for an answer: the clients'
connect and read timeouts are set to it, and on an async backend a whole try is cancelled after
`deadline(nbytes)`.  A try that timed out fails the request at once, saying so, rather than being
retried: a server that does not answer would multiply the wait.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import math
import os
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from h5feed.io.objects import (
    PART_BYTES,
    AccessDenied,
    IOCounters,
    ObjectError,
    ObjectNotFound,
    ObjectUnavailable,
    TransferMismatch,
)

T = TypeVar("T")
Kind = Literal["transient", "missing", "denied"]

_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_CODES: dict[str, Kind] = {
    "SlowDown": "transient", "Throttling": "transient", "ThrottlingException": "transient",
    "RequestLimitExceeded": "transient", "RequestTimeout": "transient", "InternalError": "transient",
    "ServiceUnavailable": "transient", "BadDigest": "transient",  # BadDigest: the body sent is not the body received
    "NoSuchKey": "missing", "NoSuchBucket": "missing", "NotFound": "missing",
    "AccessDenied": "denied", "InvalidAccessKeyId": "denied", "SignatureDoesNotMatch": "denied",
    "ExpiredToken": "denied", "AllAccessDisabled": "denied",
}


def _transient_types() -> tuple[type[BaseException], ...]:
    """Connection-level failures of the stdlib and of whichever HTTP stacks are installed."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError, http.client.IncompleteRead,
                                        asyncio.TimeoutError, asyncio.IncompleteReadError]
    try:
        import aiohttp

        found += [aiohttp.ClientPayloadError, aiohttp.ClientConnectionError]
    except ImportError:
        pass
    try:
        import botocore.exceptions as b

        found += [b.HTTPClientError, b.IncompleteReadError, b.ResponseStreamingError,
                  b.FlexibleChecksumError]  # a body whose CRC the server states arrived otherwise
    except ImportError:
        pass
    try:
        import urllib3.exceptions as u

        found += [u.ProtocolError, u.TimeoutError]
    except ImportError:
        pass
    try:
        from fsspec.exceptions import FSTimeoutError

        found.append(FSTimeoutError)
    except ImportError:
        pass
    return tuple(found)


_TRANSIENT_TYPES = _transient_types()


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and the ones it was raised from (fsspec backends translate their own errors)."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return seen


_OBSTORE_STATUS = re.compile(r"status code: (\d{3})")


def _status_and_code(exc: BaseException) -> tuple[int | None, str]:
    response = getattr(exc, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode"), response.get("Error", {}).get("Code", "")
    if type(exc).__module__.startswith("obstore"):  # its errors carry the status in the message only
        found = _OBSTORE_STATUS.search(str(exc))
        return (int(found.group(1)), "") if found else (None, "")
    for name in ("status", "status_code", "code"):  # aiohttp, requests-style and gcsfs errors
        value = getattr(exc, name, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value, ""
    return None, ""


def _is_obstore_connection_error(exc: BaseException) -> bool:
    """obstore's GenericError for a failed connection, a timeout or a body cut short (no HTTP status)."""
    return type(exc).__name__ == "GenericError" and "HTTP error" in str(exc)


def _is_timeout(exc: BaseException) -> bool:
    """A try that waited out a timeout (ours or a client's): no answer, rather than a wrong one."""
    return any(isinstance(e, TimeoutError) or "Timeout" in type(e).__name__
               or (type(e).__module__.startswith("obstore") and "TimedOut" in str(e)) for e in _chain(exc))


def classify_failure(exc: BaseException) -> Kind | None:
    """"transient", "missing", "denied", or None for a failure that is none of these (not retried)."""
    for e in _chain(exc):
        status, code = _status_and_code(e)
        if code in _CODES:
            return _CODES[code]
        if status in _TRANSIENT_STATUS:
            return "transient"
        if status == 404 or isinstance(e, FileNotFoundError):
            return "missing"
        if status in (401, 403) or isinstance(e, PermissionError):
            return "denied"
        if isinstance(e, _TRANSIENT_TYPES) or _is_obstore_connection_error(e):
            return "transient"
    return None


def object_error(url: str, exc: BaseException, kind: Kind | None, attempts: int) -> ObjectError:
    """The error to raise for a failure that will not be retried (again)."""
    if kind == "missing":
        return ObjectNotFound(url, "no such object or bucket; check the URL (a store missing one of its own "
                                   "objects is damaged: run `h5feed verify`)")
    if kind == "denied":
        return AccessDenied(url, "access denied; check the credentials (environment, the backend's config files, "
                                 "`storage_options=` or `--storage-option KEY=VALUE`) and the bucket's permissions")
    if kind == "transient":
        return ObjectUnavailable(url, f"still failing after {attempts} attempts ({type(exc).__name__}: {exc}); "
                                      "the service is unreachable or throttling: retry later or lower the concurrency")
    return ObjectError(url, f"{type(exc).__name__}: {exc}")


TIMEOUT_VARIABLE = "H5FEED_REQUEST_TIMEOUT"


def _timeout_from_environment() -> float:
    text = os.environ.get(TIMEOUT_VARIABLE, "30")
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_VARIABLE}={text!r}: expected the seconds a request may wait for an answer, "
                         "e.g. 30")
    return seconds


@dataclass(frozen=True)
class RetryPolicy:
    """Up to `attempts` tries; before try n+1 a random wait in [0, min(cap, base * 2**n)] seconds
    ("full jitter": clients that failed together do not retry together).  A try may wait `timeout` seconds
    for an answer (H5FEED_REQUEST_TIMEOUT when the policy is made); one that timed out ends the request."""

    attempts: int = 10
    base: float = 0.05
    cap: float = 5.0
    timeout: float = field(default_factory=_timeout_from_environment)

    def deadline(self, nbytes: int = 0) -> float:
        """Seconds a whole try that moves `nbytes` may take: `timeout` for each PART_BYTES, at least `timeout`
        (a large body on a slow link takes its time; a server that does not answer fails in `timeout`)."""
        return self.timeout * max(1, math.ceil(nbytes / PART_BYTES))

    def wait_after(self, exc: BaseException, attempt: int, url: str, stats: IOCounters, elapsed: float = 0.0) -> float:
        """Seconds to wait before retrying after failed try `attempt` (0-based) that took `elapsed` seconds,
        or raise the ObjectError."""
        if isinstance(exc, TransferMismatch) and attempt + 1 < self.attempts:
            stats.add_retry()  # bytes garbled on the way: a fresh request, before calling the object damaged
            return random.uniform(0, min(self.cap, self.base * 2**attempt))
        if isinstance(exc, ObjectError):
            raise exc
        kind = classify_failure(exc)
        if kind == "transient" and elapsed >= self.timeout and _is_timeout(exc):
            raise ObjectUnavailable(url, f"no answer in {self.timeout:g} s; check the endpoint and the network, or "
                                         f"raise {TIMEOUT_VARIABLE} (seconds) for a slow link") from exc
        if kind != "transient" or attempt + 1 >= self.attempts:
            raise object_error(url, exc, kind, attempt + 1) from exc
        stats.add_retry()
        return random.uniform(0, min(self.cap, self.base * 2**attempt))

    def call(self, fn: Callable[[], T], url: str, stats: IOCounters) -> T:
        """`fn()` until it succeeds or fails for good; the client bounds each try with its own timeouts."""
        for attempt in itertools.count():
            started = time.monotonic()
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 (wait_after re-raises what is not worth a retry)
                time.sleep(self.wait_after(exc, attempt, url, stats, time.monotonic() - started))
        raise AssertionError("unreachable")

    async def call_async(self, fn: Callable[[], Awaitable[T]], url: str, stats: IOCounters, nbytes: int = 0) -> T:
        """`await fn()` until it succeeds or fails for good, each try (moving `nbytes`) cancelled after its
        `deadline`: a client's read timeout does not cover a body the server stopped reading."""
        for attempt in itertools.count():
            started = time.monotonic()
            try:
                return await asyncio.wait_for(fn(), self.deadline(nbytes))
            except Exception as exc:  # noqa: BLE001 (wait_after re-raises what is not worth a retry)
                await asyncio.sleep(self.wait_after(exc, attempt, url, stats, time.monotonic() - started))
        raise AssertionError("unreachable")


DEFAULT_RETRY = RetryPolicy()
