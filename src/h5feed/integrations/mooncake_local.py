"""A Mooncake master on this machine's loopback, a producer that puts samples into it as vLLM does, a vLLM stand-in.

Why: the ``h5feed-tap`` backend takes hidden states that vLLM's hs-connectors `MooncakeHiddenStatesConnector`
puts into a Mooncake store.  Trying it, testing it and measuring it need no GPU and no vLLM: a master on
127.0.0.1 (``mooncake_master``, shipped by ``pip install mooncake-transfer-engine-non-cuda``, over TCP) and a
client putting each sample as that connector does (one object per sample, laid out by hs-connectors'
`packed_layout`, put by its `MooncakeHiddenStatesStore.put_sample`) stand in for the inference server.  The
manifest `put` returns is what vLLM answers the trainer's request with (its ``kv_transfer_params``), and
`VllmStandIn` answers speculators' requests so (``python -m h5feed.integrations.mooncake_local DATA`` runs both).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import threading
import time
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch
from hs_connectors.mooncake_store import VERSION, MooncakeHiddenStatesStore, MooncakeStoreConfig, packed_layout

from h5feed.errors import H5feedError

MASTER_COMMAND = "mooncake_master"
INSTALL_HINT = "pip install mooncake-transfer-engine-non-cuda (or the CUDA build, mooncake-transfer-engine)"


def free_port() -> int:
    """A TCP port of 127.0.0.1 that no one listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_answers(address: str, timeout_s: float = 2.0) -> str | None:
    """None when a server accepts TCP connections at `address` ("HOST:PORT"), else why not ("connection refused").
    Said before hs-connectors' own setup, which spends 90 s retrying an absent master, then reports a status code."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return f"{address!r} is not HOST:PORT"
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


class LocalMaster:
    """``mooncake_master`` listening on 127.0.0.1 (a free port), its metrics server too, until `stop()`.

    `with LocalMaster() as master: ... master.address` ("127.0.0.1:PORT") is what ``--mooncake-master`` takes."""

    def __init__(self, log_path: str | Path | None = None, start_timeout_s: float = 30.0) -> None:
        command = shutil.which(MASTER_COMMAND)
        if command is None:
            raise H5feedError(f"{MASTER_COMMAND} is not on PATH: {INSTALL_HINT}")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._log: IO[bytes] | None = open(log_path, "wb") if log_path else None  # noqa: SIM115 (closed by stop)
        self.process = subprocess.Popen(
            [command, "--rpc_address=127.0.0.1", f"--rpc_port={self.port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={free_port()}", "--enable_metric_reporting=false"],
            stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout_s
        while master_answers(self.address, timeout_s=0.2) is not None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise H5feedError(f"{MASTER_COMMAND} did not start on {self.address}"
                                  + (f" (its log: {log_path})" if log_path else ""))
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the master (SIGTERM, then SIGKILL after 10 s); the objects it knew of are gone with it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LocalMaster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()


@dataclass(frozen=True)
class ProducerOptions:
    """The producer's Mooncake client: the memory it lends the store (where objects it puts may live)."""

    global_segment_bytes: int = 256 << 20
    local_buffer_bytes: int = 64 << 20


class MooncakeProducer:
    """Puts samples into a Mooncake store as vLLM's `MooncakeHiddenStatesConnector` does, with hs-connectors' code.

    The objects live in the memory of the Mooncake clients (this one's among them): keep the producer until the
    trainer has read what it put."""

    def __init__(self, master_address: str, options: ProducerOptions = ProducerOptions()) -> None:
        self.store = MooncakeHiddenStatesStore(MooncakeStoreConfig(
            local_hostname="127.0.0.1", master_server_address=master_address,
            global_segment_size=options.global_segment_bytes, local_buffer_size=options.local_buffer_bytes,
        )).setup()

    def put(self, handle: str, hidden_states: torch.Tensor, token_ids: torch.Tensor) -> dict[str, Any]:
        """Put one sample ([T, K+1, H] hidden states, [T] token ids) under `handle`; return its transfer manifest,
        the ``kv_transfer_params`` vLLM returns with the request (the connector's `request_finished` builds it so)."""
        tensors = {"hidden_states": hidden_states, "token_ids": token_ids}
        specs, total = packed_layout({name: (list(t.shape), t.dtype) for name, t in tensors.items()})
        manifest = {"handle": handle, "version": VERSION, "tensors": specs,
                    "metadata": {"num_tokens": int(token_ids.numel()), "total_aligned_bytes": total,
                                 "extract_mode": "prompt_only"}}
        self.store.put_sample(manifest, tensors)
        return manifest


class VllmStandIn:
    """Answers speculators' hidden-state requests as ``vllm serve`` with the MooncakeHiddenStatesConnector does, on
    127.0.0.1: for a prompt equal to a row's ``input_ids`` of speculators' data folder `data`, it puts that row's
    ``hidden_states/hs_{i}.safetensors`` (what the `file` backend reads, standing for the verifier's output) into
    Mooncake and returns its manifest as the response's ``kv_transfer_params``.  `generated` counts the samples put
    for each row (GET /stats gives them too): what a verifier would have had to compute."""

    def __init__(self, data: str | Path, producer: MooncakeProducer, port: int | None = None,
                 model: str = "verifier") -> None:
        from http.server import ThreadingHTTPServer

        from hs_connectors.transfer import FileTransfer

        from h5feed.formats.speculators_safetensors import ArrowRows

        self.rows, self.files = ArrowRows.of(Path(data).resolve()), FileTransfer(Path(data) / "hidden_states")
        self.producer, self.model = producer, model
        self.generated: dict[int, int] = {}
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", port or free_port()), _handler(self))
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="vllm-stand-in")
        self._thread.start()

    def complete(self, prompt: list[int]) -> dict[str, Any]:
        """The Completion vLLM returns for a 1-token request on `prompt`, its sample put into Mooncake first."""
        token_ids = torch.tensor(prompt, dtype=torch.int64)
        rows = self.rows.rows_with_input_ids(self.rows.root, token_ids)
        if not rows:
            raise KeyError(f"no row of {self.rows.root} has these {len(prompt)} input_ids")
        sample = self.files.get_cached(rows[0])
        with self._lock:
            number = sum(self.generated.values())
            self.generated[rows[0]] = self.generated.get(rows[0], 0) + 1
            manifest = self.producer.put(f"cmpl-{number}-0", sample["hidden_states"], sample["token_ids"])
        return {"id": f"cmpl-{number}", "object": "text_completion", "created": 0, "model": self.model,
                "choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None,
                             "prompt_token_ids": prompt}],
                "kv_transfer_params": manifest}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(stand_in: VllmStandIn) -> type:
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/").endswith("/models"):
                self._answer(200, {"object": "list", "data": [{"id": stand_in.model, "object": "model",
                                                               "created": 0, "owned_by": "h5feed"}]})
            elif self.path.rstrip("/").endswith("/stats"):
                self._answer(200, {"generated": stand_in.generated})
            else:
                self._answer(404, {"error": f"no {self.path} here"})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if not self.path.rstrip("/").endswith("/completions") or not isinstance(body.get("prompt"), list):
                self._answer(400, {"error": "a completion of a prompt of token ids is all this stand-in answers"})
                return
            try:
                self._answer(200, stand_in.complete(body["prompt"]))
            except KeyError as exc:
                self._answer(400, {"error": str(exc)})

        def _answer(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            """Quiet: one line per request would drown the trainer's output."""

    return Handler


def main(argv: list[str] | None = None) -> None:
    """`python -m h5feed.integrations.mooncake_local DATA`: a Mooncake master and a vLLM stand-in serving DATA's hidden
    states through it, on 127.0.0.1, until interrupted: the trainer side of the tap, tried with no GPU and no vLLM."""
    parser = argparse.ArgumentParser(prog="python -m h5feed.integrations.mooncake_local", description=main.__doc__)
    parser.add_argument("data", help="speculators' data folder: its Arrow dataset and hidden_states/hs_{i}.safetensors")
    parser.add_argument("--port", type=int, default=8000, help="the stand-in's port (default 8000)")
    parser.add_argument("--model", default="verifier", help="the model name it answers to (--verifier-name-or-path)")
    parser.add_argument("--master", default=None, help="a Mooncake master's HOST:PORT to put into (default: start "
                                                       "one on 127.0.0.1, stopped with this command)")
    args = parser.parse_args(argv)
    with ExitStack() as stack:
        address = args.master or stack.enter_context(LocalMaster()).address
        stand_in = VllmStandIn(args.data, MooncakeProducer(address), args.port, args.model)
        stack.callback(stand_in.stop)
        print(f"mooncake master {address}; vLLM stand-in {stand_in.endpoint}: train with "
              f"--hidden-states-backend h5feed-tap --mooncake-master {address} "
              f"--vllm-endpoint {stand_in.endpoint} (MOONCAKE_LOCAL_HOSTNAME=127.0.0.1)", flush=True)
        with suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
