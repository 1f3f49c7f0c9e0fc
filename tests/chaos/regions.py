"""An attack on the system shared-memory extension by another user of the server's host: a
good client (the server's user, root) keeps its tensor in an object only it may open, and a
region registered on it; a process running as uid 65534 registers that object under its own
name, names the region in ModelInfer (to read the tensor and write over it), asks for its
status and unregisters it, round after round on both transports. Every call must fail as if
the region did not exist, or do nothing, and the region and its object stay the victim's."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import grpc

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from service.inference.shared_memory import SHM_DIR
from tests.call_as import run_as
from tests.chaos.frontends import frontend_restarts
from tests.chaos.harness import (
    GOOD_MODEL,
    MLP_OUTPUT,
    TRANSPORTS,
    AttackResult,
    Scale,
    Target,
)
from tests.reference import example_inputs

ATTACKER_UID = 65534
VICTIM = "victim"
UNREGISTER = "SystemSharedMemoryUnregister"


def _placed(request: pb.ModelInferRequest, byte_size: int, output_bytes: int) -> None:
    """The request's input read from the victim's region, its output written after it."""
    tensor = request.inputs[0]
    tensor.parameters["shared_memory_region"].string_param = VICTIM
    tensor.parameters["shared_memory_byte_size"].int64_param = byte_size
    output = request.outputs.add(name=MLP_OUTPUT)
    output.parameters["shared_memory_region"].string_param = VICTIM
    output.parameters["shared_memory_byte_size"].int64_param = output_bytes
    output.parameters["shared_memory_offset"].int64_param = byte_size


async def region_misuse(target: Target, scale: Scale) -> AttackResult:
    result = AttackResult()
    inputs = example_inputs(GOOD_MODEL, seed=77)
    array = inputs["input"]
    key = f"/pq-chaos-{secrets.token_hex(4)}"
    path = Path(SHM_DIR) / key.lstrip("/")
    async with target.channel("h2") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        plain = await stub.ModelInfer(build_request(GOOD_MODEL, inputs), timeout=30)
        expected = plain.raw_output_contents[0]
        path.write_bytes(array.tobytes() + bytes(len(expected)))
        path.chmod(0o600)
        before = path.read_bytes()
        try:
            register = pb.SystemSharedMemoryRegisterRequest(
                name=VICTIM, key=key, byte_size=len(before)
            )
            await stub.SystemSharedMemoryRegister(register, timeout=10)
            stolen = build_request(GOOD_MODEL, inputs)
            _placed(stolen, array.nbytes, len(expected))
            del stolen.raw_input_contents[:]
            rounds: list[tuple[str, Any]] = [
                (
                    "SystemSharedMemoryRegister",
                    pb.SystemSharedMemoryRegisterRequest(
                        name="mine", key=key, byte_size=len(before)
                    ),
                ),
                ("ModelInfer", stolen),
                ("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest(name=VICTIM)),
                (UNREGISTER, pb.SystemSharedMemoryUnregisterRequest(name=VICTIM)),
            ] * scale.region_misuse
            for transport, method, code in await _as_attacker(target, scale, rounds):
                # Unregistering a name one does not hold is no error (Triton's behaviour).
                label = "unregistered nothing" if method == UNREGISTER and code == "OK" else code
                result.outcomes[f"{transport} {label}"] += 1
            status = await stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
            if VICTIM not in status.regions:
                result.problems.append("the victim's region is gone")
            if path.read_bytes() != before:
                result.problems.append("the victim's object changed")
            # The victim still uses its region: the model's answer lands in it.
            own = build_request(GOOD_MODEL, inputs)
            _placed(own, array.nbytes, len(expected))
            del own.raw_input_contents[:]
            try:
                await stub.ModelInfer(own, timeout=30)
            except grpc.aio.AioRpcError as error:
                result.problems.append(f"the victim cannot use its region: {error.code().name}")
            else:
                if path.read_bytes()[array.nbytes :] != expected:
                    result.problems.append("the victim's output in its region is not the model's")
        finally:
            await stub.SystemSharedMemoryUnregister(
                pb.SystemSharedMemoryUnregisterRequest(name=VICTIM), timeout=10
            )
            path.unlink()
    return result


CHURNED = 8  # names the churning user registers and unregisters, round after round


async def region_churn(target: Target, scale: Scale) -> AttackResult:
    """Another user registers and unregisters regions as fast as it can, round after round on
    both transports (every register and unregister is told to each front-end, and an
    unregister waits for each to let go): each is answered, and no front-end is ended for
    not letting go in time (their restarts do not move)."""
    result = AttackResult()
    key = f"/pq-churn-{secrets.token_hex(4)}"
    path = Path(SHM_DIR) / key.lstrip("/")
    path.write_bytes(bytes(4096))
    path.chmod(0o644)  # the churning user may read it: registering it is its right
    restarts_before = frontend_restarts(target)
    try:
        rounds: list[tuple[str, Any]] = []
        for name in (f"churn-{n}" for n in range(CHURNED)):
            register = pb.SystemSharedMemoryRegisterRequest(name=name, key=key, byte_size=4096)
            rounds.append(("SystemSharedMemoryRegister", register))
        rounds.append((UNREGISTER, pb.SystemSharedMemoryUnregisterRequest()))  # all of its own
        rounds *= scale.region_misuse
        for transport, method, code in await _as_attacker(target, scale, rounds):
            action = method.removeprefix("SystemSharedMemory")
            result.outcomes[f"{transport} {action} {code}"] += 1
    finally:
        path.unlink()
    restarts = frontend_restarts(target) - restarts_before
    if restarts:
        result.problems.append(f"{restarts:g} front-end(s) ended while regions churned")
    return result


async def _as_attacker(
    target: Target, scale: Scale, calls: list[tuple[str, Any]]
) -> list[tuple[str, str, str]]:
    """Each call's transport, method and status code name, the calls made in turn by a
    process of ATTACKER_UID on each transport."""
    answered = []
    for transport in TRANSPORTS:
        answers = await asyncio.to_thread(
            run_as,
            ATTACKER_UID,
            transport,
            target.address,
            calls,
            target.ca_file,
            scale.attack_limit_s,
        )
        for (method, _), (code, _) in zip(calls, answers, strict=True):
            answered.append((transport, method, code))
    return answered
