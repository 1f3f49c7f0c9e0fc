"""`make lab-replicas`: two server replicas sharing one Redis ticket store, and a client that
resumes on the replica that did not issue its ticket.

Each part has a network namespace of its own (replica A, replica B, Redis, clients), all joined
by a bridge in a fifth one, as hosts on one LAN. The servers run with `--ticket-store` pointing
at the Redis host and the same `--ticket-key-file`. The client connects to A (full handshake),
takes the session ticket A issued, resumes with it on B (0-RTT accepted), then replays the same
ticket on A and on B: both must refuse it (full handshake, early data rejected).

Namespaces, servers and Redis are removed on exit, on an error and at interpreter exit; a run
killed outright leaves namespaces that the next run deletes (their owner's pid is in the name).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import shutil
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
    SERVER_NAME,
    START_TIMEOUT_S,
    Namespaces,
    _ip,
    _request,
    _stop,
    run_in_namespace,
    wait_until_ready,
)

ADDRESSES = {"a": "198.18.1.1", "b": "198.18.1.2", "redis": "198.18.1.3", "cli": "198.18.1.4"}
PREFIX_LENGTH = 24
PORT = 8001
REDIS_PORT = 6379
EXPECTED = {
    "issued_by_a": "full",
    "resumed_on_b": "0rtt-accepted",
    "replayed_on_a": "0rtt-rejected",
    "replayed_on_b": "0rtt-rejected",
}


class Lan(Namespaces):
    """One namespace per host in ADDRESSES, each with `eth0` on a bridge in the `lan` namespace."""

    def __init__(self, prefix: str = "pqrep") -> None:
        super().__init__(prefix, (*ADDRESSES, "lan"))

    def _connect(self) -> None:
        for namespace in self.namespaces.values():
            _ip("-n", namespace, "link", "set", "lo", "up")
        lan = self.namespaces["lan"]
        _ip("-n", lan, "link", "add", "br0", "type", "bridge")
        _ip("-n", lan, "link", "set", "br0", "up")
        for role, address in ADDRESSES.items():
            host = self.namespaces[role]
            port = f"v{role}"
            _ip(
                "-n",
                lan,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                host,
            )
            _ip("-n", lan, "link", "set", port, "master", "br0", "up")
            _ip("-n", host, "addr", "add", f"{address}/{PREFIX_LENGTH}", "dev", "eth0")
            _ip("-n", host, "link", "set", "eth0", "up")

    def exec_prefix(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[role]]


# --- the client (runs in the clients' namespace) --------------------------------------------


async def _connect(target: str, ca_file: str, ticket: Any) -> tuple[str | None, Any]:
    """One new connection and one ModelInfer, resuming with `ticket` if given: the connect mode
    the client saw and the ticket the server issued on this connection."""
    from clients.quic_channel import QuicChannel
    from clients.tickets import SessionTicketCache
    from protos.inference import grpc_service_pb2_grpc as pb_grpc

    host, port = target.rsplit(":", 1)
    key = SessionTicketCache.key(SERVER_NAME, host, int(port))
    cache = SessionTicketCache()
    if ticket is not None:
        cache.add(key, copy.deepcopy(ticket))
    async with QuicChannel(
        target, ca_file=ca_file, server_name=SERVER_NAME, ticket_cache=cache
    ) as channel:
        await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            _request(), timeout=CALL_TIMEOUT_S
        )
    return channel.last_connect_mode, cache.take(key)


async def _check(a: str, b: str, ca_file: str) -> dict[str, str | None]:
    modes: dict[str, str | None] = {}
    modes["issued_by_a"], ticket = await _connect(a, ca_file, None)
    if ticket is None:
        raise RuntimeError("replica A issued no session ticket")
    modes["resumed_on_b"], _ = await _connect(b, ca_file, ticket)
    modes["replayed_on_a"], _ = await _connect(a, ca_file, ticket)
    modes["replayed_on_b"], _ = await _connect(b, ca_file, ticket)
    return modes


def _client_main(args: argparse.Namespace) -> int:
    json.dump(asyncio.run(_check(args.a, args.b, args.ca)), sys.stdout)
    return 0


# --- the lab (root namespace) ---------------------------------------------------------------


def _wait_redis(lan: Lan) -> None:
    import redis

    def ping() -> bool:
        client = redis.Redis(host=ADDRESSES["redis"], port=REDIS_PORT, socket_timeout=1)
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False
        finally:
            client.close()

    deadline = time.monotonic() + 10
    while not run_in_namespace(lan.namespaces["cli"], ping):
        if time.monotonic() > deadline:
            raise RuntimeError("redis-server did not answer in its namespace")
        time.sleep(0.1)


def _start_replica(lan: Lan, role: str, tmp: Path, log: Any) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "service.server",
        f"--host={ADDRESSES[role]}",
        f"--grpc-port={PORT}",
        "--h2-tls",
        f"--certs-dir={tmp / 'certs'}",
        f"--model-repository={tmp / 'models'}",
        f"--ticket-store=redis://{ADDRESSES['redis']}:{REDIS_PORT}/0",
        f"--ticket-key-file={tmp / 'ticket.key'}",
        "--no-metrics",
        "--log-level=warning",
    ]
    return subprocess.Popen(
        lan.exec_prefix(role) + command,
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait_replica(lan: Lan, role: str, server: subprocess.Popen[bytes], tmp: Path) -> None:
    """The RTT lab's `ready` client: ServerReady over HTTP/2 + TLS, then one warm-up call."""
    command = [
        *lan.exec_prefix("cli"),
        sys.executable,
        "-m",
        "scripts.rtt_lab",
        "ready",
        f"--target={ADDRESSES[role]}:{PORT}",
        f"--ca={tmp / 'certs' / 'ca.pem'}",
        f"--timeout={START_TIMEOUT_S}",
    ]
    wait_until_ready(command, server, f"replica {role}")


def run_lab(models: Path) -> dict[str, str | None]:
    """The connect modes the client saw; EXPECTED is what a shared store gives."""
    with (
        tempfile.TemporaryDirectory(prefix="replica-lab-") as name,
        Lan() as lan,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(name)
        (tmp / "models").mkdir()
        (tmp / "models" / "mlp").symlink_to(models / "mlp")
        (tmp / "ticket.key").write_bytes(os.urandom(32))
        (tmp / "ticket.key").chmod(0o600)  # the server refuses a key other users can read
        redis = subprocess.Popen(
            [
                *lan.exec_prefix("redis"),
                "redis-server",
                *("--bind", ADDRESSES["redis"], "--port", str(REDIS_PORT)),
                *("--save", "", "--appendonly", "no", "--protected-mode", "no"),
                *("--dir", str(tmp)),
            ],
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        stack.callback(_stop, redis)
        _wait_redis(lan)
        # One after the other: the first writes the development certificates both use.
        for role in ("a", "b"):
            log = stack.enter_context((tmp / f"{role}.log").open("wb"))
            server = _start_replica(lan, role, tmp, log)
            stack.callback(_stop, server)
            print(f"replica {role} starting at {ADDRESSES[role]} ...", file=sys.stderr, flush=True)
            _wait_replica(lan, role, server, tmp)
        out = subprocess.run(
            [
                *lan.exec_prefix("cli"),
                sys.executable,
                "-m",
                "scripts.replica_lab",
                "client",
                f"--a={ADDRESSES['a']}:{PORT}",
                f"--b={ADDRESSES['b']}:{PORT}",
                f"--ca={tmp / 'certs' / 'ca.pem'}",
            ],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            text=True,
            check=True,
        ).stdout
        modes: dict[str, str | None] = json.loads(out)
        return modes


def preflight() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (it creates network namespaces): run it with sudo"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here (iproute2)"
    if shutil.which("redis-server") is None:
        return "needs redis-server (Debian package redis-server)"
    if not (REPO_ROOT / "models" / "mlp").is_dir():
        return "the example model models/mlp is missing: run `make models`"
    return None


def _lab_main(args: argparse.Namespace) -> int:
    problem = preflight()
    if problem is not None:
        print(f"replica_lab: {problem}", file=sys.stderr)
        return 2
    modes = run_lab(REPO_ROOT / "models")
    for step, mode in modes.items():
        verdict = "ok" if mode == EXPECTED[step] else f"FAILED, expected {EXPECTED[step]}"
        print(f"{step:<14} {mode}  {verdict}")
    return 0 if modes == EXPECTED else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", metavar="{client}")
    client = commands.add_parser("client", help="internal: runs in the clients' namespace")
    client.add_argument("--a", required=True, help="replica A, HOST:PORT")
    client.add_argument("--b", required=True, help="replica B, HOST:PORT")
    client.add_argument("--ca", required=True)
    args = parser.parse_args(argv)
    entry: dict[str | None, Callable[[argparse.Namespace], int]] = {
        None: _lab_main,
        "client": _client_main,
    }
    return entry[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
