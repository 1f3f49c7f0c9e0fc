"""`make bench-rtt`: time from a new connection to the first ModelInfer response over a slow link.

The kernel here has no netem qdisc, so the link is built in user space: two network namespaces
(server, client), a TUN device in each, and a forwarder process that copies every packet from one
TUN to the other after a fixed one-way delay. TCP and QUIC cross the same link, so both see the
same RTT (2 x delay) and the difference between them is round trips and CPU, nothing else.

The lab (this process) stays in the root namespace and only orchestrates: the real server runs in
the server namespace, and the clients run as `python -m scripts.rtt_lab client ...` in the client
namespace and print their samples as JSON. Modes, each a NEW connection per repetition:

- h2-tls:  grpc.aio over TCP + TLS 1.3: TCP handshake, TLS handshake, then grpc core waits for
           the server's HTTP/2 SETTINGS frame before it sends anything (Chttp2Connector reports
           the connection only once they came), then the request: 4 RTT, not the 3 that a
           client sending its request right behind its TLS Finished would need
- h3-full: QuicChannel, full QUIC handshake, then the request (2 RTT)
- h3-0rtt: QuicChannel resuming with a session ticket, request sent as 0-RTT data (1 RTT)
- h3-0rtt-no-token: the same, from a client that drops the server's NEW_TOKEN tokens

Then, unless --no-retry-rows, a second server with `--h3-retry always`: "retry 0rtt" is
h3-0rtt-no-token there (every connection pays the Retry's round trip), "retry 0rtt+token"
h3-0rtt (the NEW_TOKEN token of the previous connection spares it).

Add the CPU time of handshakes and of the call itself, which does not grow with the RTT: the
table ends with a least-squares fit, median = k x RTT + c, whose k counts the round trips.

This module is also the forwarder's entry point (`... forward`): it imports only the standard
library at the top so that process starts fast and stays small; the client code imports grpc,
numpy and the stubs where it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import concurrent.futures
import contextlib
import ctypes
import fcntl
import json
import os
import re
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar

if TYPE_CHECKING:
    from protos.inference import grpc_service_pb2 as pb

REPO_ROOT = Path(__file__).resolve().parents[1]
# RFC 2544 benchmarking range: never routed, never clashes with the host's private networks.
SERVER_IP = "198.18.0.1"
CLIENT_IP = "198.18.0.2"
PREFIX_LENGTH = 30
MTU = 1500
TUN_NAME = "pqlab0"
NETNS_DIR = Path("/var/run/netns")
SERVER_PORT = 8001
SERVER_NAME = "localhost"  # in the dev certificate's SANs; 198.18.0.1 is not
MODES = ("h2-tls", "h3-full", "h3-0rtt", "h3-0rtt-no-token")
DEFAULT_MODES = ("h2-tls", "h3-full", "h3-0rtt")
RETRY_ROWS = {"h3-0rtt-no-token": "retry 0rtt", "h3-0rtt": "retry 0rtt+token"}
CALL_TIMEOUT_S = 30.0
UDP_DROP = "udp drop"  # the forwarder's control lines besides delays
UDP_PASS = "udp pass"
START_TIMEOUT_S = 180.0

_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_ICMP_ECHO_REQUEST = 8
_ICMP_ECHO_REPLY = 0
_libc = ctypes.CDLL(None, use_errno=True)

Side = Literal["server", "client"]
T = TypeVar("T")


# --- namespaces -----------------------------------------------------------------------------


def _ip(*args: str) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result.stdout


def run_in_namespace(namespace: str, fn: Callable[[], T]) -> T:
    """`fn()` in a short-lived thread that joined `namespace`. setns() moves only the calling
    thread (Python 3.11 has no os.setns), so the rest of the process stays in the root
    namespace, while what `fn` creates (a socket, a TUN device) belongs to `namespace` for good."""

    def enter_and_run() -> T:
        fd = os.open(NETNS_DIR / namespace, os.O_RDONLY)
        try:
            if _libc.setns(fd, _CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"setns({namespace}): {os.strerror(errno)}")
        finally:
            os.close(fd)
        return fn()

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="netns") as pool:
        return pool.submit(enter_and_run).result()


def _open_tun() -> int:
    """A TUN device in the calling thread's namespace; it disappears when the fd is closed."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(
            fd, _TUNSETIFF, struct.pack("16sH22x", TUN_NAME.encode(), _IFF_TUN | _IFF_NO_PI)
        )
    except OSError:
        os.close(fd)
        raise
    return fd


def _delete_namespace(namespace: str) -> None:
    """Kills what still runs in the namespace (a server the lab started and could not stop),
    since a process keeps a namespace alive after `ip netns del`, then deletes it."""
    with contextlib.suppress(RuntimeError):
        for pid in _ip("netns", "pids", namespace).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(RuntimeError):
        _ip("netns", "del", namespace)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def remove_stale_namespaces(prefix: str) -> list[str]:
    """Deletes `prefix` namespaces whose owning process (its pid is in the name) is gone: what a
    crashed or killed run left. A live owner's namespaces are another run's, and are kept."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-[a-z]+$")
    removed = []
    for entry in sorted(NETNS_DIR.iterdir()) if NETNS_DIR.is_dir() else []:
        match = pattern.match(entry.name)
        if match and not _alive(int(match.group(1))):
            _delete_namespace(entry.name)
            removed.append(entry.name)
    return removed


def _checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) an ICMP header needs."""
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


class Namespaces:
    """Network namespaces made for one run (named PREFIX-PID-ROLE): created on entry, after the
    ones a dead run left behind are removed, and deleted on exit, on an error and at interpreter
    exit (atexit). Subclasses connect them in `_connect` and undo it in `_disconnect`."""

    def __init__(self, prefix: str, roles: Sequence[str]) -> None:
        self.prefix = prefix
        self.namespaces = {role: f"{prefix}-{os.getpid()}-{role}" for role in roles}
        self._created: list[str] = []

    def __enter__(self) -> Self:
        atexit.register(self.close)
        try:
            for name in remove_stale_namespaces(self.prefix):
                print(f"removed namespace {name} left by a run that is gone", file=sys.stderr)
            for namespace in self.namespaces.values():
                _ip("netns", "add", namespace)
                self._created.append(namespace)
            self._connect()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _connect(self) -> None:
        """Join the namespaces (they exist)."""

    def _disconnect(self) -> None:
        """Undo what `_connect` started outside the namespaces."""

    def close(self) -> None:
        """Idempotent: the context manager, an error path and atexit may all call it."""
        atexit.unregister(self.close)
        self._disconnect()
        while self._created:
            _delete_namespace(self._created.pop())


class Link(Namespaces):
    """Two namespaces joined by a delayed point-to-point link, server 198.18.0.1 and client
    198.18.0.2 (each on a TUN device, MTU 1500, plus `lo`), and the forwarder between them:
    every packet, either way, arrives `one_way_delay_ms` after it was sent, in order, none lost.

    Cleans up on exit, on an exception, and at interpreter exit (atexit): the forwarder is
    stopped, which removes the TUN devices, and both namespaces are deleted. Should the owner die
    by SIGKILL, the forwarder exits when its control pipe closes, and the next Link with the same
    prefix deletes the namespaces left behind.
    """

    def __init__(self, one_way_delay_ms: float, prefix: str = "pqlab") -> None:
        super().__init__(prefix, ("server", "client"))
        self.delay_ms = one_way_delay_ms
        self._forwarder: subprocess.Popen[bytes] | None = None

    def _connect(self) -> None:
        fds: dict[Side, int] = {}
        try:
            addresses: dict[Side, str] = {"server": SERVER_IP, "client": CLIENT_IP}
            for side in addresses:
                namespace = self.namespaces[side]
                fds[side] = run_in_namespace(namespace, _open_tun)
                address = f"{addresses[side]}/{PREFIX_LENGTH}"
                _ip("-n", namespace, "link", "set", "lo", "up")
                _ip("-n", namespace, *f"addr add {address} dev {TUN_NAME}".split())
                # No IPv6 link-local address: the link carries the lab's traffic and nothing
                # else (no router solicitations, no MLD reports).
                _ip("-n", namespace, *f"link set {TUN_NAME} mtu {MTU} addrgenmode none up".split())
            # Both devices are up before anything forwards: writing to a TUN device that is
            # down fails (EIO). What they send meanwhile waits in their queues.
            self._forwarder = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "scripts.rtt_lab",
                    "forward",
                    f"--server-fd={fds['server']}",
                    f"--client-fd={fds['client']}",
                    f"--delay-ms={self.delay_ms}",
                ],
                cwd=REPO_ROOT,
                pass_fds=tuple(fds.values()),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                # Terminal signals go to the lab alone, which then stops the forwarder itself.
                start_new_session=True,
            )
        finally:
            for fd in fds.values():
                os.close(fd)  # the forwarder holds the devices now
        self._await_ack()

    def _await_ack(self) -> None:
        assert self._forwarder is not None and self._forwarder.stdout is not None
        if self._forwarder.stdout.readline() != b"ok\n":
            raise RuntimeError(f"the link forwarder exited ({self._forwarder.wait()})")

    def set_delay(self, one_way_delay_ms: float) -> None:
        """Packets already in flight keep their delay; later ones never overtake them."""
        self._control(f"{one_way_delay_ms}")
        self.delay_ms = one_way_delay_ms

    def block_udp(self, blocked: bool) -> None:
        """Drop every UDP packet read from now on, both ways (as a firewall that lets only TCP
        through does), or carry them again."""
        self._control(UDP_DROP if blocked else UDP_PASS)

    def _control(self, line: str) -> None:
        assert self._forwarder is not None and self._forwarder.stdin is not None
        self._forwarder.stdin.write(f"{line}\n".encode())
        self._forwarder.stdin.flush()
        self._await_ack()

    def exec_prefix(self, side: Side) -> list[str]:
        """The argv prefix that runs a command in one side's namespace."""
        return ["ip", "netns", "exec", self.namespaces[side]]

    def open_socket(
        self, side: Side, kind: int = socket.SOCK_STREAM, proto: int = 0
    ) -> socket.socket:
        """An IPv4 socket that lives in one side's namespace, for in-process tests and checks."""
        return run_in_namespace(
            self.namespaces[side], lambda: socket.socket(socket.AF_INET, kind, proto)
        )

    def ping(self, count: int = 3) -> list[float]:
        """Round-trip times (ms) of ICMP echoes from the client to the server address, as
        `ping` shows them: the server's kernel answers, and iputils need not be installed."""
        ident = os.getpid() & 0xFFFF
        payload = b"paddlequic-rtt-lab-" * 3
        rtts = []
        with self.open_socket("client", socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
            sock.settimeout(max(2.0, self.delay_ms * 10 / 1e3))
            for seq in range(count):
                header = struct.pack("!BBHHH", _ICMP_ECHO_REQUEST, 0, 0, ident, seq)
                checksum = _checksum(header + payload)
                packet = struct.pack("!BBHHH", _ICMP_ECHO_REQUEST, 0, checksum, ident, seq)
                start = time.perf_counter()
                sock.sendto(packet + payload, (SERVER_IP, 0))
                while True:
                    reply = sock.recv(4096)
                    icmp = reply[(reply[0] & 0x0F) * 4 :]  # a raw socket gets the IP header too
                    kind, _, _, reply_ident, reply_seq = struct.unpack("!BBHHH", icmp[:8])
                    if (kind, reply_ident, reply_seq) == (_ICMP_ECHO_REPLY, ident, seq):
                        break
                rtts.append((time.perf_counter() - start) * 1e3)
        return rtts

    def _disconnect(self) -> None:
        if self._forwarder is not None:
            _stop(self._forwarder)
            self._forwarder = None


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.stdin is not None:
        process.stdin.close()  # the forwarder exits on EOF
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout is not None:
        process.stdout.close()


# --- the forwarder --------------------------------------------------------------------------


def forward(server_fd: int, client_fd: int, delay_ms: float) -> None:
    """Copies packets between the two TUN devices, each released `delay_ms` after it was read.

    One FIFO per direction, released only from its head: since packets never overtake each other
    there is nothing to reorder, even right after the delay changes. Control comes on stdin, one
    new delay (ms) or UDP_DROP / UDP_PASS per line, each acknowledged with "ok" on stdout; EOF
    there (the lab closed it, or died) ends the forwarder.
    """
    control = sys.stdin.fileno()
    for fd in (server_fd, client_fd):
        os.set_blocking(fd, False)
    peer = {server_fd: client_fd, client_fd: server_fd}
    outgoing: dict[int, deque[tuple[float, bytes]]] = {server_fd: deque(), client_fd: deque()}
    pending = b""
    delay_s = delay_ms / 1e3
    drop_udp = False
    _acknowledge()
    while True:
        now = time.monotonic()
        timeout: float | None = None
        for fd, queue in outgoing.items():
            while queue and queue[0][0] <= now:
                os.write(fd, queue.popleft()[1])
            if queue:
                wait = queue[0][0] - now
                timeout = wait if timeout is None else min(timeout, wait)
        # select() rather than poll(): its timeout has microsecond resolution, poll()'s is 1 ms.
        readable, _, _ = select.select([server_fd, client_fd, control], [], [], timeout)
        for fd in readable:
            if fd == control:
                data = os.read(control, 4096)
                if not data:
                    return
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if line.decode() in (UDP_DROP, UDP_PASS):
                        drop_udp = line.decode() == UDP_DROP
                    else:
                        delay_s = float(line) / 1e3
                    _acknowledge()
                continue
            queue = outgoing[peer[fd]]
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if not (drop_udp and _is_udp(packet)):
                    queue.append((time.monotonic() + delay_s, packet))


def _is_udp(packet: bytes) -> bool:
    """An IPv4 or IPv6 packet (as a TUN device without packet info gives it) carrying UDP."""
    version = packet[0] >> 4 if packet else 0
    return (version == 4 and packet[9:10] == b"\x11") or (version == 6 and packet[6:7] == b"\x11")


def _acknowledge() -> None:
    os.write(sys.stdout.fileno(), b"ok\n")


def _forward_main(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    # The server and the clients keep both CPUs busy during handshakes; a real-time priority
    # keeps the forwarder's wake-ups on time, so the link adds its delay and not the scheduler's.
    # It sleeps between packets, so it takes little from them.
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except OSError as exc:
        print(f"forwarder: no real-time priority ({exc}); delays may jitter", file=sys.stderr)
    forward(args.server_fd, args.client_fd, args.delay_ms)
    return 0


# --- the clients (run in the client namespace) ----------------------------------------------


@dataclass
class Sample:
    first_response_ms: float  # new channel to first ModelInfer response
    warm_call_ms: float  # a second ModelInfer on that connection: 1 RTT + service time
    connect_mode: str | None  # QuicChannel.last_connect_mode: full, 0rtt-accepted, ...


def _request() -> pb.ModelInferRequest:
    import numpy as np

    from clients.inference_client import build_request

    return build_request("mlp", {"input": np.ones((1, 256), np.float32)})


def _h2_channel(target: str, ca_file: str) -> Any:
    import grpc

    credentials = grpc.ssl_channel_credentials(Path(ca_file).read_bytes())
    options = [
        ("grpc.ssl_target_name_override", SERVER_NAME),
        # grpc shares connections between the channels of a process by default: with another
        # channel to the server open, a "new" one would reuse its connection.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    return grpc.aio.secure_channel(target, credentials, options=options)


async def _timed(open_channel: Callable[[], Any], request: pb.ModelInferRequest) -> Sample:
    from protos.inference import grpc_service_pb2_grpc as pb_grpc

    start = time.perf_counter()
    channel = open_channel()
    try:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await stub.ModelInfer(request, timeout=CALL_TIMEOUT_S)
        first = time.perf_counter() - start
        start = time.perf_counter()
        await stub.ModelInfer(request, timeout=CALL_TIMEOUT_S)
        warm = time.perf_counter() - start
        connect_mode = getattr(channel, "last_connect_mode", None)  # grpc channels: none
    finally:
        # QuicChannel.close waits briefly for the session ticket the next repetition resumes
        # with; neither close is timed.
        await channel.close()
    return Sample(first * 1e3, warm * 1e3, connect_mode)


def _opener(mode: str, target: str, ca_file: str) -> Callable[[], Any]:
    """What opens a new channel for `mode`."""
    if mode == "h2-tls":
        return lambda: _h2_channel(target, ca_file)
    from clients.quic_channel import QuicChannel
    from clients.tickets import SessionTicketCache

    class TicketsOnly(SessionTicketCache):
        """A client that keeps no NEW_TOKEN token (as every client did before the server sent
        them)."""

        def add_token(self, key: str, token: bytes) -> None:
            pass

    # h3-0rtt: one cache for every repetition; each resumed connection leaves in it the fresh
    # ticket (and token) the next one resumes with.
    caches = {"h3-0rtt": SessionTicketCache, "h3-0rtt-no-token": TicketsOnly}
    cache = caches[mode]() if mode in caches else None
    return lambda: QuicChannel(target, ca_file=ca_file, server_name=SERVER_NAME, ticket_cache=cache)


async def _measure(
    modes: Sequence[str], target: str, ca_file: str, rtt_ms: float, repetitions: int
) -> list[dict[str, Any]]:
    request = _request()
    # Lets the previous connection's teardown (FIN, CONNECTION_CLOSE, server clean-up) finish
    # before the next is timed, so it does not compete for CPU or the link.
    pause = max(0.1, 2 * rtt_ms / 1e3)
    results: list[dict[str, Any]] = []
    for mode in modes:
        opener = _opener(mode, target, ca_file)
        # Untimed: first use of the code paths; for h3-0rtt, also the connection that primes
        # the ticket cache.
        await _timed(opener, request)
        samples = []
        for i in range(repetitions):
            await asyncio.sleep(pause)
            samples.append(await _timed(opener, request))
            print(
                f"\r  RTT {rtt_ms:g} ms  {mode:<8} {i + 1}/{repetitions}",
                end="",
                file=sys.stderr,
                flush=True,
            )
        median = statistics.median(s.first_response_ms for s in samples)
        print(f"  median {median:.1f} ms", file=sys.stderr, flush=True)
        results.append({"mode": mode, "samples": [asdict(s) for s in samples]})
    return results


def _client_main(args: argparse.Namespace) -> int:
    results = asyncio.run(_measure(args.modes, args.target, args.ca, args.rtt_ms, args.repetitions))
    json.dump(results, sys.stdout)
    return 0


async def _wait_ready(target: str, ca_file: str, timeout_s: float) -> None:
    """Polls ServerReady until the model is loaded, then warms it with one ModelInfer so no
    repetition pays for the predictor's first run."""
    import grpc

    from protos.inference import grpc_service_pb2 as pb
    from protos.inference import grpc_service_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if Path(ca_file).exists():  # the server writes its certificates first
            channel = _h2_channel(target, ca_file)
            try:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                with contextlib.suppress(grpc.aio.AioRpcError):
                    if (await stub.ServerReady(pb.ServerReadyRequest(), timeout=2)).ready:
                        await stub.ModelInfer(_request(), timeout=CALL_TIMEOUT_S)
                        return
            finally:
                await channel.close()
        await asyncio.sleep(0.5)
    raise TimeoutError(f"the server at {target} was not ready after {timeout_s:g} s")


def _ready_main(args: argparse.Namespace) -> int:
    asyncio.run(_wait_ready(args.target, args.ca, args.timeout))
    return 0


# --- the lab (root namespace) ---------------------------------------------------------------


@dataclass
class Row:
    mode: str
    rtt_ms: float
    ping_ms: float  # mean ICMP round trip measured just before
    repetitions: int
    median_ms: float
    p90_ms: float
    median_rtts: float  # median as a multiple of the RTT
    p90_rtts: float
    warm_call_median_ms: float
    connect_modes: dict[str, int]
    samples_ms: list[float]


def _row(mode: dict[str, Any], rtt_ms: float, ping_ms: float) -> Row:
    samples = [Sample(**s) for s in mode["samples"]]
    first = [s.first_response_ms for s in samples]
    median = statistics.median(first)
    # The "inclusive" method interpolates like numpy.percentile's default.
    p90 = statistics.quantiles(first, n=10, method="inclusive")[-1] if len(first) > 1 else first[0]
    modes = Counter(s.connect_mode for s in samples if s.connect_mode is not None)
    return Row(
        mode["mode"],
        rtt_ms,
        round(ping_ms, 2),
        len(samples),
        round(median, 2),
        round(p90, 2),
        round(median / rtt_ms, 2),
        round(p90 / rtt_ms, 2),
        round(statistics.median(s.warm_call_ms for s in samples), 2),
        dict(modes),
        [round(v, 2) for v in first],
    )


def check_link(link: Link, rtt_ms: float) -> float:
    """Pings across the link: the RTT must be at least what was set (else packets bypass the
    forwarder) and should not be much more (else the forwarder is late). Returns the mean."""
    rtts = link.ping(3)
    mean = statistics.fmean(rtts)
    print(
        f"link: RTT set {rtt_ms:g} ms, ping min/avg/max "
        f"{min(rtts):.2f}/{mean:.2f}/{max(rtts):.2f} ms",
        flush=True,
    )
    if min(rtts) < rtt_ms:
        raise RuntimeError(f"a ping took {min(rtts):.2f} ms, under the {rtt_ms:g} ms set")
    if mean > rtt_ms + max(2.0, rtt_ms / 10):
        print("warning: the forwarder adds noticeably more delay than set", file=sys.stderr)
    return mean


def _start_server(
    link: Link, tmp: Path, log: Any, server_args: Sequence[str]
) -> subprocess.Popen[bytes]:
    repository = tmp / "models"
    repository.mkdir()
    (repository / "mlp").symlink_to(REPO_ROOT / "models" / "mlp")
    command = [
        sys.executable,
        "-m",
        "service.server",
        "--host",
        SERVER_IP,
        "--grpc-port",
        str(SERVER_PORT),
        "--h2-tls",
        "--certs-dir",
        str(tmp / "certs"),
        "--model-repository",
        str(repository),
        "--log-level",
        "warning",
        *server_args,
    ]
    return subprocess.Popen(
        link.exec_prefix("server") + command,
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _client_command(link: Link, subcommand: str, ca_file: Path, *args: str) -> list[str]:
    return [
        *link.exec_prefix("client"),
        sys.executable,
        "-m",
        "scripts.rtt_lab",
        subcommand,
        f"--target={SERVER_IP}:{SERVER_PORT}",
        f"--ca={ca_file}",
        *args,
    ]


def _wait_server(link: Link, server: subprocess.Popen[bytes], ca_file: Path, log: Path) -> None:
    command = _client_command(link, "ready", ca_file, f"--timeout={START_TIMEOUT_S}")
    wait_until_ready(command, server, "the server", lambda: f":\n{log.read_text()}")


def wait_until_ready(
    command: list[str],
    server: subprocess.Popen[bytes],
    name: str,
    detail: Callable[[], str] = lambda: "",
) -> None:
    """Run `command` (a client that exits 0 once the server answers) while watching the server
    process: a server that exits meanwhile ends the wait at once."""
    with subprocess.Popen(command, cwd=REPO_ROOT) as ready:
        while ready.poll() is None:
            if server.poll() is not None:
                ready.kill()
                raise RuntimeError(f"{name} exited ({server.returncode}){detail()}")
            time.sleep(0.2)
    if ready.returncode != 0:
        raise RuntimeError(f"{name} did not get ready{detail()}")


def run_lab(
    rtts: Sequence[float], repetitions: int, modes: Sequence[str], server_args: Sequence[str] = ()
) -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="rtt-lab-") as name, Link(rtts[0] / 2) as link:
        tmp = Path(name)
        ca_file = tmp / "certs" / "ca.pem"
        log_path = tmp / "server.log"
        check_link(link, rtts[0])
        print("starting the server (mlp only) in the server namespace ...", flush=True)
        with log_path.open("wb") as log:
            server = _start_server(link, tmp, log, server_args)
            try:
                _wait_server(link, server, ca_file, log_path)
                for rtt in rtts:
                    link.set_delay(rtt / 2)
                    ping = check_link(link, rtt)
                    command = _client_command(
                        link,
                        "client",
                        ca_file,
                        f"--rtt-ms={rtt}",
                        f"--repetitions={repetitions}",
                        "--modes",
                        *modes,
                    )
                    out = subprocess.run(
                        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, check=True
                    ).stdout
                    rows += [_row(mode, rtt, ping) for mode in json.loads(out)]
            finally:
                _stop(server)
    return rows


def run_retry_rows(rtts: Sequence[float], repetitions: int) -> list[Row]:
    """0-RTT clients of a server that sends every new connection a Retry, with and without
    the NEW_TOKEN token that spares it."""
    rows = run_lab(rtts, repetitions, list(RETRY_ROWS), ["--h3-retry=always"])
    for row in rows:
        row.mode = RETRY_ROWS[row.mode]
    return rows


def table(rows: Sequence[Row]) -> str:
    rtts = sorted({r.rtt_ms for r in rows})
    cells = {(r.mode, r.rtt_ms): r for r in rows}
    width = max(9, *(len(r.mode) for r in rows))
    lines = [
        f"{'':<{width}}" + "".join(f" | {f'RTT {rtt:g} ms':^22}" for rtt in rtts),
        f"{'mode':<{width}}" + " | median ms  p90 ms  xRTT" * len(rtts),
    ]
    modes = list(dict.fromkeys(r.mode for r in rows))
    for mode in modes:
        measured = (cells[(mode, rtt)] for rtt in rtts)
        lines.append(
            f"{mode:<{width}}"
            + "".join(
                f" | {r.median_ms:>9.1f} {r.p90_ms:>7.1f} {r.median_rtts:>5.2f}" for r in measured
            )
        )
    lines += ["", "second call on the same connection (1 RTT + service time), median ms:"]
    for mode in modes:
        warm = (cells[(mode, rtt)].warm_call_median_ms for rtt in rtts)
        lines.append(f"{mode:<{width}}" + "".join(f" | {w:>22.1f}" for w in warm))
    if len(rtts) > 1:
        # The slope counts the round trips a mode waits for; the intercept is what does not
        # grow with the RTT (CPU: handshakes, serialization, inference).
        lines += ["", "least-squares fit of the medians over the RTTs:"]
        for mode in modes:
            medians = [cells[(mode, rtt)].median_ms for rtt in rtts]
            fit = statistics.linear_regression(rtts, medians)
            lines.append(
                f"{mode:<{width}} first response = {fit.slope:.2f} x RTT + {fit.intercept:.1f} ms"
            )
    return "\n".join(lines)


def _preflight() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (it creates network namespaces and TUN devices): run it with sudo"
    if shutil.which("ip") is None:
        return "needs `ip` (iproute2)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    if not Path("/dev/net/tun").exists():
        return "needs /dev/net/tun"
    if not (REPO_ROOT / "models" / "mlp").is_dir():
        return "the example model models/mlp is missing: run `make models`"
    return None


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so every `finally` stops the server, the
    forwarder and deletes the namespaces."""
    raise SystemExit(128 + signum)


def _lab_main(args: argparse.Namespace) -> int:
    problem = _preflight()
    if problem is not None:
        print(f"rtt_lab: {problem}", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
    try:
        rows = run_lab(args.rtts, args.repetitions, args.modes, args.server_arg)
        if args.retry_rows:
            rows += run_retry_rows(args.rtts, args.repetitions)
    except KeyboardInterrupt:
        print("\nrtt_lab: interrupted; server, forwarder and namespaces are gone", file=sys.stderr)
        return 130
    print()
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rtts", type=float, nargs="+", default=[20.0, 50.0, 100.0], help="ms")
    parser.add_argument("--repetitions", type=int, default=20, help="new connections per mode")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES))
    parser.add_argument(
        "--retry-rows",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also 0-RTT with and without NEW_TOKEN under --h3-retry always (a second server)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/rtt.json"))
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="a server flag, e.g. --server-arg=--h3-retry=always (repeatable)",
    )
    commands = parser.add_subparsers(dest="command", metavar="{client,ready,forward}")
    for name in ("client", "ready"):
        sub = commands.add_parser(name, help="internal: runs in the client namespace")
        sub.add_argument("--target", required=True)
        sub.add_argument("--ca", required=True)
        if name == "client":
            sub.add_argument("--rtt-ms", type=float, required=True)
            sub.add_argument("--repetitions", type=int, default=20)
            sub.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES))
        else:
            sub.add_argument("--timeout", type=float, default=START_TIMEOUT_S)
    forwarder = commands.add_parser("forward", help="internal: the link's packet forwarder")
    forwarder.add_argument("--server-fd", type=int, required=True)
    forwarder.add_argument("--client-fd", type=int, required=True)
    forwarder.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args(argv)
    entry: dict[str | None, Callable[[argparse.Namespace], int]] = {
        None: _lab_main,
        "client": _client_main,
        "ready": _ready_main,
        "forward": _forward_main,
    }
    return entry[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
