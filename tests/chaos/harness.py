"""Runs one attack against a live server while good clients call on both transports, and turns
what happened into a row: good requests, their failures, front-end RSS growth, what the attacker
got, and whether the row meets the goal. The server runs as one process, or with front-end
processes (`--frontends`) for the rows that attack those."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import multiprocessing
import re
import shutil
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np

from clients.inference_client import build_request, parse_response
from clients.quic_channel import QuicChannel
from oip.datatypes import from_numpy
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.reference import call_inputs, example_inputs, output_names, run_reference
from tests.servers import (
    EXAMPLE_MODELS,
    HTTP_PORT,
    ServerProcess,
    children,
    running_server,
)
from transport.h3.client import DEFAULT_UNRESPONSIVE_S
from transport.h3.stream_state import StreamClosed
from transport.tls.certs import issue_client_certificate

TRANSPORTS = ("h2", "h3")
REFUSED = "refused at transport"  # an attacking call's connection closed or reset on it
REST = "http"  # the good clients of the REST port (AttackSpec.rest)
FRONTEND = "service.frontends.frontend"  # a front-end process's module
GOAL_RSS_MB = 32.0
# The chaos server's --metrics-timeout: its /metrics peers closed sooner than by default, so
# the row about them stays short.
METRICS_TIMEOUT_S = 2.0
# The chaos server's --max-message-bytes: below the RSS goal, so that the goal tells a server
# that holds at most what the limit allows (grpcio inflates a gzip bomb up to it before it
# refuses) from one that holds what a message inflates to.
MAX_MESSAGE = 16 << 20
# What the HTTP/3 streams of one address may hold (--h3-receive-budget-per-address): below the
# RSS goal too, so that an attacker's many connections from one address stay under it.
RECEIVE_BUDGET_PER_ADDRESS = 16 << 20
# The REST port's bounds (--http-max-input-size below the RSS goal, as MAX_MESSAGE; the idle
# and body timeouts short, so that a slow client's row ends within seconds).
HTTP_MAX_INPUT = 8 << 20
# What the REST requests of one address may hold (--http-receive-budget-per-address): twice a
# body at the input limit and a chunk of one being streamed (binary data is charged twice its
# bytes), so that a binary body streamed past the limit meets the limit first; what it lets an
# address hold (half its charge for binary data, less than its charge for JSON) is below the
# RSS goal.
HTTP_RECEIVE_BUDGET_PER_ADDRESS = 20 << 20
HTTP_KEEPALIVE_S = 2.0
HTTP_BODY_S = 3.0
HTTP_SEND_S = 2.0  # --http-send-timeout: a client that reads nothing is reset after it
H2_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]
GOOD_MODEL = "mlp"
BYTES_MODEL = "tokenizer"  # the example's Python model: one BYTES input of dims [1]
GENERATION_MODEL = "generate"  # the decoupled example: one response per token
SEQUENCE_MODEL = "kws"  # the stateful example: sequence batching with implicit state
# A Python model that attacks the front-end through its worker (tests/fixtures/python_hostile).
HOSTILE_MODEL = "hostile"
# A Python model that answers its BYTES input (tests/fixtures/simple_identity): a NUL byte is
# six bytes of JSON, so a small request has a large answer.
ECHO_MODEL = "simple_identity"
ECHO_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / ECHO_MODEL
HOSTILE_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "python_hostile"
# Client certificates from the server's CA (--tls-client-ca; callers without one are served).
CLIENT_NAMES = ("victim", "intruder")
# A hostile Python model (tests/fixtures/python_processes) that may run PROCESS_COUNT processes.
PROCESSES_MODEL = "processes"
PROCESSES_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "python_processes"
PROCESS_COUNT = 4
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.name
# aiohttp's words for a request it could not write: its kept-alive connection was closing
# (the server's keep-alive timeout passed while this loaded client had not yet reused it), so
# the request never reached the server. An HTTP client sends it again on a new connection
# (RFC 9112, 9.3.1), and so do the good clients, once; it is counted in good_retried.
UNSENT = "Can not write request body"
RETRY_BACKOFF_S = 0.1  # as a gRPC retry policy's initial backoff: the channel notices the loss
GOOD_TIMEOUT_S = 60.0  # longer than a worker restart on a busy 2-core machine
SETTLE_S = 0.5
RSS_SAMPLE_S = 0.1
RECOVERY_LIMIT_S = 120.0
RECOVERY_CALL_S = 10.0
# The per-model watchdog parameter (config.pbtxt `parameters`): a stopped worker is replaced
# after this long. Kept well above a batch's run time under load.
EXECUTION_TIMEOUT_PARAMETER = "execution_timeout_ms"
EXECUTION_TIMEOUT_MS = 3000
# The test-only crash trigger (honoured only with --testing-service): a worker aborts when an
# input element equals this number. Exact in float32.
CRASH_ON_PARAMETER = "testing_crash_on"
POISON_VALUE = 1234.5
# A copy of mlp whose worker (instance queues: the default) writes random bytes over all of its
# queues' shared memory when an input holds SCRIBBLE_VALUE (testing_scribble_on), then hangs.
SCRIBBLER_MODEL = "scribbler"
SCRIBBLE_VALUE = 4321.5
# The example's output name (the exporter's config.pbtxt), so answers compare with run_reference.
MLP_OUTPUT = output_names(GOOD_MODEL)[0]
MLP_CONFIG = f"""\
name: "mlp"
platform: "paddle_inference"
max_batch_size: 64
input [ {{ name: "input", data_type: TYPE_FP32, dims: [ 256 ] }} ]
output [ {{ name: "{MLP_OUTPUT}", data_type: TYPE_FP32, dims: [ 10 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 2 }} ]
dynamic_batching {{ }}
parameters {{
  key: "{EXECUTION_TIMEOUT_PARAMETER}"
  value: {{ string_value: "{EXECUTION_TIMEOUT_MS}" }}
}}
parameters {{ key: "{CRASH_ON_PARAMETER}" value: {{ string_value: "{POISON_VALUE}" }} }}
"""


@dataclass(frozen=True)
class Scale:
    """How hard each attack pushes; every attack is bounded by these counts and times."""

    name: str
    good_loops: int  # concurrent good callers per transport
    names: int  # random model names per transport
    stream_requests: int
    stream_s: float
    oversized: int  # per transport
    bombs: int  # per transport
    large_messages: int  # rounds of large HTTP/3 messages in many DATA frames
    element_bombs: int  # per transport
    initials: int
    idle_h3: int
    idle_h2: int
    idle_hold_s: float
    slow_read_s: float
    kills: int
    stops: int
    poison: int
    reloads: int
    frontend_kills: int
    frontend_kill_gap_s: float  # after a killed front-end's replacement serves, before the next
    gzip_bombs: int  # per transport
    malformed: int  # unparsable requests per transport
    generation_storm: int  # generations cancelled after their first token, per transport
    never_reading: int  # never-read generation streams per transport
    never_read_generations: int  # generations each of those streams starts
    generation_kills: int  # generation worker kills, each with a generation per transport
    abandoned_sequences: int  # sequences started and abandoned, per transport
    region_misuse: int  # rounds of another user's calls on a region, per transport
    worker_messages: int  # oversized messages the hostile model writes to its worker socket
    output_flood: int  # empty lines, and as many lines of text, the hostile model prints
    hijacked_sequences: int  # a certified caller's sequences others try to take over
    partial_connections: int  # HTTP/3 connections from one address with partial messages
    partial_hold_s: float  # how long they hold them
    attack_limit_s: float
    fork_bombs: int = 2  # fork bombs from a Python model, each past its process count
    memfd_bombs: int = 2  # memfd_create files of 1,500 MiB asked for
    orphans: int = 2  # double-forked children whose worker then ends
    slow_clients: int = 24  # REST connections trickling their headers, as many their bodies
    oversized_bodies: int = 2  # REST bodies past --http-max-input-size: declared, as many streamed
    held_bodies: int = 16  # REST bodies of one address sent all but a byte, at once
    unread_answers: int = 16  # REST requests of one address whose answers are never read
    disconnects: int = 16  # REST clients vanishing, of each kind (mid-request, -answer, before it)
    metrics_connections: int = 64  # peers holding /metrics connections, at once
    # Between one good call and the next of each loop, in rows whose point is not the load
    # (AttackSpec.under_load): the good calls go on through the attack and must not fail, at a
    # pace that leaves the suite's cores to the tests beside it (0: back to back).
    good_pause_s: float = 0.0


SHORT = Scale(
    name="short",
    good_loops=2,
    names=150,
    stream_requests=300,
    stream_s=1.5,
    oversized=1,
    bombs=2,
    large_messages=1,
    element_bombs=2,
    initials=1000,
    idle_h3=150,
    idle_h2=200,
    idle_hold_s=1.0,
    slow_read_s=1.5,
    kills=1,
    stops=1,
    poison=2,
    reloads=1,
    frontend_kills=2,  # the two first front-ends: every good client's first connection dies
    frontend_kill_gap_s=0.0,
    gzip_bombs=2,
    malformed=500,
    generation_storm=16,
    never_reading=1,
    never_read_generations=32,  # the example's generation_max_batch: every batch slot
    generation_kills=1,
    abandoned_sequences=150,
    region_misuse=25,
    worker_messages=1,
    output_flood=100_000,
    hijacked_sequences=3,
    partial_connections=40,
    partial_hold_s=3.0,
    attack_limit_s=60.0,
    good_pause_s=0.02,
)
FULL = Scale(
    name="full",
    good_loops=4,
    names=3000,
    stream_requests=20000,
    stream_s=20.0,
    oversized=3,
    bombs=20,
    large_messages=5,
    element_bombs=20,
    initials=5000,
    idle_h3=2000,
    idle_h2=2000,
    idle_hold_s=5.0,
    slow_read_s=10.0,
    kills=3,
    stops=2,
    poison=10,
    reloads=5,
    frontend_kills=6,
    # longer than an HTTP/3 client takes to give a dead connection up
    frontend_kill_gap_s=DEFAULT_UNRESPONSIVE_S + 2.0,
    gzip_bombs=10,
    malformed=5000,
    generation_storm=400,
    never_reading=4,
    never_read_generations=64,
    generation_kills=3,
    abandoned_sequences=3000,
    region_misuse=500,
    worker_messages=3,
    output_flood=1_000_000,
    hijacked_sequences=40,
    partial_connections=64,
    partial_hold_s=20.0,
    attack_limit_s=240.0,
    fork_bombs=5,
    memfd_bombs=5,
    orphans=5,
    slow_clients=200,
    oversized_bodies=6,
    disconnects=200,
)


@dataclass(frozen=True)
class Target:
    """The server under attack and how to reach it; plain data, so that the attacker's own
    process gets a copy."""

    address: str
    port: int
    http_port: int  # the REST API (HTTP/1.1 and HTTP/2 over TCP)
    pid: int  # the server's main process (with --frontends, the parent that runs the servicers)
    ca_file: Path
    metrics_url: str
    repository: Path
    log_path: Path  # the server's log (stdout and stderr)

    def channel(self, transport: str, client: str = "") -> grpc.aio.Channel | QuicChannel:
        """A new channel; create it inside the event loop that uses it. `client`: one of
        CLIENT_NAMES, whose certificate an HTTP/3 channel presents (HTTP/2 has no TLS)."""
        if transport == "h2":
            return grpc.aio.insecure_channel(self.address, options=H2_OPTIONS)
        certs = self.ca_file.parent
        return QuicChannel(
            self.address,
            ca_file=str(self.ca_file),
            server_name="localhost",
            client_cert=str(certs / f"client-{client}.pem") if client else None,
            client_key=str(certs / f"client-{client}-key.pem") if client else None,
        )

    def model_counter(self, name: str, model: str) -> float:
        """A counter of /metrics labelled by model alone (0 before its first count)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        found = re.search(rf'^{name}_total\{{model="{model}"\}} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    def metrics_bytes(self) -> int:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return len(response.read())


@dataclass
class AttackResult:
    """What the attacker got: outcome -> count (a gRPC status name, "refused at transport", or
    an attack-specific outcome), anything it found wrong, and numbers worth reporting."""

    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    notes: dict[str, float] = field(default_factory=dict)


Attack = Callable[[Target, Scale], Awaitable[AttackResult]]


@dataclass(frozen=True)
class AttackSpec:
    name: str
    run: Attack
    # Outcomes that count as "answered with a clear status or refused at the transport".
    answered: frozenset[str]
    frontends: int = 1  # the server's --frontends
    batcher: bool = False  # the server runs --no-instance-queues (its own batcher)
    # Good calls failing UNAVAILABLE are expected (their connection's process was killed):
    # each is retried once, as a client would, and only a failed retry counts as a failure.
    retry_unavailable: bool = False
    rest: bool = False  # good clients call the REST port's /infer too
    # The row is about calls in flight when the attack lands (a kill, a stop, a reload): its
    # good clients call back to back at every scale, never paced (Scale.good_pause_s).
    under_load: bool = False


@dataclass
class Row:
    attack: str
    good_requests: int
    good_failures: dict[str, int]
    rss_growth_mb: float
    attacker: dict[str, int]
    problems: list[str]
    notes: dict[str, float]
    seconds: float
    # transport -> good calls retried: UNAVAILABLE (retry_unavailable), or REST requests never
    # sent (UNSENT)
    good_retried: dict[str, int] = field(default_factory=dict)

    def misses(self) -> list[str]:
        """How the row misses the goal; empty when it meets it."""
        found = list(self.problems)
        if self.good_failures:
            found.insert(0, f"{sum(self.good_failures.values())} good requests failed")
        if self.rss_growth_mb >= GOAL_RSS_MB:
            found.insert(0, f"RSS grew {self.rss_growth_mb:.1f} MB")
        if not self.good_requests:
            found.append("no good request was made")
        return found

    @property
    def passed(self) -> bool:
        return not self.misses()

    def as_json(self) -> dict[str, Any]:
        return {**self.__dict__, "passed": self.passed, "misses": self.misses()}

    def explain(self) -> str:
        """Why the row misses the goal, for a failing test's message."""
        return (
            f"{self.attack}: {'; '.join(self.misses())}. {self.good_requests} good requests, "
            f"failures {self.good_failures}, RSS +{self.rss_growth_mb:.1f} MB (goal < "
            f"{GOAL_RSS_MB:.0f}), attacker got {self.attacker}"
        )


def rss_mb(pid: int) -> float:
    """Resident set size of one process (not its children), from /proc, less its shared
    memory (RssShmem): the instance queues' rings, which --instance-queue-mb reserves when a
    worker starts, count in VmRSS only as the process first touches them (a fresh front-end's
    first 64 KiB requests took its never-reading-streams row past the goal), and registered
    regions are the callers'."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssShmem"):
            fields[name] = int(value.split()[0])
    if "VmRSS" not in fields:
        raise RuntimeError(f"no VmRSS for pid {pid}")
    return (fields["VmRSS"] - fields.get("RssShmem", 0)) / 1024


def status_name(exc: BaseException) -> str:
    """An attacking call's outcome from the exception it raised."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    if isinstance(exc, StreamClosed):
        return exc.status.name
    if isinstance(exc, TimeoutError):
        return "no answer"
    if isinstance(exc, ConnectionError | OSError):
        return REFUSED
    return f"client error {type(exc).__name__}"


async def outcome_of(call: Awaitable[Any], timeout_s: float) -> str:
    """The call's outcome: OK or how it failed; never waits past `timeout_s`."""
    try:
        await asyncio.wait_for(call, timeout_s)
    except Exception as exc:
        return status_name(exc)
    return "OK"


async def outcomes_of(
    calls: Iterable[Awaitable[Any]], concurrency: int, timeout_s: float
) -> list[str]:
    """Each call's outcome, at most `concurrency` in flight: a call is made (the iterable
    yields it) only once there is room."""
    pending: set[asyncio.Task[str]] = set()
    outcomes: list[str] = []
    for call in calls:
        if len(pending) >= concurrency:
            done, pending = await asyncio.wait(pending, return_when="FIRST_COMPLETED")
            outcomes += [d.result() for d in done]
        pending.add(asyncio.ensure_future(outcome_of(call, timeout_s)))
    return outcomes + list(await asyncio.gather(*pending))


# Call numbers, so inputs, never repeat over a run: an input one row got quarantined as poison
# (rightly or not) is not sent by the good clients of every later row.
_CALLS = itertools.count()


class GoodClients:
    """Loops of ModelInfer on `mlp` over both transports, and with `rest` of REST's /infer
    (JSON, HTTP/1.1 keep-alive), each call with inputs of its own and its response checked
    against in-process Paddle for them (an answer given to another call fails). With
    `retry_unavailable`, a call that fails UNAVAILABLE is made once more on the same channel
    (which reconnects) after a short backoff, waiting for the channel to be ready (as a retry
    policy's client does: the first reconnect can still meet a killed front-end's listening
    socket before the kernel has closed it, and the channel then waits out its reconnect
    backoff), and only that retry's failure counts."""

    def __init__(
        self,
        target: Target,
        loops: int,
        retry_unavailable: bool = False,
        rest: bool = False,
        pause_s: float = 0.0,
    ) -> None:
        self._target = target
        self._loops = loops
        self._pause_s = pause_s
        self._retry_unavailable = retry_unavailable
        self._rest = rest
        self._session: aiohttp.ClientSession | None = None
        self.retried: Counter[str] = Counter()  # transport -> calls retried
        self.requests = 0
        self.failures: Counter[str] = Counter()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._channels: list[grpc.aio.Channel | QuicChannel] = []
        transports = (*TRANSPORTS, REST) if rest else TRANSPORTS
        self._first: dict[str, asyncio.Event] = {t: asyncio.Event() for t in transports}

    async def start(self) -> None:
        for transport in TRANSPORTS:
            channel = self._target.channel(transport)
            self._channels.append(channel)
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for _ in range(self._loops):
                call = functools.partial(self._call, stub)
                self._tasks.append(asyncio.create_task(self._loop(transport, call)))
        if self._rest:
            # An idle connection is let go before the server's keep-alive timeout closes it:
            # a POST on a connection the server is closing fails (aiohttp does not send it
            # again); where a loaded client reuses one late all the same, UNSENT.
            connector = aiohttp.TCPConnector(keepalive_timeout=HTTP_KEEPALIVE_S / 2)
            self._session = aiohttp.ClientSession(
                f"http://127.0.0.1:{self._target.http_port}",
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=GOOD_TIMEOUT_S),
            )
            for _ in range(self._loops):
                self._tasks.append(asyncio.create_task(self._loop(REST, self._rest_call)))
        # Baselines are taken with both transports' connections already open.
        await asyncio.wait_for(
            asyncio.gather(*(e.wait() for e in self._first.values())), GOOD_TIMEOUT_S
        )

    async def stop(self) -> None:
        """Let each loop finish the call it is in, then close the channels."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        for channel in self._channels:
            await channel.close(None)
        if self._session is not None:
            await self._session.close()

    async def _loop(self, transport: str, make: Callable[[int, bool], Awaitable[str]]) -> None:
        """`make(n, retry)`: call number n (`retry`: again, once the channel is ready), and
        what went wrong with it (empty: nothing)."""
        while not self._stop.is_set():
            call = next(_CALLS)
            self.requests += 1
            problem = await make(call, False)
            if (problem.startswith(UNAVAILABLE) and self._retry_unavailable) or UNSENT in problem:
                self.retried[transport] += 1
                await asyncio.sleep(RETRY_BACKOFF_S)
                problem = await make(call, True)
            if problem:
                self.failures[f"{transport} {problem[:200]}"] += 1
            self._first[transport].set()
            await asyncio.sleep(self._pause_s)

    async def _call(self, stub: pb_grpc.GRPCInferenceServiceStub, call: int, retry: bool) -> str:
        """What went wrong with call number `call`; empty when nothing did."""
        inputs = call_inputs(GOOD_MODEL, call)
        request = build_request(GOOD_MODEL, inputs)
        try:
            response = await stub.ModelInfer(request, timeout=GOOD_TIMEOUT_S, wait_for_ready=retry)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return self._check(parse_response(response), run_reference(GOOD_MODEL, inputs))

    async def _rest_call(self, call: int, retry: bool) -> str:
        """As `_call`, over REST with JSON tensors (a retry is sent as the call was)."""
        assert self._session is not None
        inputs = call_inputs(GOOD_MODEL, call)
        tensors = [
            {
                "name": name,
                "datatype": from_numpy(array.dtype).name,
                "shape": list(array.shape),
                "data": array.ravel().tolist(),
            }
            for name, array in inputs.items()
        ]
        path = f"/v2/models/{GOOD_MODEL}/infer"
        try:
            async with self._session.post(path, json={"inputs": tensors}) as response:
                document = await response.json(content_type=None)
                if response.status != 200:
                    return f"{response.status}: {str(document)[:200]}"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        served = {
            o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"])
            for o in document["outputs"]
        }
        return self._check(served, run_reference(GOOD_MODEL, inputs))

    def _check(
        self,
        served: Mapping[str, np.ndarray[Any, Any]],
        expected: dict[str, np.ndarray[Any, Any]],
    ) -> str:
        for name, array in expected.items():
            if name not in served or not np.allclose(served[name], array, rtol=1e-4, atol=1e-5):
                return f"wrong output {name}"
        return ""


def frontend_pids(pid: int) -> set[int]:
    """The front-end processes (`--frontends`) of the server whose main process is `pid`."""
    return {child for child, command in children(pid).items() if FRONTEND in command}


def _levels(pids: Iterable[int]) -> dict[int, float]:
    """Each process's RSS; one that exited is left out."""
    levels = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            levels[pid] = rss_mb(pid)
    return levels


async def _sample_peaks(peaks: dict[int, float]) -> None:
    while True:
        for pid, level in _levels(peaks).items():
            peaks[pid] = max(peaks[pid], level)
        await asyncio.sleep(RSS_SAMPLE_S)


def _attack(run: Attack, target: Target, scale: Scale) -> AttackResult:
    """In the attacker's process: one attack, bounded in time."""

    # As __main__ does: aioquic logs every connection at INFO once Paddle (imported by the
    # attacks that compute references) has configured the root logger.
    logging.getLogger("quic").setLevel(logging.WARNING)

    async def bounded() -> AttackResult:
        try:
            return await asyncio.wait_for(run(target, scale), scale.attack_limit_s)
        except TimeoutError:
            return AttackResult(problems=[f"attack still running after {scale.attack_limit_s} s"])
        except Exception as exc:
            return AttackResult(problems=[f"attack raised {type(exc).__name__}: {exc}"])

    return asyncio.run(bounded())


@contextlib.contextmanager
def attacker_process() -> Iterator[Executor]:
    """Attacks run in a process of their own: the attacker's CPU-heavy loops (thousands of
    handshakes) must not delay the good clients' event loop and pass for server slowness."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        yield pool


async def _wait_responsive(target: Target) -> None:
    """Until a new call on each transport succeeds: the aftermath of the previous attack
    (the server closing thousands of connections) is not charged to the next row."""
    request = build_request(GOOD_MODEL, example_inputs(GOOD_MODEL))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RECOVERY_LIMIT_S
    for transport in TRANSPORTS:
        while True:
            async with target.channel(transport) as channel:
                try:
                    stub = pb_grpc.GRPCInferenceServiceStub(channel)
                    await stub.ModelInfer(request, timeout=RECOVERY_CALL_S)
                    break
                except Exception:
                    if loop.time() > deadline:
                        raise
            await asyncio.sleep(RECOVERY_CALL_S / 10)


def _row(spec: AttackSpec, started: float, good: GoodClients, **fields: Any) -> Row:
    return Row(
        attack=spec.name,
        good_requests=good.requests,
        good_failures=dict(good.failures),
        good_retried=dict(good.retried),
        seconds=round(time.monotonic() - started, 1),
        **fields,
    )


async def run_row(
    server: ServerProcess, target: Target, spec: AttackSpec, scale: Scale, attacker: Executor
) -> Row:
    """The attack runs in `attacker` while good clients call from this process. RSS growth is
    the larger of the peak during the attack and the level after a settle, over the level
    before it (the peak catches memory held only while the attack lasts, such as idle
    connections; the level after catches what stays), of the server's main process and of each
    front-end process (`--frontends`: they terminate the attackers' connections), the largest
    of them."""
    started = time.monotonic()
    pause_s = 0.0 if spec.under_load else scale.good_pause_s
    good = GoodClients(target, scale.good_loops, spec.retry_unavailable, spec.rest, pause_s)
    try:
        await _wait_responsive(target)
        await good.start()
    except Exception as exc:
        await good.stop()
        problem = f"not attacked: the server does not answer good calls ({exc!r})"
        return _row(
            spec, started, good, rss_growth_mb=0.0, attacker={}, problems=[problem], notes={}
        )
    await asyncio.sleep(SETTLE_S)
    before = _levels({target.pid, *frontend_pids(target.pid)})
    peaks = dict(before)
    sampler = asyncio.create_task(_sample_peaks(peaks))
    try:
        result = await asyncio.wrap_future(attacker.submit(_attack, spec.run, target, scale))
    except Exception as exc:
        result = AttackResult(problems=[f"the attacker process failed: {exc!r}"])
    await good.stop()
    await asyncio.sleep(SETTLE_S)
    sampler.cancel()
    problems = list(result.problems)
    if server.process.poll() is not None:
        problems.append(f"the server exited ({server.process.returncode})")
    after = _levels(before)
    growth = {pid: max(peaks[pid], after.get(pid, 0.0)) - level for pid, level in before.items()}
    notes = dict(result.notes)
    if len(growth) > 1:
        notes["parent_rss_growth_mb"] = round(growth[target.pid], 1)
        notes["frontend_rss_growth_mb"] = round(
            max(g for pid, g in growth.items() if pid != target.pid), 1
        )
    unanswered = sorted(set(result.outcomes) - spec.answered)
    if unanswered:
        problems.append(f"attacking requests not answered as expected: {unanswered}")
    return _row(
        spec,
        started,
        good,
        rss_growth_mb=round(max(growth.values()), 1),
        attacker=dict(result.outcomes),
        problems=problems,
        notes=notes,
    )


SCRIBBLER_CONFIG = f"""\
max_batch_size: 8
input [ {{ name: "input", data_type: TYPE_FP32, dims: [ 256 ] }} ]
output [ {{ name: "{MLP_OUTPUT}", data_type: TYPE_FP32, dims: [ 10 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
dynamic_batching {{ }}
parameters {{ key: "testing_scribble_on" value: {{ string_value: "{SCRIBBLE_VALUE}" }} }}
"""


def chaos_repository(directory: Path) -> Path:
    """`mlp` with its version files copied (hot reload touches them) and two instances (a
    killed or stopped worker leaves one serving), `tokenizer`, a model with a BYTES input,
    `generate`, a decoupled one, `kws`, a sequence-batched one, `hostile`, a Python model
    that attacks through its worker, `processes`, a hostile Python model that may run
    PROCESS_COUNT processes, and `simple_identity`, whose answers are larger than its requests."""
    repository = directory / "models"
    shutil.copytree(EXAMPLE_MODELS / GOOD_MODEL / "1", repository / GOOD_MODEL / "1")
    (repository / GOOD_MODEL / "config.pbtxt").write_text(MLP_CONFIG)
    shutil.copytree(EXAMPLE_MODELS / BYTES_MODEL, repository / BYTES_MODEL)
    shutil.copytree(EXAMPLE_MODELS / GENERATION_MODEL, repository / GENERATION_MODEL)
    shutil.copytree(EXAMPLE_MODELS / SEQUENCE_MODEL, repository / SEQUENCE_MODEL)
    shutil.copytree(HOSTILE_FIXTURE, repository / HOSTILE_MODEL)
    shutil.copytree(PROCESSES_FIXTURE, repository / PROCESSES_MODEL)
    (repository / ECHO_MODEL / "1").mkdir(parents=True)
    shutil.copy(ECHO_FIXTURE / "config.pbtxt", repository / ECHO_MODEL / "config.pbtxt")
    shutil.copy(ECHO_FIXTURE / "model.py", repository / ECHO_MODEL / "1" / "model.py")
    with (repository / PROCESSES_MODEL / "config.pbtxt").open("a") as config:
        value = f'{{ string_value: "{PROCESS_COUNT}" }}'
        config.write(f'parameters {{ key: "python_child_processes" value: {value} }}\n')
    (repository / SCRIBBLER_MODEL).mkdir()
    (repository / SCRIBBLER_MODEL / "1").symlink_to((repository / GOOD_MODEL / "1").resolve())
    (repository / SCRIBBLER_MODEL / "config.pbtxt").write_text(SCRIBBLER_CONFIG)
    return repository


@contextlib.contextmanager
def chaos_server(
    directory: Path, frontends: int = 1, batcher: bool = False
) -> Iterator[tuple[ServerProcess, Target]]:
    """The server every attack runs against: explicit model control (for hot reload), the
    testing service (slow reader, poison input), metrics on a known port, 127.0.0.1 only,
    client certificates asked for (HTTP/3) and not required; `frontends` front-end processes
    (1: a single process); `batcher`: --no-instance-queues."""
    directory = directory / f"frontends-{frontends}{'-batcher' if batcher else ''}"
    directory.mkdir(parents=True, exist_ok=True)
    repository = chaos_repository(directory)
    certs = directory / "certs"
    for name in CLIENT_NAMES:
        issue_client_certificate(certs, name)
    args = [
        *("--model-control-mode", "explicit", "--load-model", "*", "--testing-service"),
        *("--certs-dir", str(certs)),
        *("--log-sample-ratio", "0", "--frontends", str(frontends)),
        *("--max-message-bytes", str(MAX_MESSAGE)),
        *("--tls-client-ca", str(certs / "ca.pem")),
        *("--h3-receive-budget-per-address", str(RECEIVE_BUDGET_PER_ADDRESS)),
        *("--http-port", HTTP_PORT, "--http-max-input-size", str(HTTP_MAX_INPUT)),
        *("--http-keepalive-timeout", str(HTTP_KEEPALIVE_S)),
        *("--http-body-timeout", str(HTTP_BODY_S)),
        *("--http-send-timeout", str(HTTP_SEND_S)),
        *("--http-receive-budget-per-address", str(HTTP_RECEIVE_BUDGET_PER_ADDRESS)),
        *(("--no-instance-queues",) if batcher else ()),
        *("--metrics-timeout", str(METRICS_TIMEOUT_S)),
    ]
    with running_server(repository, directory / "server.log", args) as server:
        # On a port the server chose (--metrics-port 0): no other process can take it first.
        metrics = re.search(r"metrics on (http://\S+/metrics)", server.log_text())
        assert metrics is not None, "the server logs no metrics URL"
        yield (
            server,
            Target(
                address=server.address,
                port=server.port,
                http_port=server.http_port,
                pid=server.process.pid,
                ca_file=certs / "ca.pem",
                metrics_url=metrics.group(1),
                repository=repository,
                log_path=server.log_path,
            ),
        )
