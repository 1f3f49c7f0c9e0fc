"""`make bench-generate`: streaming generation with the `generate` example, three ways.

One server holds three copies of the example that differ only in their engine parameters:
`one` (generation_max_batch 1: one sequence at a time), `request` (request-level batching: a
batch is formed and every sequence in it runs to its end before the next joins) and
`iteration` (iteration-level: sequences join and leave between decode steps). At concurrency
1, 8 and 32, closed-loop clients each send one request after another on its own
ModelStreamInfer call, each with max_tokens drawn from 8..128 (the same draws for every way
in a round), and read every response: tokens/s over the measurement and time to first token
(the request written to its first response read). The iteration-level copy is also measured
over HTTP/3 (QUIC, TLS 1.3) against HTTP/2 (the server's plaintext TCP port), the same
streams. Before the server starts, the engine-only section (scripts/bench_generate_engine.py)
drives the same three ways in-process on the engine with the same LM and draws, no server:
the scheduling effect without the per-token serving cost.

Machines are noisy, so the ways alternate in rounds (each round rotates their order) and the
table shows each figure's median over the rounds with its spread, and the goal ratios taken
within each round.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf import text_format

from clients.inference_client import build_request
from clients.quic_channel import QuicChannel
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.inference import model_config_pb2 as mc
from scripts.bench_common import cpu_spent, tree_cpu, write_json
from scripts.bench_generate_engine import EngineBench, percentile
from service.backend.generation.engine import limits_from
from tests.servers import EXAMPLE_MODELS, ServerProcess

CONCURRENCY = (1, 8, 32)
MAX_TOKENS = (8, 128)  # drawn uniformly, both included
PROMPT = "Once upon a time"
# way -> engine parameters of its copy of the example
WAYS = {
    "one": {"generation_max_batch": "1", "generation_mode": "iteration"},
    "request": {"generation_max_batch": "32", "generation_mode": "request"},
    "iteration": {"generation_max_batch": "32", "generation_mode": "iteration"},
}
# (way, transport) measured in each round; the ratios compare the h2 ones, and the engine's
RUNS = (("one", "h2"), ("request", "h2"), ("iteration", "h2"), ("iteration", "h3"))
ENGINE_RUNS = tuple((way, "engine") for way in WAYS)
CALL_TIMEOUT_S = 300.0


@dataclass
class Measurement:
    round: int
    way: str
    transport: str
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    tokens_per_second: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    # Served runs: CPU per token of the server's processes (the one holding the streams, and
    # any front-ends) and of its workers (the engine: its steps and its own sending).
    server_us_per_token: float | None = None
    worker_us_per_token: float | None = None
    # Of server_us_per_token, the parent's (--frontends N: the streams' requests pass through
    # it; with one process it is the whole server's).
    parent_us_per_token: float | None = None


def repository(target: Path) -> Path:
    """Three copies of the exported example, named generate_WAY, with their parameters."""
    source = EXAMPLE_MODELS / "generate"
    if not (source / "1" / "lm").is_dir():
        raise SystemExit(f"{source} has no exported LM; run `make models`")
    for way, parameters in WAYS.items():
        name = f"generate_{way}"
        shutil.copytree(source, target / name)
        config = text_format.Parse((source / "config.pbtxt").read_text(), mc.ModelConfig())
        config.name = name
        for key, value in parameters.items():
            config.parameters[key].string_value = value
        (target / name / "config.pbtxt").write_text(text_format.MessageToString(config))
    return target


def open_channel(transport: str, server: ServerProcess, ca_file: Path) -> Any:
    if transport == "h2":
        return grpc.aio.insecure_channel(server.address)
    return QuicChannel(f"localhost:{server.port}", ca_file=str(ca_file))


async def one_request(stub: Any, model: str, max_tokens: int) -> tuple[int, float]:
    """(tokens received, seconds to the first one)."""
    request = build_request(
        model,
        {
            "text": np.array([PROMPT.encode()], np.object_),
            "max_tokens": np.array([max_tokens], np.int32),
        },
    )
    call = stub.ModelStreamInfer(timeout=CALL_TIMEOUT_S)
    start = time.perf_counter()
    await call.write(request)
    await call.done_writing()
    first, tokens = 0.0, 0
    async for response in call:
        if response.error_message:
            raise RuntimeError(response.error_message)
        if tokens == 0:
            first = time.perf_counter() - start
        if "text_delta" in {o.name for o in response.infer_response.outputs}:
            tokens += 1
    return tokens, first


async def measure(
    round_: int,
    way: str,
    transport: str,
    concurrency: int,
    duration: float,
    stub: Any,
    draws: Sequence[int],
    root: int,
) -> Measurement:
    """Closed loop for `duration`; requests started by then run to their end and count.
    `root`: the server's process, whose tree's CPU is read around it."""
    model = f"generate_{way}"
    end = time.perf_counter() + duration
    ttfts: list[float] = []
    totals = [0]
    lengths = iter(draws)

    async def client() -> None:
        while time.perf_counter() < end:
            tokens, first = await one_request(stub, model, next(lengths))
            totals[0] += tokens
            ttfts.append(first)

    before = tree_cpu(root)
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.perf_counter() - t0
    spent = cpu_spent(before, tree_cpu(root))
    result = measurement(round_, way, transport, concurrency, totals[0], seconds, ttfts)
    per_token = 1e6 / max(totals[0], 1)
    result.server_us_per_token = round((spent["main"] + spent["frontends"]) * per_token, 1)
    result.parent_us_per_token = round(spent["main"] * per_token, 1)
    result.worker_us_per_token = round(spent["workers"] * per_token, 1)
    report(result)
    return result


def measurement(
    round_: int,
    way: str,
    transport: str,
    concurrency: int,
    tokens: int,
    seconds: float,
    ttfts: Sequence[float],
) -> Measurement:
    """One run's figures, rounded for the table: `ttfts` in seconds, one per request."""
    return Measurement(
        round_,
        way,
        transport,
        concurrency,
        len(ttfts),
        tokens,
        round(seconds, 3),
        round(tokens / seconds, 1),
        round(percentile(ttfts, 50), 1),
        round(percentile(ttfts, 99), 1),
    )


def report(m: Measurement) -> None:
    cpu = (
        ""
        if m.server_us_per_token is None
        else f"  CPU/token: server {m.server_us_per_token:.0f} us (parent "
        f"{m.parent_us_per_token:.0f}), worker {m.worker_us_per_token:.0f} us"
    )
    print(
        f"  round {m.round} {m.way:<9} {m.transport:<6} c={m.concurrency:<3} {m.requests:>4} "
        f"requests {m.tokens_per_second:>8.1f} tokens/s  ttft p50 {m.ttft_p50_ms:>7.1f} ms "
        f"p99 {m.ttft_p99_ms:>7.1f} ms{cpu}",
        flush=True,
    )


async def bench(
    server: ServerProcess, ca_file: Path, rounds: int, duration: float, seed: int
) -> list[Measurement]:
    channels = {t: open_channel(t, server, ca_file) for t in ("h2", "h3")}
    stubs = {t: pb_grpc.GRPCInferenceServiceStub(c) for t, c in channels.items()}
    results: list[Measurement] = []
    try:
        for stub in stubs.values():  # warm-up: connections, every copy's shapes
            for way in WAYS:
                await asyncio.gather(*(one_request(stub, f"generate_{way}", 8) for _ in range(4)))
        for round_ in range(1, rounds + 1):
            draws = draws_of(seed, round_)
            for concurrency in CONCURRENCY:
                for way, transport in rotated(RUNS, round_):
                    results.append(
                        await measure(
                            round_,
                            way,
                            transport,
                            concurrency,
                            duration,
                            stubs[transport],
                            draws,
                            server.process.pid,
                        )
                    )
    finally:
        for channel in channels.values():
            await channel.close()
    return results


def rotated(runs: Sequence[tuple[str, str]], round_: int) -> list[tuple[str, str]]:
    """The runs in round `round_`'s order: each round starts one run later, so that no run
    always goes first."""
    shift = (round_ - 1) % len(runs)
    return [*runs[shift:], *runs[:shift]]


def draws_of(seed: int, round_: int) -> list[int]:
    """Enough max_tokens draws for any way's closed loop; every way takes them in order."""
    rng = np.random.default_rng(seed + round_)
    return [int(n) for n in rng.integers(MAX_TOKENS[0], MAX_TOKENS[1] + 1, 100_000)]


def bench_engine(rounds: int, duration: float, seed: int) -> list[Measurement]:
    """The three ways on the engine in-process, in alternating rounds like the server's."""
    engine = EngineBench(EXAMPLE_MODELS / "generate" / "1", PROMPT, 32)
    limits = {way: limits_from(parameters) for way, parameters in WAYS.items()}
    engine.warm_up(list(limits.values()))
    results = []
    for round_ in range(1, rounds + 1):
        draws = draws_of(seed, round_)
        for concurrency in CONCURRENCY:
            for way, transport in rotated(ENGINE_RUNS, round_):
                tokens, seconds, ttfts = engine.measure(limits[way], concurrency, duration, draws)
                result = measurement(round_, way, transport, concurrency, tokens, seconds, ttfts)
                report(result)
                results.append(result)
    return results


def spread(values: Sequence[float], digits: int = 0) -> str:
    """Median [lowest-highest]."""
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


def cpu(ms: Sequence[Measurement], part: str) -> str:
    values = [getattr(m, f"{part}_us_per_token") for m in ms]
    return "-" if None in values else spread(values)


def table(results: Sequence[Measurement]) -> str:
    by_key = {(m.round, m.way, m.transport, m.concurrency): m for m in results}
    rounds = sorted({m.round for m in results})
    rows = [
        f"{len(rounds)} rounds; median [lowest-highest] over rounds; ratios per round",
        "",
        "| way | transport | concurrency | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | "
        "server CPU us/token | of which the parent's | worker CPU us/token |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    runs = [run for run in (*RUNS, *ENGINE_RUNS) if (rounds[0], *run, 1) in by_key]
    for way, transport in runs:
        for c in CONCURRENCY:
            ms = [by_key[r, way, transport, c] for r in rounds]
            rows.append(
                f"| {way} | {transport} | {c} | {spread([m.tokens_per_second for m in ms])} | "
                f"{spread([m.ttft_p50_ms for m in ms], 1)} | "
                f"{spread([m.ttft_p99_ms for m in ms], 1)} | {cpu(ms, 'server')} | "
                f"{cpu(ms, 'parent')} | {cpu(ms, 'worker')} |"
            )

    def ratio(f: Any) -> str:
        return spread([f(r) for r in rounds], 2)

    def cpu_of(r: int, part: str, c: int = 32, t: str = "h2") -> float:
        value = getattr(by_key[r, "iteration", t, c], f"{part}_us_per_token")
        assert value is not None
        return float(value)

    def tps(r: int, way: str, c: int, transport: str = "h2") -> float:
        return by_key[r, way, transport, c].tokens_per_second

    def p99(r: int, c: int, transport: str = "h2") -> float:
        return by_key[r, "iteration", transport, c].ttft_p99_ms

    rows += ["", "| ratio (per round) | section | goal | measured |", "| --- | --- | --- | --- |"]
    for t in sorted({t for _, t in runs} - {"h3"}):
        rows += [
            f"| iteration / one-at-a-time tokens/s, c=32 | {t} | >= 4 | "
            f"{ratio(lambda r, t=t: tps(r, 'iteration', 32, t) / tps(r, 'one', 32, t))} |",
            f"| iteration / request-level tokens/s, c=32 | {t} | >= 1.5 | "
            f"{ratio(lambda r, t=t: tps(r, 'iteration', 32, t) / tps(r, 'request', 32, t))} |",
            f"| iteration TTFT p99 c=32 / c=1 | {t} | <= 3 | "
            f"{ratio(lambda r, t=t: p99(r, 32, t) / p99(r, 1, t))} |",
        ]
    if ("iteration", "h2") in runs:
        rows += [
            "| server / worker CPU per token (iteration), c=32 | h2 | <= 0.15 | "
            f"{ratio(lambda r: cpu_of(r, 'server') / cpu_of(r, 'worker'))} |",
        ]
    if ("iteration", "engine") in runs and ("iteration", "h2") in runs:
        rows.append(
            "| served / engine-only tokens/s (iteration), c=32 | h2 | - | "
            f"{ratio(lambda r: tps(r, 'iteration', 32) / tps(r, 'iteration', 32, 'engine'))} |"
        )
    if ("iteration", "h3") not in runs:
        return "\n".join(rows)
    for c in CONCURRENCY:
        rows.append(
            f"| h3 / h2 tokens/s (iteration), c={c} | h3 | - | "
            f"{ratio(lambda r, c=c: tps(r, 'iteration', c, 'h3') / tps(r, 'iteration', c))} |"
        )
        rows.append(
            f"| h3 / h2 TTFT p50 (iteration), c={c} | h3 | - | "
            f"{ratio(lambda r, c=c: by_key[r, 'iteration', 'h3', c].ttft_p50_ms / by_key[r, 'iteration', 'h2', c].ttft_p50_ms)} |"  # noqa: E501
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per measurement")
    parser.add_argument("--seed", type=int, default=0, help="of the max_tokens draws")
    parser.add_argument("--out", type=Path, default=Path("bench-results/generate.json"))
    parser.add_argument(
        "--frontends",
        type=int,
        default=1,
        help="the server's --frontends: with more than 1 the streams are held by front-end "
        "processes and pass through the parent (its CPU per token is its own column)",
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.duration <= 0 or args.frontends < 1:
        parser.error("--rounds and --frontends must be at least 1 and --duration positive")
    print("the engine alone, in-process ...", flush=True)
    results = bench_engine(args.rounds, args.duration, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        models = repository(Path(tmp) / "models")
        certs = Path(tmp) / "certs"
        print("starting the server (three copies of generate) ...", flush=True)
        extra = ["--certs-dir", str(certs), "--frontends", str(args.frontends)]
        server = ServerProcess(models, Path(tmp) / "server.log", extra)
        try:
            server.wait_ready()
            print(
                f"measuring: {args.rounds} rounds, {args.duration:g} s per measurement",
                flush=True,
            )
            results += asyncio.run(
                bench(server, certs / "ca.pem", args.rounds, args.duration, args.seed)
            )
        finally:
            server.stop()
    print()
    print(table(results))
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
