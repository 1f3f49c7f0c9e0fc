"""`make lab-udp-fallback`: an auto:// client on a network that drops UDP, then lets it through.

The RTT lab's link (two network namespaces joined by a forwarder) with its forwarder dropping
every UDP packet, as a firewall that lets only TCP through would. The server advertises HTTP/3
with `--alt-svc-max-age 3`. The client, in its namespace, drives generated stubs over an
AutoChannel sharing one TransportPolicy:

1. a first channel makes one call over HTTP/2 and learns the server's alt-svc;
2. a new channel races HTTP/3 (dropped) against HTTP/2: its first call must answer within a
   second, over HTTP/2; it goes on over HTTP/2 until the HTTP/3 handshake timed out and the
   failure is remembered (for the advertised 3 s);
3. the lab lets UDP through again; the channel goes on calling and must move to HTTP/3, and
   not before the remembered failure expired; it stays there past the advertised lifetime
   (its connection lives on);
4. the lab drops UDP again under that live connection: its calls fail until the channel gives
   it up (no answer for H3_UNRESPONSIVE_S), then go on over HTTP/2.

Besides these verdicts the client reports how long its raced call took, how long the fallback
of step 4 took and which calls failed meanwhile.

Namespaces, forwarder and server are removed on exit, as in the RTT lab.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scripts.rtt_lab import (
    CALL_TIMEOUT_S,
    REPO_ROOT,
    SERVER_IP,
    SERVER_NAME,
    SERVER_PORT,
    START_TIMEOUT_S,
    UDP_DROP,
    UDP_PASS,
    Link,
    _preflight,
    _request,
    _stop,
    wait_until_ready,
)

MAX_AGE_S = 3
FALLBACK_S = 1.0  # each call while UDP is dropped must answer within this
PHASE_TIMEOUT_S = 30.0  # bounds each of the client's waits
EXPECTED = {
    "raced_call": "h2",
    "while_blocked": ["h2"],
    "after_udp_is_back": "h3",
    "moved_after_the_failure_expired": True,
    "past_the_advertised_lifetime": ["h3"],
    "udp_blocked_mid_connection": ["h2"],
}
_DONE = "done"


# --- the client (runs in the client namespace) ----------------------------------------------


async def _scenario(target: str, ca_file: str) -> dict[str, Any]:
    import grpc

    from clients.auto_channel import H3_UNRESPONSIVE_S, AutoChannel
    from clients.quic_channel import QuicChannel
    from clients.transport_policy import TransportPolicy
    from protos.inference import grpc_service_pb2_grpc as pb_grpc

    policy = TransportPolicy()
    request = _request()

    def channel() -> AutoChannel:
        return AutoChannel(
            grpc.aio.insecure_channel(target),
            lambda host, port: QuicChannel(
                f"{host}:{port}",
                ca_file=ca_file,
                server_name=SERVER_NAME,
                unresponsive_timeout_s=H3_UNRESPONSIVE_S,
            ),
            SERVER_IP,
            policy,
        )

    async def within(
        condition: Callable[[], bool], call: Callable[[], Any], what: str
    ) -> list[str]:
        """Calls (each within FALLBACK_S) until `condition`; the transport of each."""
        used: list[str] = []
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not after {PHASE_TIMEOUT_S:g} s ({used})")
            used.append(await call())
            await asyncio.sleep(0.1)
        return used

    async with channel() as first:
        await pb_grpc.GRPCInferenceServiceStub(first).ModelInfer(request, timeout=CALL_TIMEOUT_S)
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while policy.h3_endpoint(SERVER_IP) is None:  # the response's headers are read apart
            if time.monotonic() > deadline:
                raise TimeoutError("no alt-svc learned from the server's HTTP/2 response")
            await asyncio.sleep(0.01)
    async with channel() as second:
        stub = pb_grpc.GRPCInferenceServiceStub(second)

        async def call() -> str:
            await stub.ModelInfer(request, timeout=FALLBACK_S)
            return second.transport

        started = time.perf_counter()
        raced = await call()
        raced_ms = (time.perf_counter() - started) * 1e3
        blocked = await within(lambda: policy.blocked_until is not None, call, "the failure")
        remembered_until = policy.blocked_until
        assert remembered_until is not None
        await _ask_lab(UDP_PASS)
        after = await within(lambda: second.transport == "h3", call, "back on HTTP/3")
        moved_at = time.monotonic()
        # The advertisement (3 s) expires meanwhile; the live connection stays in use.
        stayed = await within(lambda: time.monotonic() > moved_at + MAX_AGE_S + 1, call, "")
        # UDP blocked under a live connection: its calls fail until it is given up.
        failed: list[str] = []

        async def call_or_fail() -> str:
            try:
                return await call()
            except grpc.aio.AioRpcError as exc:
                failed.append(exc.code().name)
                return "failed"

        await _ask_lab(UDP_DROP)
        blocked_at = time.monotonic()
        await within(lambda: second.transport == "h2", call_or_fail, "back on HTTP/2")
        fell_back_s = time.monotonic() - blocked_at
        kept_on = [await call(), await call()]
    return {
        "raced_call": raced,
        "while_blocked": sorted(set(blocked)),
        "after_udp_is_back": after[-1],
        "moved_after_the_failure_expired": moved_at >= remembered_until,
        "past_the_advertised_lifetime": sorted(set(stayed)),
        "udp_blocked_mid_connection": sorted(set(kept_on)),
        "raced_call_ms": round(raced_ms, 1),
        "mid_connection_fallback_s": round(fell_back_s, 2),
        "mid_connection_failed_calls": failed,
    }


async def _ask_lab(state: str) -> None:
    """The lab sets the link's UDP to `state` (UDP_DROP or UDP_PASS) and answers."""
    print(state, flush=True)
    if (await asyncio.to_thread(sys.stdin.readline)).strip() != _DONE:
        raise RuntimeError(f"the lab did not set {state!r}")


async def _wait_ready(target: str, timeout_s: float) -> None:
    """ServerReady over HTTP/2 until the model is loaded, then one ModelInfer to warm it."""
    import grpc

    from protos.inference import grpc_service_pb2 as pb
    from protos.inference import grpc_service_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.aio.AioRpcError):
                if (await stub.ServerReady(pb.ServerReadyRequest(), timeout=2)).ready:
                    await stub.ModelInfer(_request(), timeout=CALL_TIMEOUT_S)
                    return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"the server at {target} was not ready after {timeout_s:g} s")


# --- the lab (root namespace) ---------------------------------------------------------------


def _client_command(link: Link, *args: str) -> list[str]:
    return [
        *link.exec_prefix("client"),
        sys.executable,
        "-m",
        "scripts.udp_fallback_lab",
        *args,
        f"--target={SERVER_IP}:{SERVER_PORT}",
    ]


def run_lab(models: Path) -> dict[str, Any]:
    """What the client saw; EXPECTED is what a working fallback gives (plus a time)."""
    with tempfile.TemporaryDirectory(prefix="udp-lab-") as name, Link(1.0, prefix="pqudp") as link:
        tmp = Path(name)
        (tmp / "models").mkdir()
        (tmp / "models" / "mlp").symlink_to(models / "mlp")
        link.block_udp(True)
        with (tmp / "server.log").open("wb") as log:
            server = subprocess.Popen(
                [
                    *link.exec_prefix("server"),
                    *(sys.executable, "-m", "service.server"),
                    *("--host", SERVER_IP, "--grpc-port", str(SERVER_PORT)),
                    *("--certs-dir", str(tmp / "certs")),
                    *("--model-repository", str(tmp / "models")),
                    *("--alt-svc-max-age", str(MAX_AGE_S)),
                    *("--no-metrics", "--log-level", "warning"),
                ],
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                wait_until_ready(
                    _client_command(link, "ready"),
                    server,
                    "the server",
                    lambda: f":\n{(tmp / 'server.log').read_text()}",
                )
                return _drive_client(link, tmp / "certs" / "ca.pem")
            finally:
                _stop(server)


def _drive_client(link: Link, ca_file: Path) -> dict[str, Any]:
    """Runs the scenario, dropping UDP or letting it through when the client asks."""
    with subprocess.Popen(
        _client_command(link, "client", f"--ca={ca_file}"),
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as client:
        assert client.stdin is not None and client.stdout is not None
        try:
            while (line := client.stdout.readline().strip()) in (UDP_DROP, UDP_PASS):
                link.block_udp(line == UDP_DROP)
                client.stdin.write(_DONE + "\n")
                client.stdin.flush()
            out = line
        finally:
            if client.wait(PHASE_TIMEOUT_S * 3) != 0:
                raise RuntimeError(f"the lab's client failed ({client.returncode})")
    result: dict[str, Any] = json.loads(out)
    return result


def _lab_main(args: argparse.Namespace) -> int:
    problem = _preflight()
    if problem is not None:
        print(f"udp_fallback_lab: {problem}", file=sys.stderr)
        return 2
    result = run_lab(REPO_ROOT / "models")
    for step, expected in EXPECTED.items():
        verdict = "ok" if result[step] == expected else f"FAILED, expected {expected}"
        print(f"{step:<32} {result[step]}  {verdict}")
    print(f"the raced call (UDP dropped) answered over HTTP/2 in {result['raced_call_ms']} ms")
    return 0 if all(result[step] == expected for step, expected in EXPECTED.items()) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", metavar="{client,ready}")
    client = commands.add_parser("client", help="internal: runs in the client namespace")
    client.add_argument("--target", required=True)
    client.add_argument("--ca", required=True)
    ready = commands.add_parser("ready", help="internal: waits for the server")
    ready.add_argument("--target", required=True)
    args = parser.parse_args(argv)
    if args.command == "client":
        json.dump(asyncio.run(_scenario(args.target, args.ca)), sys.stdout)
        return 0
    if args.command == "ready":
        asyncio.run(_wait_ready(args.target, START_TIMEOUT_S))
        return 0
    return _lab_main(args)


if __name__ == "__main__":
    sys.exit(main())
