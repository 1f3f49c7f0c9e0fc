"""Start and stop the real server process for tests, on ports the OS chose."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1 import control_pb2, control_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_MODELS = Path(os.environ.get("PADDLEQUIC_TEST_MODELS", REPO_ROOT / "models"))
START_TIMEOUT_S = 180.0
# How often a starting server is asked whether it is ready: each of the suite's hundreds of
# starts waits half of it on average past the moment the server is.
READY_POLL_S = 0.05
STOP_TIMEOUT_S = 30.0
# Starts on a fresh port after losing the port free_port chose to another process.
PORT_RACE_ATTEMPTS = 3
# In a server's extra args: a free port for its REST API, chosen again with the gRPC port's
# when another process took it before the server bound it (ServerProcess.http_port).
HTTP_PORT = "{free http port}"
# The same for its metrics port (ServerProcess.metrics_port).
METRICS_PORT = "{free metrics port}"


def free_port() -> int:
    """A port free on both TCP and UDP (the server uses the same number for both)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind(("127.0.0.1", 0))
            port = int(tcp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    raise RuntimeError("no port free on both TCP and UDP")


def client_args(server: ServerProcess, certs_dir: Path, transport: str) -> dict[str, Any]:
    """The clients' keyword arguments (url, ca_file) that reach `server` over h2 or h3."""
    if transport == "h3":
        return {"url": f"h3://localhost:{server.port}", "ca_file": str(certs_dir / "ca.pem")}
    return {"url": server.url}


def children(pid: int) -> dict[int, str]:
    """The processes `pid` started, with their command lines."""
    found: dict[int, str] = {}
    listed = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in map(int, listed):
        try:
            found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except FileNotFoundError:
            continue  # it just exited
    return found


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid` (workers run under launchers), with its command line."""
    found: dict[int, str] = {}
    for child, command in children(pid).items():
        found[child] = command
        found |= descendants(child)
    return found


def refused_start(args: Sequence[str], timeout_s: float = 120.0) -> str:
    """What the server printed on stderr when it refused to start with `args` (it must exit 1,
    never serve)."""
    started = subprocess.run(
        [sys.executable, "-m", "service.server", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert started.returncode == 1, (started.returncode, started.stderr[-2000:])
    return started.stderr


def model_repository(target: Path, names: Sequence[str]) -> Path:
    """A repository holding some of the example models (symlinked, nothing copied)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        source = EXAMPLE_MODELS / name
        if not source.is_dir():
            raise RuntimeError(f"example model {source} is missing; run `make models`")
        (target / name).symlink_to(source)
    return target


# An ensemble of two steps on the example mlp (its newest version, and version 1), `out` the
# mlp's output; every step a version front-ends queue for, so they run it themselves too.
TWICE = """
name: "twice"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "x", data_type: TYPE_FP32, dims: [ 256 ] }} ]
output [
  {{ name: "a", data_type: TYPE_FP32, dims: [ 10 ] }},
  {{ name: "b", data_type: TYPE_FP32, dims: [ 10 ] }}
]
ensemble_scheduling {{ step [
  {{ model_name: "mlp" model_version: -1
    input_map {{ key: "input" value: "x" }} output_map {{ key: "{out}" value: "a" }} }},
  {{ model_name: "mlp" model_version: 1
    input_map {{ key: "input" value: "x" }} output_map {{ key: "{out}" value: "b" }} }}
] }}
"""


def twice_ensemble(repository: Path, mlp_output: str) -> None:
    """The `twice` ensemble added to a repository serving mlp."""
    (repository / "twice").mkdir()
    (repository / "twice" / "config.pbtxt").write_text(TWICE.format(out=mlp_output))


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON lines of a server's log, whole ones only: the server may be writing the last
    while a test reads the file (CI at eac2339 parsed half a line)."""
    whole = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in whole.splitlines() if line.startswith("{")]


class ServerProcess:
    def __init__(
        self,
        repository: Path,
        log_path: Path,
        extra_args: Sequence[str] = (),
        port: int | None = None,
        new_session: bool = False,
    ) -> None:
        """`port`: listen there (e.g. to restart a server where clients expect it); default
        a free one. `new_session`: in a process group of its own, which a test may signal
        whole (as a terminal or a supervisor does)."""
        self._new_session = new_session
        self._repository = repository
        self._extra_args = tuple(extra_args)
        self._port_chosen_here = port is None
        self._start_attempts = 1
        self.log_path = log_path
        self._start(free_port() if port is None else port)

    def _start(self, port: int) -> None:
        self.port = port
        self.http_port = free_port() if HTTP_PORT in self._extra_args else 0
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self.metrics_port = free_port() if METRICS_PORT in self._extra_args else 0
        chosen = {HTTP_PORT: str(self.http_port), METRICS_PORT: str(self.metrics_port)}
        extra = [chosen.get(a, a) for a in self._extra_args]
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"grpc://{self.address}"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "service.server",
                "--host",
                "127.0.0.1",
                "--grpc-port",
                str(self.port),
                "--model-repository",
                str(self._repository),
                # Servers run side by side in tests: metrics on any free port unless asked.
                "--metrics-port",
                "0",
                # REST off unless a test asks for it (--http-port PORT in extra_args wins).
                "--http-port",
                "0",
                *extra,
            ],
            cwd=REPO_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=self._new_session,
        )
        self.channel = grpc.insecure_channel(
            self.address,
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
                # A server still starting refuses the first connects: grpc would wait 1 s, then
                # 1.6 s, ... before trying again, seconds per start across hundreds of servers.
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 500),
            ],
        )
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.control = control_pb2_grpc.ControlStub(self.channel)

    def exited(self) -> None:
        """The server exited while starting. free_port's number can be taken by another
        process (any UDP socket bound to port 0) before the server binds it: on ports chosen
        here (the gRPC port, HTTP_PORT, METRICS_PORT), start again on others; otherwise say
        why it exited."""
        log = self.log_text()
        if (
            (self._port_chosen_here or self.http_port or self.metrics_port)
            and "Address already in use" in log
            and self._start_attempts < PORT_RACE_ATTEMPTS
        ):
            self._start_attempts += 1
            self.channel.close()
            self._log.close()
            self._start(free_port() if self._port_chosen_here else self.port)
            return
        raise RuntimeError(f"server exited ({self.process.returncode}):\n{log}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_objects(self) -> list[dict[str, Any]]:
        """The JSON lines of its log (log records, spans), whole ones: json_lines."""
        return json_lines(self.log_text())

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.exited()
                continue
            with contextlib.suppress(grpc.RpcError):
                if self.stub.ServerReady(pb.ServerReadyRequest(), timeout=1).ready:
                    return
            time.sleep(READY_POLL_S)
        raise RuntimeError(f"server not ready after {START_TIMEOUT_S} s:\n{self.log_text()}")

    def wait_loaded(self) -> None:
        """Until every model has finished loading, whether it succeeded or not (ServerReady
        stays false while any failed)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.exited()
                continue
            with contextlib.suppress(grpc.RpcError):
                index = self.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=1).models
                if index and all(m.state != "LOADING" for m in index):
                    return
            time.sleep(READY_POLL_S)
        raise RuntimeError(f"models still loading after {START_TIMEOUT_S} s:\n{self.log_text()}")

    def metrics(self) -> list[Sample]:
        """Every sample /metrics shows now."""
        families = text_string_to_metric_families(self.metrics_text())
        return [s for family in families for s in family.samples]

    def metrics_text(self) -> str:
        """What /metrics answers now, in the Prometheus text format (its URL is in the log)."""
        url = re.search(r"metrics on (http://\S+/metrics)", self.log_text())
        assert url is not None, "the server logs no metrics URL"
        with urllib.request.urlopen(url.group(1), timeout=10) as response:
            return str(response.read().decode())

    def instances(self, model: str) -> list[control_pb2.Instance]:
        request = control_pb2.ListInstancesRequest(model_name=model)
        return list(self.control.ListInstances(request, timeout=5).instances)

    def stop(self) -> int:
        """SIGTERM, as a supervisor stops it. A server still running 30 s later is killed and
        the test fails: its stop hangs (a version winding down to its timeout hid so once)."""
        self.channel.close()
        hung = False
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                hung = True
                self.process.kill()
                self.process.wait()
        self._log.close()
        assert not hung, f"still running {STOP_TIMEOUT_S} s after SIGTERM:\n{self.log_text()}"
        return self.process.returncode


@contextlib.contextmanager
def running_server(
    repository: Path,
    log_path: Path,
    extra_args: Sequence[str] = (),
    port: int | None = None,
    wait: bool = True,
) -> Iterator[ServerProcess]:
    """`wait=False`: return once it started; the test waits for what it needs."""
    server = ServerProcess(repository, log_path, extra_args, port)
    try:
        if wait:
            server.wait_ready()
        yield server
    finally:
        server.stop()


def wait_logged(server: ServerProcess, text: str, limit_s: float = START_TIMEOUT_S) -> None:
    """Until the server's log holds `text` (bounded); it must not exit meanwhile."""
    deadline = time.monotonic() + limit_s
    while text not in server.log_text():
        assert server.process.poll() is None, server.log_text()
        assert time.monotonic() < deadline, server.log_text()
        time.sleep(0.01)


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """Hold the worker still so the queue fills deterministically, whatever the machine."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        # A test that killed the worker meanwhile: once the server reaped it there is nothing
        # to continue (the failure here used to end the test before the worker's restart, and
        # the next test paused and killed the worker while it was starting).
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def wait_arrived(server: ServerProcess, model: str, count: int) -> None:
    """Until the server holds all `count` requests: queued, or in batches given to the
    (paused) worker. Whatever split that is, some batch then holds more than one request."""
    deadline = time.monotonic() + 60
    request = control_pb2.ListInstancesRequest(model_name=model)
    while time.monotonic() < deadline:
        queues = server.control.ListInstances(request, timeout=5).queues
        if sum(q.queued + q.in_flight for q in queues) >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"the server never held all {count} requests for {model}")


async def gather_held(
    server: ServerProcess,
    model: str,
    calls: Sequence[Awaitable[Any]],
    return_exceptions: bool = False,
) -> list[Any]:
    """Every call started while the model's one worker is stopped, and the worker resumed once
    the server holds them all: the calls meet in batches, however fast the machine is."""
    (instance,) = server.instances(model)
    with paused(instance.pid):
        gathered = asyncio.gather(*calls, return_exceptions=return_exceptions)
        await asyncio.get_running_loop().run_in_executor(
            None, wait_arrived, server, model, len(calls)
        )
    return list(await gathered)


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def eventually(check: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Until `check()` holds, failing with `what` after `limit_s` (a restart that loads Paddle
    again on a busy 2-core machine can take a minute)."""
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"never happened within {limit_s:g} s: {what}"
        time.sleep(0.05)


async def held_still(read: Callable[[], float], looks: int, limit_s: float) -> float:
    """`read()`'s value once it held still for `looks` reads in a row: a counter that stopped
    moving, counted in reads rather than timed; `read` runs in a thread (it may block)."""
    last, quiet = -1.0, 0
    async with asyncio.timeout(limit_s):
        while quiet < looks:
            now = await asyncio.to_thread(read)
            quiet = quiet + 1 if now == last else 0
            last = now
            await asyncio.sleep(0.02)
    return last


def closed_by_peer(connection: socket.socket, limit_s: float) -> bool:
    """Whether the other end closed the connection within `limit_s` (a bound on the wait;
    0: only whether it has already)."""
    connection.settimeout(limit_s)
    try:
        return connection.recv(1) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except ConnectionResetError:
        return True


async def stream_closed_by_peer(reader: asyncio.StreamReader, limit_s: float) -> bool:
    """closed_by_peer for an asyncio stream."""
    try:
        async with asyncio.timeout(limit_s):
            return await reader.read(1) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True
