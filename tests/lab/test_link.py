"""The RTT lab's emulated link: it delays both directions, carries TCP, and leaves nothing behind.

Needs root, `ip netns` and /dev/net/tun; skipped elsewhere. Only lower bounds on time are
asserted: the forwarder guarantees the delay, while a busy machine may add to it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.rtt_lab import NETNS_DIR, SERVER_IP, Link

ONE_WAY_MS = 25.0
TIMEOUT_S = 5.0


def _skip_unless_lab_can_run() -> None:
    if os.geteuid() != 0:
        pytest.skip("the link needs root (network namespaces, TUN devices)")
    if shutil.which("ip") is None or not Path("/dev/net/tun").exists():
        pytest.skip("needs iproute2 and /dev/net/tun")
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        pytest.skip("`ip netns` is unavailable")


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    _skip_unless_lab_can_run()
    with Link(ONE_WAY_MS, prefix="pqtest") as built:
        yield built


def test_udp_round_trip_takes_twice_the_delay(link: Link) -> None:
    with link.open_socket("server", socket.SOCK_DGRAM) as server:
        server.bind((SERVER_IP, 0))
        server.settimeout(TIMEOUT_S)

        def echo() -> None:
            data, peer = server.recvfrom(64)
            server.sendto(data, peer)

        thread = threading.Thread(target=echo, daemon=True)
        thread.start()
        with link.open_socket("client", socket.SOCK_DGRAM) as client:
            client.settimeout(TIMEOUT_S)
            start = time.perf_counter()
            client.sendto(b"ping", server.getsockname())
            data = client.recv(64)
            elapsed = time.perf_counter() - start
        thread.join(TIMEOUT_S)
    assert data == b"ping"
    assert elapsed >= 2 * ONE_WAY_MS / 1e3


def test_tcp_connect_and_echo(link: Link) -> None:
    with link.open_socket("server") as listener:
        listener.bind((SERVER_IP, 0))
        listener.listen(1)
        listener.settimeout(TIMEOUT_S)

        def echo() -> None:
            connection, _ = listener.accept()
            with connection:
                connection.sendall(connection.recv(1))

        thread = threading.Thread(target=echo, daemon=True)
        thread.start()
        with link.open_socket("client") as client:
            client.settimeout(TIMEOUT_S)
            start = time.perf_counter()
            client.connect(listener.getsockname())
            client.sendall(b"!")
            data = client.recv(1)
            elapsed = time.perf_counter() - start
        thread.join(TIMEOUT_S)
    assert data == b"!"
    assert elapsed >= 4 * ONE_WAY_MS / 1e3  # SYN/SYN-ACK, then the byte and its echo


def test_namespaces_are_removed_on_exit() -> None:
    _skip_unless_lab_can_run()
    # Its own prefix: the module's link, named after the same pid, may still be up.
    with pytest.raises(RuntimeError, match="inside"), Link(1.0, prefix="pqtest-exit") as link:
        names = list(link.namespaces.values())
        assert all((NETNS_DIR / name).exists() for name in names)
        raise RuntimeError("inside the link")
    assert not any((NETNS_DIR / name).exists() for name in names)
