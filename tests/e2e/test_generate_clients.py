"""This project's clients on the `generate` example (a decoupled model: one response per token):
the numpy client's `generate` and `stream_infer`, sync and async, on both transports; leaving
the loop cancels the generation (the server's generated-token counter stops); `paddlequic
generate`; `paddlequic perf --streaming`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.generation import Chunk, generation_request
from clients.inference_client import AsyncInferenceClient, InferenceClient
from clients.streaming import StreamRequest
from protos.inference import grpc_service_pb2 as pb
from tests.reference import call_inputs
from tests.servers import (
    REPO_ROOT,
    ServerProcess,
    client_args,
    free_port,
    model_repository,
    paused,
    running_server,
)

MODEL = "generate"
PROMPT = "Once upon a time"
MAX_TOKENS = 12
PERF_MAX_TOKENS = 4
LONG_MAX_TOKENS = 200  # within the model's context (257 tokens with the prompt)
TIMEOUT_S = 120.0
SETTLE_LIMIT_S = 60.0
QUIET_S = 0.5
PROPERTY = settings(derandomize=True, max_examples=3, deadline=None)
# Long enough for a few short generations on a machine whose two cores run two test files.
QUICK = ["--duration", "2", "--warmup", "0.3"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("generate")
    repository = model_repository(root / "models", [MODEL, "mlp"])
    with running_server(repository, root / "log", ["--certs-dir", str(certs_dir)]) as process:
        yield process


def generated(server: ServerProcess, prompt: str, max_tokens: int = MAX_TOKENS) -> list[Chunk]:
    with InferenceClient(server.url) as client:
        return list(client.generate(MODEL, prompt, max_tokens, timeout=TIMEOUT_S))


def text_of(chunks: list[Chunk]) -> str:
    return "".join(c.text for c in chunks)


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> list[Chunk]:
    return generated(server, PROMPT)


def metrics_url(server: ServerProcess) -> str:
    found = re.search(r"metrics on (http://\S+/metrics)", server.log_text())
    assert found is not None
    return found.group(1)


def metric(server: ServerProcess, name: str) -> float:
    with urllib.request.urlopen(metrics_url(server), timeout=10) as response:
        text = response.read().decode()
    found = re.search(rf'^{name}\{{[^}}]*model="{MODEL}"[^}}]*\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def settled_tokens(server: ServerProcess) -> float:
    """The generated-token counter once no generation is active and it stopped changing (a
    cancelled request's worker may still send a token or two before it sees the Cancel;
    bounded wait)."""
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while metric(server, "paddlequic_active_generations") > 0:
        assert time.monotonic() < deadline, "a generation stayed active"
        time.sleep(0.05)
    last = metric(server, "paddlequic_generated_tokens_total")
    while True:
        time.sleep(QUIET_S)
        if (now := metric(server, "paddlequic_generated_tokens_total")) == last:
            return now
        assert time.monotonic() < deadline, "the token counter kept growing"
        last = now


def test_a_greedy_generation_is_one_response_per_token(reference: list[Chunk]) -> None:
    assert reference[-1].finish_reason in ("length", "stop")
    assert [c.finish_reason for c in reference[:-1]] == [None] * (len(reference) - 1)
    tokens = len(reference) - 1  # the final response carries only the finish reason
    assert 0 < tokens <= MAX_TOKENS
    assert tokens == MAX_TOKENS or reference[-1].finish_reason == "stop"


@pytest.mark.parametrize("transport", ["h2", "h3"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_generate_streams_the_same_text_on_every_path(
    server: ServerProcess, certs_dir: Path, reference: list[Chunk], transport: str, mode: str
) -> None:
    args = client_args(server, certs_dir, transport)
    if mode == "sync":
        with InferenceClient(**args) as client:
            chunks = list(client.generate(MODEL, PROMPT, MAX_TOKENS, timeout=TIMEOUT_S))
    else:

        async def run() -> list[Chunk]:
            async with AsyncInferenceClient(**args) as client:
                stream = client.generate(MODEL, PROMPT, MAX_TOKENS, timeout=TIMEOUT_S)
                return [c async for c in stream]

        chunks = asyncio.run(run())
    assert chunks == reference


@pytest.mark.parametrize("transport", ["h2", "h3"])
@PROPERTY
@given(prompts=st.lists(st.text("abcdefgh ", min_size=1, max_size=8), min_size=2, max_size=4))
def test_generations_on_one_stream_each_get_their_own_tokens(
    server: ServerProcess, certs_dir: Path, transport: str, prompts: list[str]
) -> None:
    """Several generations share a stream (and the engine's batch): each request's text is
    what it gets alone, and its final response comes last."""
    requests = [
        generation_request(MODEL, p, MAX_TOKENS, request_id=f"q{i}") for i, p in enumerate(prompts)
    ]
    with InferenceClient(**client_args(server, certs_dir, transport)) as client:
        responses = list(client.stream_infer(requests, timeout=TIMEOUT_S))
    for index, prompt in enumerate(prompts):
        own = [r for r in responses if r.request_id == f"q{index}"]
        assert [r.final for r in own] == [False] * (len(own) - 1) + [True]
        assert all(r.error is None for r in own)
        text = "".join(bytes(r.outputs["text_delta"][0]).decode() for r in own[:-1])
        assert text == text_of(generated(server, prompt))


def default_sigint() -> None:
    """A shell without job control starts background commands with SIGINT ignored, and a
    Python started so never raises KeyboardInterrupt: the CLI gets Ctrl-C's default here."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_active(server: ServerProcess) -> None:
    """Until the server runs a generation (bounded)."""
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while metric(server, "paddlequic_active_generations") < 1:
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.05)


def failed_requests(server: ServerProcess) -> int:
    request = pb.ModelStatisticsRequest(name=MODEL)
    (stats,) = server.stub.ModelStatistics(request, timeout=10).model_stats
    return int(stats.inference_stats.fail.count)


@pytest.mark.parametrize("transport", ["h2", "h3"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_leaving_the_loop_cancels_the_generation(
    server: ServerProcess, certs_dir: Path, transport: str, mode: str
) -> None:
    """A long generation and then an `mlp` request on one stream, while the generation
    worker is stopped: the loop leaves at mlp's answer, with the generation held by the
    server, and the worker resumes only after, the client (and its connection) still open.
    The generation must end cancelled (a failure in the model's statistics), its token
    counter stopping far short of what it asked for."""
    (instance,) = server.instances(MODEL)
    before, failures = settled_tokens(server), failed_requests(server)
    long = generation_request(MODEL, PROMPT, LONG_MAX_TOKENS, request_id="long")
    other = StreamRequest("mlp", call_inputs("mlp", 0), request_id="mlp")
    args = client_args(server, certs_dir, transport)

    def check_cancelled() -> None:
        after = settled_tokens(server)
        assert after - before < LONG_MAX_TOKENS / 2
        assert failed_requests(server) == failures + 1

    if mode == "sync":

        def produced() -> Iterator[StreamRequest]:
            yield long
            wait_active(server)
            yield other

        with InferenceClient(**args) as client:
            with paused(instance.pid):
                for response in client.stream_infer(produced(), timeout=TIMEOUT_S):
                    assert response.request_id == "mlp"
                    break
            check_cancelled()
        return

    async def run() -> None:
        async def produced() -> AsyncIterator[StreamRequest]:
            yield long
            await asyncio.to_thread(wait_active, server)
            yield other

        async with AsyncInferenceClient(**args) as client:
            with paused(instance.pid):
                responses = client.stream_infer(produced(), timeout=TIMEOUT_S)
                async with contextlib.aclosing(responses):
                    async for response in responses:
                        assert response.request_id == "mlp"
                        break
            await asyncio.to_thread(check_cancelled)

    asyncio.run(run())


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clients.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.mark.parametrize("transport", ["h2", "h3"])
def test_cli_generate_prints_the_text(
    server: ServerProcess, certs_dir: Path, reference: list[Chunk], transport: str
) -> None:
    args = client_args(server, certs_dir, transport)
    done = cli(
        "generate", MODEL, PROMPT, "--max-tokens", str(MAX_TOKENS), "--url", args["url"],
        "--ca-file", str(certs_dir / "ca.pem"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == text_of(reference) + "\n"
    assert f"[{reference[-1].finish_reason}: {len(reference)} responses" in done.stderr


def test_cli_generate_errors_name_the_fix(server: ServerProcess, certs_dir: Path) -> None:
    wrong = cli("generate", "mlp", PROMPT, "--url", server.url)
    assert wrong.returncode != 0
    assert "generation model" in wrong.stderr and "text and max_tokens" in wrong.stderr
    absent = cli("generate", "no_such_model", PROMPT, "--url", server.url)
    assert absent.returncode != 0 and "NOT_FOUND" in absent.stderr
    # A server that is not there: the message names the flag to check.
    gone = cli("generate", MODEL, PROMPT, "--url", f"grpcs://localhost:{free_port()}")
    assert gone.returncode != 0 and "--url" in gone.stderr and "--ca-file" in gone.stderr
    bad = cli("generate", MODEL, PROMPT, "--max-tokens", "0", "--url", server.url)
    assert bad.returncode == 2 and "--max-tokens" in bad.stderr


@pytest.mark.parametrize("transport", ["h2", "h3"])
def test_cli_generate_interrupted_cancels_the_generation(
    server: ServerProcess, certs_dir: Path, transport: str
) -> None:
    """Ctrl-C (SIGINT) while the server runs the generation and its worker is held: the
    command exits 130, and the generation ends cancelled once the worker resumes."""
    (instance,) = server.instances(MODEL)
    before, failures = settled_tokens(server), failed_requests(server)
    command = [sys.executable, "-m", "clients.cli", "generate", MODEL, PROMPT]
    command += ["--max-tokens", str(LONG_MAX_TOKENS), "--ca-file", str(certs_dir / "ca.pem")]
    command += ["--url", client_args(server, certs_dir, transport)["url"]]
    with paused(instance.pid):
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=default_sigint,
        )  # fmt: skip
        try:
            wait_active(server)
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=TIMEOUT_S)
        finally:
            process.kill()
    assert process.returncode == 130, stderr
    assert "interrupted after 0 responses" in stderr
    after = settled_tokens(server)
    assert after - before < LONG_MAX_TOKENS / 2
    assert failed_requests(server) == failures + 1


def perf(certs_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return cli("perf", "--ca-file", str(certs_dir / "ca.pem"), *args)


@pytest.mark.parametrize("transport", ["h2", "h3"])
def test_perf_streaming_reports_time_to_first_token_and_tokens_per_second(
    server: ServerProcess, certs_dir: Path, tmp_path: Path, transport: str
) -> None:
    np.save(tmp_path / "text.npy", np.array([PROMPT.encode()]))
    # Short generations: many start and finish inside the measured window.
    np.save(tmp_path / "max_tokens.npy", np.array([PERF_MAX_TOKENS], np.int32))
    out = tmp_path / "perf.json"
    done = perf(
        certs_dir, MODEL, "--streaming", "--url", client_args(server, certs_dir, transport)["url"],
        "--input-data", str(tmp_path), "--concurrency-range", "1,2", "-f", str(out), *QUICK,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    header = re.split(r"\s{2,}", done.stdout.splitlines()[0].strip())
    assert header[-4:] == ["tokens/s", "TTFT p50 ms", "TTFT p99 ms", "inter-token p50 ms"]
    document = json.loads(out.read_text())
    assert document["decoupled"] is True
    for row in document["rows"]:
        assert row["requests"] > 0 and row["errors"] == {}
        assert row["tokens_per_s"] > 0
        first = row["time_to_first_token_ms"]
        assert 0 < first["p50"] <= first["p99"] <= row["latency_ms"]["p99"]
        assert row["inter_token_ms"]["p50"] > 0
    refused = perf(certs_dir, MODEL, "--url", server.url, "--input-data", str(tmp_path), *QUICK)
    assert refused.returncode == 2 and "--streaming" in refused.stderr
