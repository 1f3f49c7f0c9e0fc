"""`make bench-transport`: gRPC over HTTP/3 against gRPC over HTTP/2, same server, same run.

Measures ModelInfer requests/s at concurrency 1 and 64 and ModelStreamInfer messages/s (64 in
flight on one stream) on the small `mlp` model, plus CPU time per request of the server's
front-end process and of this client process. Machines are noisy, so the result that matters
is the HTTP/3 / HTTP/2 ratio taken minutes apart on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from clients.inference_client import build_request
from clients.quic_channel import QuicChannel
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from scripts.bench_common import closed_loop, process_cpu_seconds, write_json
from tests.servers import ServerProcess, model_repository

Load = Callable[[float], Awaitable[int]]


@dataclass
class Measurement:
    transport: str
    workload: str
    concurrency: int
    count: int
    seconds: float
    per_second: float
    server_cpu_us_per_call: float
    client_cpu_us_per_call: float


async def measure(
    transport: str,
    workload: str,
    concurrency: int,
    duration: float,
    server_pid: int,
    run: Load,
) -> Measurement:
    await run(min(duration / 4, 1.0))  # warm-up: connections, predictor shapes
    server0, client0, t0 = process_cpu_seconds(server_pid), time.process_time(), time.perf_counter()
    count = await run(duration)
    seconds = time.perf_counter() - t0
    server_cpu = process_cpu_seconds(server_pid) - server0
    client_cpu = time.process_time() - client0
    result = Measurement(
        transport,
        workload,
        concurrency,
        count,
        round(seconds, 3),
        round(count / seconds, 1),
        round(server_cpu / count * 1e6, 1),
        round(client_cpu / count * 1e6, 1),
    )
    print(
        f"  {transport} {workload:<12} c={concurrency:<3} {result.per_second:>9.1f}/s", flush=True
    )
    return result


def unary_load(stub: Any, request: pb.ModelInferRequest, concurrency: int) -> Load:
    async def run(duration: float) -> int:
        return len(await closed_loop(stub, request, concurrency, duration))

    return run


def stream_load(stub: Any, request: pb.ModelInferRequest, window: int) -> Load:
    async def run(duration: float) -> int:
        end = time.perf_counter() + duration
        credit = asyncio.Semaphore(window)
        sent = 0

        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            nonlocal sent
            while time.perf_counter() < end:
                await credit.acquire()
                sent += 1
                yield request

        received = 0
        async for response in stub.ModelStreamInfer(requests()):
            if response.error_message:
                raise RuntimeError(response.error_message)
            received += 1
            credit.release()
        return received

    return run


async def bench(server: ServerProcess, ca_file: Path, duration: float) -> list[Measurement]:
    request = build_request("mlp", {"input": np.ones((1, 256), np.float32)})
    options = [("grpc.max_receive_message_length", 64 << 20)]
    results = []
    for transport in ("h2", "h3"):
        channel: Any = (
            grpc.aio.insecure_channel(server.address, options=options)
            if transport == "h2"
            else QuicChannel(f"localhost:{server.port}", ca_file=str(ca_file))
        )
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        pid = server.process.pid
        for concurrency in (1, 64):
            load = unary_load(stub, request, concurrency)
            results.append(await measure(transport, "ModelInfer", concurrency, duration, pid, load))
        load = stream_load(stub, request, 64)
        results.append(await measure(transport, "StreamInfer", 64, duration, pid, load))
        await channel.close()
    return results


def table(results: list[Measurement]) -> str:
    rows = [
        f"{'workload':<12} {'conc':>4} {'h2 /s':>9} {'h3 /s':>9} {'h3/h2':>6} "
        f"{'srv us/call h2':>14} {'h3':>6} {'cli us/call h2':>14} {'h3':>6}"
    ]
    h2 = {(m.workload, m.concurrency): m for m in results if m.transport == "h2"}
    for m in (m for m in results if m.transport == "h3"):
        ref = h2[(m.workload, m.concurrency)]
        rows.append(
            f"{m.workload:<12} {m.concurrency:>4} {ref.per_second:>9.0f} {m.per_second:>9.0f} "
            f"{m.per_second / ref.per_second:>6.2f} {ref.server_cpu_us_per_call:>14.0f} "
            f"{m.server_cpu_us_per_call:>6.0f} {ref.client_cpu_us_per_call:>14.0f} "
            f"{m.client_cpu_us_per_call:>6.0f}"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per measurement")
    parser.add_argument("--out", type=Path, default=Path("bench-results/transport.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repository = model_repository(Path(tmp) / "models", ["mlp"])
        certs = Path(tmp) / "certs"
        print("starting the server (mlp only) ...", flush=True)
        server = ServerProcess(repository, Path(tmp) / "server.log", ["--certs-dir", str(certs)])
        try:
            server.wait_ready()
            print(f"measuring, {args.duration:.0f} s each:", flush=True)
            results = asyncio.run(bench(server, certs / "ca.pem", args.duration))
        finally:
            server.stop()
    print()
    print(table(results))
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
