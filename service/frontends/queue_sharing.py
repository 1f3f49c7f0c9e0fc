"""The parent's side of front-ends writing into workers' queues themselves (the front-end's
side: shared_versions.py). The parent takes no part in such a call; it governs:

- it tells every front-end which versions it may serve itself (QUEUED: each version's
  queue setup, none for a decoupled one, and instances) and what happens to their workers
  (WORKER: ready under launch number N, ended with its death's fate, a restart failed);
- a front-end makes its own segment for each worker launch (as the parent does for itself; a
  decoupled worker's: one end of a socket pair) and
  passes it over the queues socket (SOCK_SEQPACKET, descriptors attached); the parent hands
  it to that worker if the launch is still the one serving, so nothing of it passes through
  the parent again;
- a front-end's watchdog or reply checks that find a worker hung or breaking its queues say
  so (TROUBLE), and the parent ends that worker as it ends its own;
- a version that leaves the view winds down only once every front-end said it holds nothing
  of it any more (RELEASED), or is gone; a front-end that is gone is dropped from every
  worker;
- the system shared-memory regions callers register go to every front-end on the same
  socket, descriptors attached (region_copies.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import math
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from service.frontends.link import received_with_fds
from service.frontends.protocol import Kind
from service.frontends.region_copies import FrontendRegions
from service.registry.versions import ServedVersion
from service.resilience.breaker import BreakerState, Shown
from service.serving.queued_batcher import QueuedBatcher
from service.workers import deaths, protocol
from service.workers.worker_process import State

log = logging.getLogger("paddlequic.frontends")

QUEUES_SOCKET = "queues"
MAX_ATTACH_BYTES = 1024


def producer_of(frontend: str) -> int:
    """A front-end's producer number in its workers (0 is the parent's)."""
    return int(frontend) + 1


def shareable(served: ServedVersion) -> bool:
    """Versions front-ends serve themselves: those whose requests go straight into their
    instances' queues (one with a fallback model is served in a front-end while its fallback
    is too: shared_versions.py), and decoupled models, whose workers take each front-end's
    requests on a socket of its own (workers/decoupled_loop.py)."""
    return isinstance(served.batcher, QueuedBatcher) or served.generations is not None


class SharedQueues:
    def __init__(self, send_all: Callable[[Kind, bytes], None]) -> None:
        """`send_all`: a frame to every connected front-end."""
        self._send_all = send_all
        self._versions: dict[int, ServedVersion] = {}  # by token: in the view or winding down
        self._viewed: set[int] = set()
        self._holders: dict[int, set[str]] = {}  # by token: front-ends that may hold requests
        # What each front-end last said it holds, by token: (queued, in workers' batches).
        self._held: dict[str, dict[int, tuple[int, int, list[int]]]] = {}
        # What each front-end last said of its breakers not closed, by token; the view's
        # versions by token, and those shown with some.
        self._breakers: dict[str, dict[int, Shown]] = {}
        self._described: Mapping[int, ServedVersion] = {}
        self._shown: set[int] = set()
        self._frontends: set[str] = set()
        self._server: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        # What front-ends hold of the system shared-memory regions, told on the same sockets
        # (region_copies.py; None: they hold none, and pass the requests naming them on).
        self.regions: FrontendRegions | None = None

    def start(self, path: Path) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server.bind(str(path))
        path.chmod(0o600)
        server.listen(16)
        server.setblocking(False)
        asyncio.get_running_loop().add_reader(server.fileno(), self._accept)
        self._server = server

    def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in [*self._conns, *([self._server] if self._server else [])]:
            loop.remove_reader(sock.fileno())
            sock.close()
        self._conns.clear()
        self._server = None

    def view(self, described: Mapping[int, ServedVersion]) -> bytes:
        """The QUEUED payload for the versions front-ends may describe: those they may queue
        for themselves, with their instances now."""
        entries = []
        viewed = set()
        self._described = described
        self._show_breakers()
        for token, served in described.items():
            if not shareable(served):
                continue
            viewed.add(token)
            if token not in self._versions:
                self._versions[token] = served
                _told(served, _Events(self, token, served))
            self._holders.setdefault(token, set()).update(self._frontends)
            entry = {
                "token": token,
                "name": served.name,
                "version": served.version,
                "instances": [_instance(i) for i in served.instances],
                # The parent's NUMA node, whose instances its front-ends prefer too: they run
                # on the CPUs it may (instance_groups.frontend_numa_node).
                "local_numa": served.local_numa,
            }
            if isinstance(served.batcher, QueuedBatcher):
                setup = protocol.encode(served.batcher.setup)
                entry["setup"] = base64.b64encode(setup).decode()
            entries.append(entry)
        for token in self._viewed - viewed:
            self._left_view(token)
        self._viewed = viewed
        return json.dumps(entries).encode()

    def connected(self, frontend: str) -> None:
        """A front-end was sent the view: it may hold requests of every version in it."""
        self._frontends.add(frontend)
        for token in self._viewed:
            self._holders[token].add(frontend)

    def lost(self, frontend: str) -> None:
        """A front-end is gone: its queues leave every worker; it holds nothing."""
        self._frontends.discard(frontend)
        self._held.pop(frontend, None)
        self._count_held()
        self._breakers.pop(frontend, None)
        self._show_breakers()
        for token in list(self._holders):
            self._release(token, frontend)

    def held(self, frontend: str, counts: Any) -> None:
        """A front-end's report of the requests it holds: counted in its versions' queues
        (ListInstances, and a version winding down waits for them)."""
        held: dict[int, tuple[int, int, list[int]]] = {}
        try:
            for token, (queued, running, each) in counts.items():
                instances = [max(int(n), 0) for n in each]
                held[int(token)] = (max(int(queued), 0), max(int(running), 0), instances)
        except (AttributeError, TypeError, ValueError):
            log.error("front-end %s reported held requests this server cannot read", frontend)
            return
        self._held[frontend] = held
        self._count_held()

    def breakers(self, frontend: str, data: Any) -> None:
        """A front-end's report of its breakers that are not closed: each version shows the
        worst of the parent's and the front-ends' (ListInstances, /metrics)."""
        reported: dict[int, Shown] = {}
        try:
            for token, (state, retry_in_s) in data.items():
                wait = float(retry_in_s)
                if not math.isfinite(wait):
                    raise ValueError(f"retry_in_s {wait}")
                reported[int(token)] = (BreakerState(state), max(wait, 0.0))
        except (AttributeError, TypeError, ValueError):
            log.error("front-end %s reported breakers this server cannot read", frontend)
            return
        self._breakers[frontend] = reported
        self._show_breakers()

    def _show_breakers(self) -> None:
        shown = set()
        for token in self._shown | {t for r in self._breakers.values() for t in r}:
            served = self._described.get(token)
            if served is not None:
                served.breakers_elsewhere = tuple(
                    r[token] for r in self._breakers.values() if token in r
                )
                if served.breakers_elsewhere:
                    shown.add(token)
        self._shown = shown

    def _count_held(self) -> None:
        for token, served in self._versions.items():
            counts = [held[token] for held in self._held.values() if token in held]
            elsewhere = (sum(c[0] for c in counts), sum(c[1] for c in counts))
            batcher = served.batcher
            if isinstance(batcher, QueuedBatcher):
                batcher.elsewhere = elsewhere
            elif served.generations is not None:
                served.generations.elsewhere = elsewhere
            else:
                continue
            for index, instance in enumerate(served.instances):
                instance.held_elsewhere = sum(c[2][index] for c in counts if index < len(c[2]))

    def released(self, frontend: str, payload: bytes) -> None:
        token = json.loads(payload)["token"]
        if isinstance(token, int):
            self._release(token, frontend)

    def trouble(self, payload: bytes) -> None:
        """A front-end found a worker hung or breaking its queues: ended as the parent ends
        its own (if that launch still serves)."""
        data = json.loads(payload)
        instance = self._instance(data)
        if instance is None:
            return
        if data.get("hung"):
            instance.end_hung()
        else:
            instance.kill_misbehaving(f"{data.get('reason', '')} (a front-end's queues)")

    def _left_view(self, token: int) -> None:
        """Out of the view: it winds down once every front-end lets it go."""
        served = self._versions.get(token)
        if served is not None:
            served.held_elsewhere = len(self._holders.get(token, ()))
        self._forget_if_free(token)

    def _release(self, token: int, frontend: str) -> None:
        holders = self._holders.get(token)
        if holders is None or frontend not in holders:
            return
        holders.discard(frontend)
        # It holds nothing of the version now: its last report's count of it goes (else a
        # version winding down would wait for requests answered long ago, until its timeout).
        self._held.get(frontend, {}).pop(token, None)
        self._count_held()
        served = self._versions.get(token)
        if served is not None:
            for instance in served.instances:
                if instance.state is State.READY:
                    instance.drop_producer(producer_of(frontend))
            if token not in self._viewed:
                served.held_elsewhere = len(holders)
        self._forget_if_free(token)

    def _forget_if_free(self, token: int) -> None:
        if token not in self._viewed and not self._holders.get(token):
            self._holders.pop(token, None)
            served = self._versions.pop(token, None)
            if served is not None:
                _told(served, None)

    def _instance(self, data: Any) -> Any:
        """The instance a front-end names, if the launch it names still serves."""
        try:
            served = self._versions[int(data["token"])]
            instance = served.instances[int(data["index"])]
            launch = int(data["launch"])
        except (KeyError, IndexError, TypeError, ValueError):
            return None
        if instance.launch != launch or instance.state is not State.READY:
            return None
        return instance

    def _accept(self) -> None:
        assert self._server is not None
        with contextlib.suppress(BlockingIOError):
            conn, _ = self._server.accept()
            conn.setblocking(False)
            self._conns.add(conn)
            asyncio.get_running_loop().add_reader(conn.fileno(), self._attach, conn)

    def _attach(self, conn: socket.socket) -> None:
        """A front-end's segment and wake-ups for one worker launch (a decoupled worker: its
        socket's end): to that worker."""
        received = received_with_fds(conn, MAX_ATTACH_BYTES, 3)
        if received is None:
            return
        data, fds = received
        if not data:
            asyncio.get_running_loop().remove_reader(conn.fileno())
            self._conns.discard(conn)
            if self.regions is not None:
                self.regions.closed(conn)
            conn.close()
            return
        try:
            message = json.loads(data)
            if self.regions is not None and "regions" in message:
                self.regions.connected(str(message["frontend"]), conn)
                return
            if self.regions is not None and "held" in message:
                self.regions.held(str(message["frontend"]), int(message["held"]))
                return
            instance = self._instance(message)
            if instance is not None and len(fds) == (1 if instance.spec.decoupled else 3):
                instance.add_producer(producer_of(str(message["frontend"])), fds)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("a front-end's queues message was not understood: %s", exc)
        finally:
            for fd in fds:
                os.close(fd)

    def event(self, token: int, index: int, event: dict[str, Any]) -> None:
        if token in self._versions:
            payload = {"token": token, "index": index, **event}
            self._send_all(Kind.WORKER, json.dumps(payload).encode())


def _told(served: ServedVersion, events: _Events | None) -> None:
    """Who hears what a shared version's instances do (None: nobody now): a queued version's
    batcher passes it on, a decoupled version's instances tell it themselves."""
    if isinstance(served.batcher, QueuedBatcher):
        served.batcher.events = events
        return
    for index, instance in enumerate(served.instances):
        instance.on_ready = None if events is None else functools.partial(events.ready, index)
        instance.on_ended = None if events is None else functools.partial(events.ended, index)
        instance.on_start_failed = (
            None if events is None else functools.partial(events.start_failed, index)
        )


def _instance(instance: Any) -> dict[str, Any]:
    return {
        "numa": instance.numa_node,
        "timeout": instance.execution_timeout_s,
        "launch": instance.launch,
        "ready": instance.state is State.READY,
        "failure": instance.start_failure,
    }


class _Events:
    """A shared version's instance events, to every front-end."""

    def __init__(self, sharing: SharedQueues, token: int, served: ServedVersion) -> None:
        self._sharing = sharing
        self._token = token
        self._served = served

    def ready(self, index: int) -> None:
        launch = self._served.instances[index].launch
        self._sharing.event(self._token, index, {"event": "ready", "launch": launch})

    def ended(self, index: int, death: deaths.Death) -> None:
        instance = self._served.instances[index]
        event = {"event": "ended", "how": death.how, "fate": death.fate.value}
        worker = f"{instance.spec.instance_name} (pid {instance.pid})"
        self._sharing.event(self._token, index, {**event, "blamed": death.blamed, "worker": worker})

    def start_failed(self, index: int) -> None:
        failure = self._served.instances[index].start_failure
        self._sharing.event(self._token, index, {"event": "failed", "failure": failure})
