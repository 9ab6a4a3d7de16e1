"""A real S3 API on loopback for the tests and the remote bench: moto's server in its own process,
behind a small TCP proxy that can delay, stall, cut, alter, corrupt or refuse requests on demand.

Tests import the fixtures (`from s3_server import s3_fixture, bucket_fixture` gives them `s3` and
`bucket`); the bench starts the same pieces as processes (`python tests/s3_server.py --delay 0.02`
prints the endpoints, then serves until killed).  Everything listens on 127.0.0.1 only, and the
proxy is bounded: at most `max_connections` connections at a time, faults that fire a given
number of times, a request log of bounded length.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

HOST = "127.0.0.1"
REGION = "us-east-1"
CREDENTIALS = {"key": "testing", "secret": "testing"}  # moto accepts any; nothing leaves the box


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class MotoServer:
    """`python -m moto.server` in its own process (its GIL is not the client's), on a free port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection((HOST, self.port), timeout=1):
                    return
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


@dataclass
class Fault:
    """What the proxy does to the next `times` requests (None: every one) whose method and path match.

    `status`: answer with this HTTP status and S3 error `code` instead of forwarding the request.
    `drop_after`: forward the request, then close the connection after this many bytes of the response.
    `flip_at`: forward the request, and flip (xor 0xFF) this byte of the response's body in transit (a body
    that short passes unchanged), as a faulty network or middlebox would.
    `stall`: hold the request this many seconds before forwarding it (a server that does not answer).
    `flip_request_byte`: forward the request with this byte of its body inverted (an upload changed on the way).
    `short_body`: answer a range GET with at most this many bytes (zeros; fewer than asked), said consistently
    in its headers.
    """

    status: int | None = None
    code: str = ""
    drop_after: int | None = None
    flip_at: int | None = None
    stall: float = 0.0
    flip_request_byte: int | None = None
    short_body: int | None = None
    method: str | None = "GET"
    path: str = ""  # a substring of the request path, e.g. the object key
    times: int | None = 1

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and self.path in path

    @property
    def kind(self) -> str:
        """What the request log records for a request this fault hit."""
        if self.status is not None:
            return "status"
        if self.short_body is not None:
            return "short"
        if self.flip_at is not None or self.flip_request_byte is not None:
            return "flip"
        return "stall" if self.stall else "drop"


@dataclass
class Gate:
    """Hold matching requests until `size` of them are held at once, then let them all through.

    A client that sends its requests one after another never fills the gate: after `timeout`
    seconds the held requests go on and `filled` stays False.  So `filled` proves concurrency
    without measuring time.
    """

    size: int
    path: str = ""
    method: str | None = "GET"
    timeout: float = 10.0
    arrived: int = 0
    filled: bool = False

    def __post_init__(self) -> None:
        self._open = asyncio.Event()

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and self.path in path and not self._open.is_set()

    async def wait(self) -> None:
        self.arrived += 1
        if self.arrived >= self.size:
            self.filled = True
            self._open.set()
        try:
            await asyncio.wait_for(self._open.wait(), self.timeout)
        except asyncio.TimeoutError:
            self._open.set()


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query string
    fault: str  # "", or the kind of the Fault that hit it: "status", "short", "drop", "stall", "flip"


class FaultProxy:
    """A TCP proxy for HTTP/1.1 on 127.0.0.1 that can add a delay to every request, answer chosen
    requests with an error status or a short body, hold them, alter their bodies, flip a byte of their
    responses' bodies, or cut chosen responses after some bytes (see `Fault`).

    It frames requests (head, then a Content-Length or chunked body) so that faults hit whole
    requests; responses are copied through as bytes.  It runs in a thread with its own event loop.
    """

    LOG_LENGTH = 100_000

    def __init__(self, upstream_port: int, delay: float = 0.0, max_connections: int = 512) -> None:
        self.upstream_port = upstream_port
        self.delay = delay
        self._max_connections = max_connections
        self._faults: list[Fault] = []
        self._gates: list[Gate] = []
        self._log: collections.deque[Request] = collections.deque(maxlen=self.LOG_LENGTH)
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self.port = 0

    # --- control, from any thread ----------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def gate(self, size: int, path: str = "", timeout: float = 10.0) -> Gate:
        """A Gate for the next `size` GETs whose path contains `path` (made on the proxy's loop)."""
        async def make() -> Gate:
            gate = Gate(size, path, timeout=timeout)
            with self._lock:
                self._gates.append(gate)
            return gate

        return asyncio.run_coroutine_threadsafe(make(), self._loop).result(10)

    def reset(self) -> None:
        """No faults, gates or delay; an empty log."""
        with self._lock:
            self._faults.clear()
            self._gates.clear()
            self._log.clear()
        self.delay = 0.0

    def requests(self, method: str | None = None, path: str = "") -> list[Request]:
        with self._lock:
            return [r for r in self._log if (method is None or r.method == method) and path in r.path]

    def stop(self) -> None:
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        self._thread.join(10)

    # --- the proxy ---------------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._slots = asyncio.Semaphore(self._max_connections)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, HOST, 0, limit=1 << 16))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, path):
                    if fault.times is not None:
                        fault.times -= 1
                        if fault.times == 0:
                            self._faults.remove(fault)
                    return fault
        return None

    def _take_gate(self, method: str, path: str) -> Gate | None:
        with self._lock:
            return next((gate for gate in self._gates if gate.matches(method, path)), None)

    def _record(self, method: str, path: str, fault: str) -> None:
        with self._lock:
            self._log.append(Request(method, path, fault))

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        async with self._slots:
            upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
            pump: asyncio.Task[None] | None = None
            cut = _Cut()
            try:
                while True:
                    try:
                        head = await client_reader.readuntil(b"\r\n\r\n")
                    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                        return
                    method, path, headers = _parse_head(head)
                    if self.delay:
                        await asyncio.sleep(self.delay)
                    gate = self._take_gate(method, path)
                    if gate is not None:
                        await gate.wait()
                    fault = self._take_fault(method, path)
                    if fault is not None and fault.status is not None:
                        self._record(method, path, "status")
                        if headers.get("expect", "").lower() != "100-continue":  # else the client waits for us
                            async for _ in _body(client_reader, headers):
                                pass
                        client_writer.write(_error_response(fault.status, fault.code, method))
                        await client_writer.drain()
                        return  # the error response says Connection: close
                    if fault is not None and fault.short_body is not None:
                        self._record(method, path, fault.kind)
                        client_writer.write(_short_response(headers.get("range", ""), fault.short_body))
                        await client_writer.drain()
                        return
                    self._record(method, path, fault.kind if fault is not None else "")
                    if fault is not None and fault.stall:
                        await asyncio.sleep(fault.stall)
                    if upstream is None or upstream[1].is_closing():
                        upstream = await asyncio.open_connection(HOST, self.upstream_port)
                        pump = asyncio.create_task(_copy_response(upstream[0], client_writer, cut))
                    cut.remaining = fault.drop_after if fault is not None else None
                    cut.flip(fault.flip_at if fault is not None else None)
                    flip = fault.flip_request_byte if fault is not None else None
                    upstream[1].write(head)
                    sent = 0
                    async for piece in _body(client_reader, headers):
                        if flip is not None and sent <= flip < sent + len(piece):
                            piece = piece[:flip - sent] + bytes([piece[flip - sent] ^ 0xFF]) + piece[flip - sent + 1:]
                        sent += len(piece)
                        upstream[1].write(piece)
                        await upstream[1].drain()
                    await upstream[1].drain()
            except (ConnectionError, asyncio.CancelledError):  # cancelled: the proxy stops (asyncio < 3.12 would
                return                                          # log a cancelled connection task as an error)
            finally:
                if pump is not None:  # let the response finish
                    try:
                        await asyncio.wait_for(pump, 60)
                    except (asyncio.TimeoutError, ConnectionError, asyncio.CancelledError):
                        pump.cancel()
                if upstream is not None:
                    upstream[1].close()
                client_writer.close()


@dataclass
class _Cut:
    """What happens to the current response: cut after `remaining` bytes, and/or its body's byte `flip_at` flipped."""

    remaining: int | None = None  # bytes of the current response still let through; None: all
    flip_at: int | None = None  # the body's byte to flip; None: none
    body_seen: int | None = None  # bytes of the body before the next piece; None while in the head
    head_tail: bytes = b""  # the head's last bytes so far (its end may span two pieces)

    def flip(self, at: int | None) -> None:
        self.flip_at, self.body_seen, self.head_tail = at, None, b""

    def corrupt(self, piece: bytes) -> bytes:
        """The piece, with the body's byte `flip_at` flipped if it is in it."""
        if self.flip_at is None:
            return piece
        if self.body_seen is None:
            joined = self.head_tail + piece
            end = joined.find(b"\r\n\r\n")
            if end < 0:
                self.head_tail = joined[-3:]
                return piece
            self.body_seen = len(self.head_tail) - end - 4  # the body's offset of piece[0] (negative: head)
        at, self.body_seen = self.flip_at - self.body_seen, self.body_seen + len(piece)
        if not 0 <= at < len(piece):
            return piece
        self.flip_at = None
        flipped = bytearray(piece)
        flipped[at] ^= 0xFF
        return bytes(flipped)


async def _copy_response(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cut: _Cut) -> None:
    """Copy the server's bytes to the client until the server closes, or cut the connection."""
    try:
        while piece := await reader.read(1 << 16):
            piece = cut.corrupt(piece)
            if cut.remaining is not None:
                if len(piece) >= cut.remaining:
                    writer.write(piece[: cut.remaining])
                    await writer.drain()
                    writer.transport.abort()  # a reset, mid-body
                    return
                cut.remaining -= len(piece)
            writer.write(piece)
            await writer.drain()
    except ConnectionError:
        pass
    writer.close()


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return method, target.split("?", 1)[0], headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The request body as it came (chunked framing kept), piece by piece."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readuntil(b"\r\n")
            yield size_line
            size = int(size_line.split(b";")[0], 16)
            if size == 0:  # trailers, then an empty line
                while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
                    yield line
                yield line
                return
            yield await reader.readexactly(size + 2)
    remaining = int(headers.get("content-length", 0))
    while remaining:
        piece = await reader.read(min(remaining, 1 << 16))
        if not piece:
            raise ConnectionResetError("client closed mid-body")
        remaining -= len(piece)
        yield piece


def _error_response(status: int, code: str, method: str) -> bytes:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>injected by the test proxy</Message><RequestId>proxy</RequestId></Error>"
    ).encode()
    reason = {403: "Forbidden", 404: "Not Found", 500: "Internal Server Error", 503: "Service Unavailable"}
    head = (
        f"HTTP/1.1 {status} {reason.get(status, 'Error')}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head if method == "HEAD" else head + body


def _short_response(range_header: str, nbytes: int) -> bytes:
    """206 Partial Content with at most `nbytes` zeros (always fewer than asked) from the start of the range
    asked for (`bytes=START-LAST`), as S3 answers a range that runs past the end of the object."""
    first, _, last = range_header.removeprefix("bytes=").partition("-")
    start = int(first or 0)
    nbytes = min(nbytes, int(last) - start) if last else nbytes
    head = (
        f"HTTP/1.1 206 Partial Content\r\nContent-Type: binary/octet-stream\r\n"
        f"Content-Range: bytes {start}-{start + nbytes - 1}/{start + nbytes}\r\nContent-Length: {nbytes}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + bytes(nbytes)


# --- what the tests use ---------------------------------------------------------------------------


@dataclass
class S3:
    """The loopback S3 endpoint: `storage_options` reach moto through the proxy; `client` (boto3)
    reaches moto directly, for setting up and checking buckets without touching the proxy's log."""

    server: MotoServer
    proxy: FaultProxy
    client: Any

    @property
    def storage_options(self) -> dict[str, Any]:
        return {**CREDENTIALS, "endpoint_url": self.proxy.url, "client_kwargs": {"region_name": REGION}}

    def new_bucket(self) -> str:
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        return name


def boto3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=CREDENTIALS["key"],
                        aws_secret_access_key=CREDENTIALS["secret"], region_name=REGION)


@contextlib.contextmanager
def running_s3() -> Iterator[S3]:
    """A moto server behind a fault proxy, both stopped on exit."""
    server = MotoServer()
    proxy = FaultProxy(server.port).start()
    try:
        yield S3(server, proxy, boto3_client(server.url))
    finally:
        proxy.stop()
        server.stop()


@pytest.fixture(scope="session", name="s3")
def s3_fixture() -> Iterator[S3]:
    with running_s3() as s3:
        yield s3


@pytest.fixture(name="bucket")
def bucket_fixture(s3: S3) -> Iterator[str]:
    """A fresh, empty bucket; the proxy without faults or delay and with an empty log."""
    s3.proxy.reset()
    yield s3.new_bucket()
    s3.proxy.reset()


def main() -> None:
    """Serve moto behind a proxy until killed; print one line `MOTO_URL PROXY_URL` when ready."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds added to every request by the proxy")
    args = parser.parse_args()
    server = MotoServer()
    proxy = FaultProxy(server.port, delay=args.delay).start()
    print(server.url, proxy.url, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    finally:
        proxy.stop()
        server.stop()


if __name__ == "__main__":
    main()
