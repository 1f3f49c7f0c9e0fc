"""Attacks on the worker processes behind the front-end: SIGKILL and SIGSTOP under load, an
input that crashes the predictor, hot reload under load, and a hostile Python model that
attacks the front-end from its worker (an oversized message on its socket, a flood of
printed lines)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import grpc
import numpy as np

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1 import control_pb2, control_pb2_grpc
from tests.chaos.harness import (
    EXECUTION_TIMEOUT_MS,
    GOOD_MODEL,
    HOSTILE_MODEL,
    POISON_VALUE,
    PROCESS_COUNT,
    PROCESSES_MODEL,
    SCRIBBLE_VALUE,
    SCRIBBLER_MODEL,
    AttackResult,
    Scale,
    Target,
    outcome_of,
)
from tests.servers import alive, children

RESTART_LIMIT_S = 60.0
RELOAD_TIMEOUT_S = 120.0
# A replaced version's workers end once their requests are answered: half the wind-down
# timeout (60 s, which only a request still held, or a count that never came down, waits for).
REPLACED_LIMIT_S = 30.0
# After a reload starts, when the preloaded launcher is killed: while it forks the new worker.
LAUNCHER_KILL_AFTER_S = 0.2
STOP_RESTART_S = 10.0  # after the watchdog fired: a new mlp worker starts in seconds
POLL_S = 0.05
HOSTILE_CALL_S = 60.0
# What a flood of printed lines may add to the server's log: the model's budget (100 lines and
# 64 KiB per second by default, 10 s' worth at once) and the lines saying what was dropped,
# far below the flood (over 100 bytes a line once logged).
LOG_GROWTH_LIMIT = 1 << 20


async def instances(target: Target, model: str = GOOD_MODEL) -> list[control_pb2.Instance]:
    async with grpc.aio.insecure_channel(target.address) as channel:
        response = await control_pb2_grpc.ControlStub(channel).ListInstances(
            control_pb2.ListInstancesRequest(model_name=model), timeout=10
        )
    return list(response.instances)


def _parent(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""
    return next((line.split()[1] for line in status.splitlines() if line.startswith("PPid:")), "")


def _preloaded_launcher(target: Target) -> int | None:
    """The server's preloaded launcher (service/workers/preloaded.py), if it runs one."""
    running = children(target.pid).items()
    return next((pid for pid, command in running if "service.workers.preloaded" in command), None)


def _ancestors(pid: int, count: int) -> list[int]:
    """Up to `count` processes above `pid`, its parent first."""
    found: list[int] = []
    while len(found) < count and (parent := _parent(pid)):
        pid = int(parent)
        found.append(pid)
    return found


def _signal_worker(target: Target, pid: int, sig: signal.Signals) -> bool:
    """Signal `pid` only while it is still a worker of the server, under its launcher, which
    the server, its preloaded launcher or a model template forked from that started (never a
    reused pid)."""
    if target.pid not in _ancestors(pid, 4)[1:]:
        return False
    os.kill(pid, sig)
    return True


async def _victim(target: Target, model: str = GOOD_MODEL) -> control_pb2.Instance:
    """A READY instance of `model` (by default the good clients', while they keep it busy)."""
    deadline = time.monotonic() + RESTART_LIMIT_S
    while time.monotonic() < deadline:
        ready = [i for i in await instances(target, model) if i.state == "READY" and i.pid > 0]
        if ready:
            return max(ready, key=lambda i: i.outstanding)
        await asyncio.sleep(POLL_S)
    raise TimeoutError(f"no READY {model} instance within {RESTART_LIMIT_S} s")


async def _replaced(
    target: Target, victim: control_pb2.Instance, limit_s: float, model: str = GOOD_MODEL
) -> bool:
    """Until the victim's instance serves again from a new process (bounded)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for instance in await instances(target, model):
            if (
                instance.name == victim.name
                and instance.state == "READY"
                and instance.pid not in (0, victim.pid)
            ):
                return True
        await asyncio.sleep(POLL_S)
    return False


async def worker_sigkill(target: Target, scale: Scale) -> AttackResult:
    """SIGKILL a busy `mlp` worker, wait for its replacement, repeat."""
    result = AttackResult()
    for _ in range(scale.kills):
        victim = await _victim(target)
        if not _signal_worker(target, victim.pid, signal.SIGKILL):
            result.problems.append(f"worker {victim.pid} vanished before the kill")
            continue
        result.outcomes["killed"] += 1
        if await _replaced(target, victim, RESTART_LIMIT_S):
            result.outcomes["replaced"] += 1
        else:
            result.problems.append(f"killed worker not replaced within {RESTART_LIMIT_S} s")
    return result


async def template_sigkill(target: Target, scale: Scale) -> AttackResult:
    """SIGKILL the model template `mlp`'s two instances were forked from (service/workers/
    template.py) while the good clients keep them busy: both workers end with it and come back
    through a new template, their requests back in the queue, none charged as poison."""
    result = AttackResult()
    for _ in range(scale.kills):
        victim = await _victim(target)
        template = _template_of(target, victim.pid)
        if template is None:
            result.problems.append(f"worker {victim.pid} was not forked from a model template")
            continue
        os.kill(template, signal.SIGKILL)
        result.outcomes["killed"] += 1
        if await _replaced(target, victim, RESTART_LIMIT_S):
            result.outcomes["replaced"] += 1
        else:
            result.problems.append(f"worker not replaced within {RESTART_LIMIT_S} s")
    return result


def _template_of(target: Target, worker: int) -> int | None:
    """The model template a worker of the server was forked from (worker <- its launcher <-
    the template <- the preloaded launcher <- the server), if it was."""
    above = _ancestors(worker, 4)
    if len(above) < 4 or above[3] != target.pid:
        return None
    try:
        command = Path(f"/proc/{above[1]}/cmdline").read_bytes()
    except OSError:
        return None
    return above[1] if command.startswith(b"paddlequic model-template ") else None


async def worker_sigstop(target: Target, scale: Scale) -> AttackResult:
    """SIGSTOP a busy `mlp` worker: the execution watchdog must replace it. A worker that
    is still stopped after the wait is continued, so nothing is left hanging."""
    result = AttackResult()
    limit_s = EXECUTION_TIMEOUT_MS / 1000 + STOP_RESTART_S
    for _ in range(scale.stops):
        victim = await _victim(target)
        if not _signal_worker(target, victim.pid, signal.SIGSTOP):
            result.problems.append(f"worker {victim.pid} vanished before the stop")
            continue
        result.outcomes["stopped"] += 1
        try:
            if await _replaced(target, victim, limit_s):
                result.outcomes["replaced"] += 1
            else:
                result.problems.append(f"stopped worker not replaced within {limit_s:.0f} s")
        finally:
            _signal_worker(target, victim.pid, signal.SIGCONT)
    return result


def _triggering(model: str, value: float) -> pb.ModelInferRequest:
    """An `mlp`-shaped request holding a test-only trigger value (--testing-service)."""
    values = np.zeros((1, 256), np.float32)
    values[0, 0] = value
    return build_request(model, {"input": values})


async def scribbled_queues(target: Target, scale: Scale) -> AttackResult:
    """Requests that make `scribbler`'s worker write random bytes over all of its queues'
    shared memory (instance queues): each fails with a clear status, the worker is killed
    as misbehaving and replaced, and the good clients (another model) never notice."""
    result = AttackResult()
    request = _triggering(SCRIBBLER_MODEL, SCRIBBLE_VALUE)
    async with grpc.aio.insecure_channel(target.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(scale.poison):
            victim = await _victim(target, SCRIBBLER_MODEL)
            call = stub.ModelInfer(request, timeout=RESTART_LIMIT_S)
            result.outcomes[await outcome_of(call, RESTART_LIMIT_S)] += 1
            if await _replaced(target, victim, RESTART_LIMIT_S, SCRIBBLER_MODEL):
                result.outcomes["replaced"] += 1
            else:
                result.problems.append(f"scribbling worker not replaced within {RESTART_LIMIT_S} s")
    return result


async def poison_input(target: Target, scale: Scale) -> AttackResult:
    """Requests for the good clients' own model carrying its crash trigger: each must fail
    with a clear status (the worker dies and is replaced), and the good clients, whose
    requests may share the crashed batch, must not notice."""
    result = AttackResult()
    request = _triggering(GOOD_MODEL, POISON_VALUE)
    async with grpc.aio.insecure_channel(target.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(scale.poison):
            call = stub.ModelInfer(request, timeout=RESTART_LIMIT_S)
            result.outcomes[await outcome_of(call, RESTART_LIMIT_S)] += 1
    return result


def _touch_version(target: Target) -> None:
    """New modification times: the server sees a changed version and reloads it."""
    now = time.time_ns()
    for path in (target.repository / GOOD_MODEL / "1").iterdir():
        os.utime(path, ns=(now, now))


async def hot_reload(target: Target, scale: Scale) -> AttackResult:
    """RepositoryModelLoad of `mlp` after touching its files, repeatedly, under load: each
    reload starts new workers, and the replaced version's end once what they hold is answered
    (with front-ends, once each lets the version go), well before its wind-down timeout."""
    result = AttackResult()
    async with grpc.aio.insecure_channel(target.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(scale.reloads):
            before = {i.pid for i in await instances(target)}
            _touch_version(target)
            load = pb.RepositoryModelLoadRequest(model_name=GOOD_MODEL)
            call = stub.RepositoryModelLoad(load, timeout=RELOAD_TIMEOUT_S)
            outcome = await outcome_of(call, RELOAD_TIMEOUT_S)
            result.outcomes[outcome] += 1
            after = {i.pid for i in await instances(target)}
            if outcome == "OK" and not after - before:
                result.problems.append("the reload started no new worker process")
            if lingering := await _still_running(before - after, REPLACED_LIMIT_S):
                result.problems.append(
                    f"replaced workers {lingering} still running {REPLACED_LIMIT_S:.0f} s later"
                )
    return result


async def _still_running(pids: set[int], limit_s: float) -> list[int]:
    """Those of `pids` still running once all ended or `limit_s` passed."""
    deadline = time.monotonic() + limit_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    return sorted(pid for pid in pids if alive(pid))


async def launcher_sigkill(target: Target, scale: Scale) -> AttackResult:
    """SIGKILL the preloaded launcher while a reload of `mlp` loads its new worker from it:
    every Paddle worker ends with it, and they come back through a new launcher (the good
    clients' requests go back to the queue meanwhile). The reload may succeed (its worker
    started before the kill, or after it through the new launcher) or fail naming why; the
    version that served goes on serving either way."""
    result = AttackResult()
    async with grpc.aio.insecure_channel(target.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(scale.reloads):
            launcher = _preloaded_launcher(target)
            if launcher is None:
                result.problems.append("the server runs no preloaded launcher")
                return result
            _touch_version(target)
            load = pb.RepositoryModelLoadRequest(model_name=GOOD_MODEL)
            call = stub.RepositoryModelLoad(load, timeout=RELOAD_TIMEOUT_S)
            await asyncio.sleep(LAUNCHER_KILL_AFTER_S)  # the new worker is being started
            os.kill(launcher, signal.SIGKILL)
            result.outcomes["killed"] += 1
            result.outcomes[f"reload {await outcome_of(call, RELOAD_TIMEOUT_S)}"] += 1
            if not await _served_by_new_launcher(target, launcher, RESTART_LIMIT_S):
                result.problems.append(
                    f"mlp not served from a new preloaded launcher within {RESTART_LIMIT_S} s"
                )
    return result


async def _served_by_new_launcher(target: Target, old: int, limit_s: float) -> bool:
    """Until a READY `mlp` instance runs in a worker forked from a preloaded launcher other
    than `old` (bounded): a worker forked from the old one just before the kill may still be
    READY for a moment, until its launcher ends it."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for instance in await instances(target):
            if instance.state != "READY" or instance.pid <= 0:
                continue
            # Its launcher's parent: the preloaded launcher, or a model template forked from it.
            current = _preloaded_launcher(target)
            if current not in (None, old) and current in _ancestors(instance.pid, 3)[1:]:
                return True
        await asyncio.sleep(POLL_S)
    return False


def _hostile(action: str) -> pb.ModelInferRequest:
    return build_request(HOSTILE_MODEL, {"action": np.array([action.encode()], np.object_)})


async def oversized_worker_message(target: Target, scale: Scale) -> AttackResult:
    """The hostile model writes a header declaring 1 GiB to its own worker socket, then zeros:
    the front-end reads the header alone (its RSS stays within the goal), fails the call with
    INTERNAL, kills the worker and counts it, and never runs the call again (one breach per
    call: a retry would meet a second)."""
    result = AttackResult()
    before = await asyncio.to_thread(
        target.model_counter, "paddlequic_worker_protocol_breaches", HOSTILE_MODEL
    )
    async with grpc.aio.insecure_channel(target.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(scale.worker_messages):
            victim = await _victim(target, HOSTILE_MODEL)
            call = stub.ModelInfer(_hostile("oversized"), timeout=HOSTILE_CALL_S)
            result.outcomes[await outcome_of(call, HOSTILE_CALL_S)] += 1
            if await _replaced(target, victim, RESTART_LIMIT_S, HOSTILE_MODEL):
                result.outcomes["replaced"] += 1
            else:
                result.problems.append(f"killed worker not replaced within {RESTART_LIMIT_S} s")
    breaches = await asyncio.to_thread(
        target.model_counter, "paddlequic_worker_protocol_breaches", HOSTILE_MODEL
    )
    result.notes["breaches"] = breaches - before
    if breaches - before != scale.worker_messages:
        result.problems.append(
            f"{breaches - before:g} protocol breaches counted for {scale.worker_messages} calls"
        )
    return result


async def model_output_flood(target: Target, scale: Scale) -> AttackResult:
    """The hostile model prints `scale.output_flood` empty lines and as many lines of text in
    one call: the call answers, every line is logged or counted as dropped, and the server's
    log grows by at most LOG_GROWTH_LIMIT."""
    result = AttackResult()
    name = "paddlequic_model_output_dropped_lines"
    before = await asyncio.to_thread(target.model_counter, name, HOSTILE_MODEL)
    log_before = target.log_path.stat().st_size
    async with grpc.aio.insecure_channel(target.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelInfer(_hostile(f"flood:{scale.output_flood}"), timeout=HOSTILE_CALL_S)
        result.outcomes[await outcome_of(call, HOSTILE_CALL_S)] += 1
    printed = 2 * scale.output_flood
    deadline = time.monotonic() + HOSTILE_CALL_S
    dropped = 0.0
    # The reader thread may still be on its way through the pipe: until (nearly) every line
    # is counted, bounded.
    while time.monotonic() < deadline:
        dropped = await asyncio.to_thread(target.model_counter, name, HOSTILE_MODEL) - before
        growth = target.log_path.stat().st_size - log_before
        if dropped >= printed - growth // 16:  # a line logged takes more than 16 bytes
            break
        await asyncio.sleep(POLL_S)
    growth = target.log_path.stat().st_size - log_before
    result.notes["dropped lines"] = dropped
    result.notes["log growth kB"] = round(growth / 1024, 1)
    if growth > LOG_GROWTH_LIMIT:
        result.problems.append(f"the log grew by {growth} bytes for {printed} lines printed")
    if dropped < printed - growth // 16:
        result.problems.append(f"{dropped:g} of {printed} lines counted as dropped")
    return result


MEMFD_ASKED_MB = 1500
MEMFD_BOUND_MB = 16  # RLIMIT_FSIZE in the sandbox (service/backend/python_sandbox.py)


async def _processes_call(target: Target, **probe: object) -> tuple[str, dict[str, str]]:
    """One call to the hostile model: its status, and its report when it answered."""
    text = np.array([json.dumps(probe).encode()], dtype=np.object_)
    request = build_request(PROCESSES_MODEL, {"probe": text})
    async with grpc.aio.insecure_channel(target.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            response = await stub.ModelInfer(request, timeout=RESTART_LIMIT_S)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, {}
    (report,) = parse_response(response)["report"].tolist()
    return "OK", json.loads(report)


async def fork_bomb(target: Target, scale: Scale) -> AttackResult:
    """300 forks from a model that may run PROCESS_COUNT processes: its launcher kills the
    worker and every one of them, and the request fails RESOURCE_EXHAUSTED (not retried)."""
    result = AttackResult()
    for _ in range(scale.fork_bombs):
        status, report = await _processes_call(target, attack="fork bomb", count=300)
        result.outcomes[status] += 1
        if status == "OK":
            result.problems.append(f"{report.get('forks')} forks past a count of {PROCESS_COUNT}")
    return result


async def memfd_bomb(target: Target, scale: Scale) -> AttackResult:
    """1,500 MiB asked of a memfd_create file: it stops at MEMFD_BOUND_MB."""
    result = AttackResult()
    for _ in range(scale.memfd_bombs):
        status, report = await _processes_call(target, attack="memfd bomb", mb=MEMFD_ASKED_MB)
        held = int(report.get("written mb", "0"))
        result.outcomes[f"stopped at {held} MiB" if status == "OK" else status] += 1
        if held > MEMFD_BOUND_MB:
            result.problems.append(f"a memfd file held {held} MiB")
    return result


async def orphaned_child(target: Target, scale: Scale) -> AttackResult:
    """A double-forked child in a session of its own, then its worker is killed: the child
    must end with it (the worker's launcher is its subreaper), and the worker come back."""
    result = AttackResult()
    for _ in range(scale.orphans):
        status, report = await _processes_call(target, attack="orphan")
        if status != "OK":
            result.outcomes[status] += 1
            continue
        orphan = int(report["orphan"])
        result.outcomes["orphaned"] += 1
        victim = await _victim(target, PROCESSES_MODEL)
        if not _signal_worker(target, victim.pid, signal.SIGKILL):
            result.problems.append(f"worker {victim.pid} vanished before the kill")
            continue
        result.outcomes["worker killed"] += 1
        if await _still_running({orphan}, RESTART_LIMIT_S):
            result.problems.append(f"orphan {orphan} outlived its worker")
        else:
            result.outcomes["orphan ended with its worker"] += 1
        if not await _replaced(target, victim, RESTART_LIMIT_S, PROCESSES_MODEL):
            result.problems.append(f"killed worker not replaced within {RESTART_LIMIT_S} s")
    return result
