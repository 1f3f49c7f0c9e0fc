"""The `paddlequic perf` subcommand: flags (perf_analyzer's names where they exist), the
steps to run, progress on stderr, the table on stdout, and the -f file."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

MAX_CONCURRENCY = 4096
DEFAULT_OUTPUT_BYTES = 102400  # perf_analyzer's --output-shared-memory-size
CONNECT_EACH = {"full": ("full",), "0rtt": ("0rtt",), "both": ("full", "0rtt")}


def parse_concurrency(text: str) -> list[int]:
    """`START:END[:STEP]` (STEP added, or `xN` multiplied; default 1) or a list `1,4,16`."""
    try:
        if ":" not in text:
            levels = [int(v) for v in text.split(",")]
        else:
            start_text, end_text, *step = text.split(":")
            start, end, levels = int(start_text), int(end_text), []
            stride = step[0] if step else "1"
            factor = int(stride[1:]) if stride.startswith("x") else None
            increment = None if factor else int(stride)
            if (factor is not None and factor < 2) or (increment is not None and increment < 1):
                raise ValueError
            level = start
            while level <= end:
                levels.append(level)
                level = level * factor if factor else level + (increment or 1)
            if levels and levels[-1] != end and factor:
                levels.append(end)
    except ValueError:
        levels = []
    if not levels or any(not 1 <= v <= MAX_CONCURRENCY for v in levels) or len(levels) > 64:
        raise ValueError(
            f"--concurrency-range takes START:END[:STEP] (STEP n or xN) or a list like 1,4,16, "
            f"each level 1..{MAX_CONCURRENCY}; got {text!r}"
        )
    return levels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model")
    parser.add_argument("--model-version", default="", help="version; the newest ready if omitted")
    parser.add_argument(
        "--concurrency-range",
        default="1",
        help="concurrent requests per step: START:END[:STEP], STEP added or xN multiplied "
        "(1:64:x2), or a list 1,4,16 (default 1)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=5.0,
        help="seconds measured per step (default %(default)s)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=1.0,
        help="seconds of load before each measurement (default %(default)s)",
    )
    parser.add_argument(
        "-b", "--batch-size", type=int, default=1, help="rows per request (default %(default)s)"
    )
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME:d0,d1,...",
        help="dims of an input with variable dims (without the batch dim), repeatable",
    )
    parser.add_argument(
        "--input-data",
        default="random",
        help="random, zero, or a directory holding NAME.npy per input (sent as is)",
    )
    parser.add_argument("--streaming", action="store_true", help="send over ModelStreamInfer")
    parser.add_argument(
        "--connect-each",
        choices=sorted(CONNECT_EACH),
        help="a new connection per request: full handshakes, 0rtt (h3: resumed from a "
        "session ticket, request in 0-RTT early data) or both, one after the other",
    )
    parser.add_argument(
        "--shared-memory",
        choices=("none", "system"),
        default="none",
        help="system: the inputs in a POSIX shared-memory region and the outputs written into "
        "regions (the server must be on this host); none: in the messages (default)",
    )
    parser.add_argument(
        "--output-shared-memory-size",
        type=int,
        default=DEFAULT_OUTPUT_BYTES,
        help="bytes of each output's region with --shared-memory system (default %(default)s)",
    )
    parser.add_argument(
        "--percentile",
        type=int,
        action="append",
        default=[],
        help="also report this latency percentile (50, 90 and 99 always are), repeatable",
    )
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds per request (default %(default)s)"
    )
    parser.add_argument(
        "--server-metrics",
        default="",
        metavar="URL",
        help="the server's Prometheus endpoint (http://HOST:8002/metrics): adds its CPU time "
        "per request",
    )
    parser.add_argument(
        "-f", "--filename", type=Path, help="write the results: FILE.json, else CSV"
    )


def run(args: argparse.Namespace, metadata: list[tuple[str, str]]) -> int:
    from clients.targets import parse_url

    levels = parse_concurrency(args.concurrency_range)
    target = parse_url(args.url)
    connects = CONNECT_EACH[args.connect_each] if args.connect_each else ("reuse",)
    if "0rtt" in connects and target.scheme != "h3":
        raise ValueError("--connect-each 0rtt needs an h3:// URL (0-RTT is QUIC's)")
    if args.streaming and args.connect_each:
        raise ValueError("--streaming keeps one stream open: it cannot --connect-each")
    if args.batch_size < 1 or args.duration <= 0 or args.warmup < 0 or args.timeout <= 0:
        raise ValueError("--batch-size, --duration and --timeout must be positive")
    if any(not 0 < p < 100 for p in args.percentile):
        raise ValueError("--percentile takes a number between 1 and 99")
    return asyncio.run(_run(args, metadata, levels, connects))


async def _run(
    args: argparse.Namespace,
    metadata: list[tuple[str, str]],
    levels: list[int],
    connects: tuple[str, ...],
) -> int:
    from clients.inference_client import AsyncInferenceClient

    async with contextlib.AsyncExitStack() as held:
        client = await held.enter_async_context(
            AsyncInferenceClient(
                args.url, args.ca_file, None, args.client_cert, args.client_key, metadata
            )
        )
        info = await client.metadata(args.model, args.model_version)
        config = await _config(client, args.model, args.model_version, info)
        return await _measure(args, metadata, levels, connects, held, client, info, config)


async def _measure(
    args: argparse.Namespace,
    metadata: list[tuple[str, str]],
    levels: list[int],
    connects: tuple[str, ...],
    held: contextlib.AsyncExitStack,
    client: Any,
    info: Any,
    config: _Config,
) -> int:
    """The steps, with `client` open (`held`: where shared-memory regions stay registered
    while they run)."""
    from clients.perf.inputs import model_inputs, parse_shapes, serialized_request
    from clients.perf.load import LoadSpec, run_step
    from clients.perf.report import PERCENTILES, summarize, table, write
    from clients.perf.shared_memory import placed_request
    from clients.streaming import EMPTY_FINAL_RESPONSE

    shapes = parse_shapes(args.shape)
    if config.decoupled and not args.streaming:
        raise ValueError(
            f"model {args.model!r} is decoupled (many responses per request, ModelStreamInfer "
            "only): measure it with --streaming"
        )
    inputs = model_inputs(
        info, config.batched, args.batch_size, shapes, args.input_data, optional=config.optional
    )
    if not config.batched and args.batch_size != 1:
        raise ValueError(f"model {args.model!r} does not batch: leave out --batch-size")
    # A decoupled request's end is then always marked, whatever its model's last response was.
    parameters = {EMPTY_FINAL_RESPONSE: True} if config.decoupled else {}
    if args.shared_memory == "system":
        outputs = [output.name for output in info.outputs]
        placed = placed_request(
            client.stub,
            metadata,
            args.model,
            args.model_version,
            inputs,
            outputs,
            args.output_shared_memory_size,
            parameters,
        )
        request = await held.enter_async_context(placed)
    else:
        request = serialized_request(args.model, args.model_version, inputs, parameters)
    spec = LoadSpec(
        target=client.target,
        request=request,
        warmup_s=args.warmup,
        duration_s=args.duration,
        timeout_s=args.timeout,
        streaming=args.streaming,
        decoupled=config.decoupled,
        metadata=tuple(metadata),
        ca_file=args.ca_file,
        client_cert=args.client_cert,
        client_key=args.client_key,
        server_metrics=args.server_metrics,
    )
    percentiles = sorted({*PERCENTILES, *args.percentile})
    shape_text = ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in inputs.items())
    print(
        f"perf {args.model} at {args.url}: {shape_text}; {len(spec.request)} bytes per request"
        f"{', streaming' if args.streaming else ''}"
        f"{', tensors in shared memory' if args.shared_memory == 'system' else ''}",
        file=sys.stderr,
    )
    rows = []
    for level in levels:
        for connect in connects:
            step = await run_step(replace(spec, connect=connect), level, _Progress(level, connect))
            row = summarize(step, args.batch_size, percentiles, config.decoupled)
            rows.append(row)
            _done(row)
    print(table(rows))
    if args.filename is not None:
        run_info = {
            "model": args.model,
            "model_version": args.model_version,
            "url": args.url,
            "transport": "h3" if client.target.scheme == "h3" else "h2",
            "streaming": args.streaming,
            "shared_memory": args.shared_memory,
            "decoupled": config.decoupled,
            "batch_size": args.batch_size,
            "inputs": {
                k: {"shape": list(v.shape), "datatype": str(v.dtype)} for k, v in inputs.items()
            },
            "request_bytes": len(spec.request),
            "warmup_s": args.warmup,
            "duration_s": args.duration,
        }
        write(args.filename, rows, run_info)
    return 0 if all(r.requests for r in rows) else 1


@dataclass(frozen=True)
class _Config:
    batched: bool  # max_batch_size > 0
    decoupled: bool  # model_transaction_policy { decoupled: true }
    optional: frozenset[str]  # inputs a request may leave out


async def _config(client: Any, model: str, version: str, info: Any) -> _Config:
    """From ModelConfig; a server without that RPC: batched when every input has a variable
    first dim, neither decoupled nor with optional inputs."""
    import grpc

    from protos.inference import grpc_service_pb2 as pb

    try:
        response = await client.stub.ModelConfig(pb.ModelConfigRequest(name=model, version=version))
    except grpc.aio.AioRpcError as exc:
        if exc.code() not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED):
            raise
        return _Config(all(t.shape and t.shape[0] == -1 for t in info.inputs), False, frozenset())
    config = response.config
    return _Config(
        batched=config.max_batch_size > 0,
        decoupled=config.model_transaction_policy.decoupled,
        optional=frozenset(i.name for i in config.input if i.optional),
    )


class _Progress:
    """One self-overwriting line on a terminal; nothing when stderr is a file or pipe."""

    def __init__(self, level: int, connect: str) -> None:
        self.label = f"concurrency {level}" + ("" if connect == "reuse" else f", connect {connect}")
        self.tty = sys.stderr.isatty()

    def __call__(self, phase: str, elapsed: float, length: float, done: int, errors: int) -> None:
        if self.tty:
            line = f"{self.label}: {phase} {elapsed:4.1f}/{length:.1f} s, {done} requests"
            sys.stderr.write(f"\r\x1b[K{line}" + (f", {errors} errors" if errors else ""))
            sys.stderr.flush()


def _done(row: Any) -> None:
    p99 = row.latency_ms.get("p99")
    line = (
        f"concurrency {row.concurrency}{'' if row.connect == 'reuse' else ', ' + row.connect}: "
        f"{row.throughput:.1f} req/s, p99 {'-' if p99 is None else f'{p99:.2f}'} ms"
        + (f", errors {row.errors}" if row.errors else "")
    )
    sys.stderr.write(("\r\x1b[K" if sys.stderr.isatty() else "") + line + "\n")
