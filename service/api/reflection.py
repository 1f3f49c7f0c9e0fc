"""Server reflection v1alpha (grpcio-reflection) and v1 (the same messages under the stable
package, which grpcio-reflection lacks), so grpcurl and newer tools both work."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any

from grpc_reflection.v1alpha import _async as alpha_async
from grpc_reflection.v1alpha import reflection_pb2 as alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as alpha_grpc

from protos.grpc.reflection.v1 import reflection_pb2 as v1_pb2
from protos.grpc.reflection.v1 import reflection_pb2_grpc as v1_grpc
from service.inference.errors import ServicerContext

SERVICE_NAMES = (
    alpha_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name,
    v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name,
)


class _ReflectionServicer(alpha_async.ReflectionServicer):  # type: ignore[misc]
    """Also resolves `package.Service.Method` symbols, which upb's descriptor pool does not
    find (grpc/grpc#34743), so `grpcurl describe SERVICE.METHOD` works."""

    def _file_containing_symbol(self, request: Any, fully_qualified_name: str) -> Any:
        service, _, method = fully_qualified_name.rpartition(".")
        try:
            self._pool.FindFileContainingSymbol(fully_qualified_name)
        except KeyError:
            with contextlib.suppress(KeyError):
                if method in self._pool.FindServiceByName(service).methods_by_name:
                    fully_qualified_name = service
        return super()._file_containing_symbol(request, fully_qualified_name)


class ReflectionV1Servicer(v1_grpc.ServerReflectionServicer):
    def __init__(self, alpha: alpha_async.ReflectionServicer) -> None:
        self._alpha = alpha

    async def ServerReflectionInfo(
        self,
        request_iterator: AsyncIterable[v1_pb2.ServerReflectionRequest],
        context: ServicerContext,
    ) -> AsyncIterator[v1_pb2.ServerReflectionResponse]:
        async def as_alpha() -> AsyncIterator[alpha_pb2.ServerReflectionRequest]:
            async for request in request_iterator:
                yield alpha_pb2.ServerReflectionRequest.FromString(request.SerializeToString())

        async for response in self._alpha.ServerReflectionInfo(as_alpha(), context):
            yield v1_pb2.ServerReflectionResponse.FromString(response.SerializeToString())


def add_reflection(server: Any, service_names: Sequence[str]) -> None:
    """Register both reflection versions on any server with grpc's registration methods."""
    names = (*service_names, *SERVICE_NAMES)
    alpha = _ReflectionServicer(names)
    alpha_grpc.add_ServerReflectionServicer_to_server(alpha, server)
    v1_grpc.add_ServerReflectionServicer_to_server(ReflectionV1Servicer(alpha), server)
