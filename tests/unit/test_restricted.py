"""Restricted protocols: parsing of --restricted-protocol, the category of every served RPC, the
header check, the repeatable flag with its environment variable, and the wrapped handlers of
every kind, which never run their behavior without the header."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from protos.inference import grpc_service_pb2
from protos.paddlequic.v1 import control_pb2
from service.api.restricted import (
    HEADER_PREFIX,
    RESTRICTABLE,
    RestrictedServer,
    Restriction,
    RestrictionError,
    category_of,
    parse_restrictions,
)
from service.settings import parse
from tests.unit.handler_kinds import (
    KINDS,
    REQUESTS,
    TRANSPORTS,
    Recorder,
    Request,
    Response,
    call,
    refused_requests,
    serving,
)

SECRET = "s3cret-Value"


def test_groups_give_each_category_its_header_and_value() -> None:
    restrictions = parse_restrictions(
        ["model-repository,control:Admin-Key=" + SECRET, "inference, health:infer-key=a:b=c"]
    )
    admin = Restriction(HEADER_PREFIX + "admin-key", SECRET.encode())
    assert restrictions == {
        "model-repository": admin,
        "control": admin,
        "inference": Restriction("triton-grpc-protocol-infer-key", b"a:b=c"),
        "health": Restriction("triton-grpc-protocol-infer-key", b"a:b=c"),
    }
    assert parse_restrictions([]) == {}


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("inference", "CATEGORIES:KEY=VALUE"),
        ("inference:key", "CATEGORIES:KEY=VALUE"),
        ("inference:=" + SECRET, "not a gRPC metadata key"),
        ("inference:bad key=" + SECRET, "not a gRPC metadata key"),
        ("inference:key-bin=" + SECRET, "not a gRPC metadata key"),
        ("inference:key=", "non-empty printable ASCII"),
        ("inference:key=caf\u00e9" + SECRET, "non-empty printable ASCII"),
        ("inference:key=line\n" + SECRET, "non-empty printable ASCII"),
        ("model-reposit:key=" + SECRET, "unknown restricted protocol 'model-reposit'"),
        ("inference,:key=" + SECRET, "unknown restricted protocol ''"),
    ],
)
def test_bad_specs_are_refused_without_showing_the_value(spec: str, error: str) -> None:
    with pytest.raises(RestrictionError, match=error) as refused:
        parse_restrictions([spec])
    assert SECRET not in str(refused.value)


def test_a_category_belongs_to_one_group_only() -> None:
    with pytest.raises(RestrictionError, match="'health' can not be specified in multiple"):
        parse_restrictions(["model-repository,health:k1=v1", "metadata,health:k2=v2"])


def test_every_served_rpc_has_tritons_category() -> None:
    inference = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    categories = {
        m.name: category_of(f"/{inference.full_name}/{m.name}") for m in inference.methods
    }
    assert categories == {
        "ServerLive": "health",
        "ServerReady": "health",
        "ModelReady": "health",
        "ServerMetadata": "metadata",
        "ModelMetadata": "metadata",
        "ModelInfer": "inference",
        "ModelStreamInfer": "inference",
        "ModelConfig": "model-config",
        "ModelStatistics": "statistics",
        "RepositoryIndex": "model-repository",
        "RepositoryModelLoad": "model-repository",
        "RepositoryModelUnload": "model-repository",
        "SystemSharedMemoryStatus": "shared-memory",
        "SystemSharedMemoryRegister": "shared-memory",
        "SystemSharedMemoryUnregister": "shared-memory",
        "CudaSharedMemoryStatus": "shared-memory",
        "CudaSharedMemoryRegister": "shared-memory",
        "CudaSharedMemoryUnregister": "shared-memory",
    }
    control = control_pb2.DESCRIPTOR.services_by_name["Control"]
    assert {category_of(f"/{control.full_name}/{m.name}") for m in control.methods} == {"control"}
    assert category_of("/grpc.health.v1.Health/Check") == "health"
    assert category_of("/grpc.health.v1.Health/Watch") == "health"
    assert set(categories.values()) | {"control"} <= set(RESTRICTABLE)


@pytest.mark.parametrize(
    "method",
    [
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "/paddlequic.v1.Testing/Unary",
        "/inference.GRPCInferenceService/NoSuchMethod",
    ],
)
def test_reflection_and_unknown_methods_belong_to_no_category(method: str) -> None:
    assert category_of(method) is None


def test_the_header_must_carry_the_exact_value() -> None:
    restriction = parse_restrictions(["inference:key=" + SECRET])["inference"]
    header = "triton-grpc-protocol-key"
    assert restriction.allows([(header, SECRET)])
    assert restriction.allows([("other", "x"), (header, "wrong"), (header, SECRET)])
    assert restriction.allows([(header, SECRET.encode())])
    assert not restriction.allows([])
    assert not restriction.allows([(header, SECRET[:-1])])
    assert not restriction.allows([(header, SECRET + "x")])
    assert not restriction.allows([(header, SECRET.upper())])
    assert not restriction.allows([("key", SECRET)])  # Triton's prefix is part of the name


def test_the_flag_repeats_and_replaces_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse([]).restricted_protocol == ()
    flags = ["--restricted-protocol", "inference:k=v", "--restricted-protocol", "control:a=b"]
    assert parse(flags).restricted_protocol == ("inference:k=v", "control:a=b")
    monkeypatch.setenv("PADDLEQUIC_RESTRICTED_PROTOCOL", "health:k=v; control:a=b;")
    assert parse([]).restricted_protocol == ("health:k=v", "control:a=b")
    assert parse(["--restricted-protocol", "inference:k=v"]).restricted_protocol == (
        "inference:k=v",
    )
    assert parse_restrictions(parse([]).restricted_protocol).keys() == {"health", "control"}


def test_security_defaults_fail_closed() -> None:
    settings = parse([])
    assert settings.metrics_host == "127.0.0.1"
    assert settings.tls_client_ca == ""
    assert not settings.require_client_cert


CONTROL = "paddlequic.v1.Control"  # every method of the service is in the `control` category
HEADER = HEADER_PREFIX + "key"


def register_restricted(
    handlers: dict[str, Any], restrictions: dict[str, Restriction], generic: bool
) -> Callable[[Any], None]:
    """Registration as generated code does it: registered method handlers, or a generic
    handler (the path grpc.aio and HTTP/3 look methods up through otherwise)."""

    def register(server: Any) -> None:
        restricted = RestrictedServer(server, restrictions)
        if generic:
            restricted.add_generic_rpc_handlers(
                [grpc.method_handlers_generic_handler(CONTROL, handlers)]
            )
        else:
            restricted.add_registered_method_handlers(CONTROL, handlers)

    return register


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("generic", [False, True], ids=["registered", "generic"])
@pytest.mark.parametrize("method", KINDS)
@pytest.mark.parametrize(
    "metadata",
    # the values compared: test_the_header_must_carry...; the key without its prefix
    [(), ((HEADER, SECRET[:-1]),), (("key", SECRET),)],
    ids=["none", "wrong", "unprefixed"],
)
async def test_a_restricted_handler_of_every_kind_never_runs_without_the_header(
    method: str,
    metadata: tuple[tuple[str, str], ...],
    generic: bool,
    transport: str,
    certs_dir: Path,
) -> None:
    recorder = Recorder()
    restrictions = parse_restrictions(["control:key=" + SECRET])
    register = register_restricted(recorder.handlers(), restrictions, generic)
    async with serving(register, transport, certs_dir) as channel:
        code, responses = await call(channel, CONTROL, method, metadata, refused_requests(method))
        assert (code, responses) == (grpc.StatusCode.UNAUTHENTICATED, [])
        assert (recorder.started, recorder.seen) == ([], [])
        code, responses = await call(channel, CONTROL, method, [(HEADER, SECRET)])
    assert code == grpc.StatusCode.OK
    request_streaming = KINDS[method][0]
    assert recorder.seen == [(method, r) for r in (REQUESTS if request_streaming else REQUESTS[:1])]


@pytest.mark.parametrize("method", KINDS)
async def test_categories_not_restricted_run_without_a_header(method: str) -> None:
    recorder = Recorder()
    restrictions = parse_restrictions(["inference,health:key=" + SECRET])
    register = register_restricted(recorder.handlers(), restrictions, generic=False)
    async with serving(register) as channel:
        code, _ = await call(channel, CONTROL, method)
    assert code == grpc.StatusCode.OK
    assert recorder.ran(method)


async def test_a_synchronous_unary_behavior_runs_only_after_the_check() -> None:
    """grpc allows plain functions as behaviors; the guard makes them async too."""
    ran: list[Any] = []

    def unary(request: Any, context: Any) -> Any:
        ran.append(request)
        return Response(messages=1)

    handler = grpc.unary_unary_rpc_method_handler(
        unary,
        request_deserializer=Request.FromString,
        response_serializer=Response.SerializeToString,
    )
    restrictions = parse_restrictions(["control:key=" + SECRET])
    async with serving(register_restricted({"Unary": handler}, restrictions, False)) as channel:
        assert (await call(channel, CONTROL, "Unary"))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert ran == []
        code, responses = await call(channel, CONTROL, "Unary", [(HEADER, SECRET)])
    assert (code, responses, ran) == (grpc.StatusCode.OK, [Response(messages=1)], [REQUESTS[0]])
