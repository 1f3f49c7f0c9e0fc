"""The `generate` example (examples/generate: the decoder LM of `make models` in a decoupled
model.py running the generation engine) on a real server, over both transports with the
generated stubs: one response per token, a final one with finish_reason, the same text
whatever else runs at the same time, and a cancelled stream's model stops sending (the
generated-tokens counter holds still). That the engine then stops stepping the sequence (its
step counter) is shown in-process, tests/unit/test_generation_engine.py: once cancelled, the
worker's sender drops what is sent, which the counter does not see."""

from __future__ import annotations

import asyncio
import re
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.conformance.conftest import EOF, new_channel
from tests.servers import EXAMPLE_MODELS, REPO_ROOT, ServerProcess, held_still, running_server

pytestmark = pytest.mark.e2e

MODEL = "generate"
CALL_TIMEOUT_S = 120.0  # generous: only a broken server reaches it
QUIET_LOOKS = 25  # scrapes in a row that saw the counter hold still
FINAL = "triton_final_response"
PROMPTS = ("Hello", "a longer prompt, with punctuation!", "x", "0123456789", "The quick fox")


def example_repository(target: Path) -> Path:
    """`generate` as this tree's examples/ has it (config.pbtxt, model.py, vocabulary), with
    the LM `make models` exported (3.7 MB, copied: the sandbox sees the model's directory
    only)."""
    model = target / MODEL
    (model / "1").mkdir(parents=True)
    example = REPO_ROOT / "examples" / MODEL / MODEL
    shutil.copy(example / "config.pbtxt", model)
    for name in ("model.py", "vocab.json"):
        shutil.copy(example / "1" / name, model / "1")
    shutil.copytree(EXAMPLE_MODELS / MODEL / "1" / "lm", model / "1" / "lm")
    return target


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("generate")
    repository = example_repository(root / "models")
    with running_server(repository, root / "server.log", ["--certs-dir", str(certs_dir)]) as s:
        yield s


@pytest.fixture(params=("h2", "h3"))
def transport(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def generate(text: str, max_tokens: int, request_id: str, **extra: Any) -> pb.ModelInferRequest:
    inputs = {
        "text": np.array([text.encode()], np.object_),
        "max_tokens": np.array([max_tokens], np.int32),
    }
    if "temperature" in extra:
        inputs["temperature"] = np.array([extra["temperature"]], np.float32)
    if "seed" in extra:
        inputs["seed"] = np.array([extra["seed"]], np.int64)
    return build_request(MODEL, inputs, request_id=request_id)


async def stream(
    server: ServerProcess, transport: str, certs_dir: Path, requests: list[pb.ModelInferRequest]
) -> dict[str, list[pb.ModelInferResponse | str]]:
    """Every request on one stream; each one's responses (or error messages) by id."""
    answers: dict[str, list[pb.ModelInferResponse | str]] = {r.id: [] for r in requests}
    async with new_channel(transport, server, certs_dir / "ca.pem") as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        for request in requests:
            await call.write(request)
        await call.done_writing()
        while (response := await call.read()) is not EOF:
            answer = response.infer_response
            answers[answer.id].append(response.error_message or answer)
        assert await call.code() is grpc.StatusCode.OK
    return answers


def text_of(responses: list[pb.ModelInferResponse | str]) -> tuple[str, str]:
    """(the text, the finish reason); checks the flags on the way."""
    assert all(isinstance(r, pb.ModelInferResponse) for r in responses), responses
    answers = [r for r in responses if isinstance(r, pb.ModelInferResponse)]
    assert [r.parameters[FINAL].bool_param for r in answers] == [False] * (len(answers) - 1) + [
        True
    ]
    outputs = [parse_response(r) for r in answers]
    assert all(set(o) == {"text_delta"} for o in outputs[:-1])
    assert set(outputs[-1]) == {"finish_reason"}
    text = "".join(o["text_delta"][0].decode() for o in outputs[:-1])
    return text, outputs[-1]["finish_reason"][0].decode()


def test_paddle_reads_the_cpu_inside_the_sandbox(server: ServerProcess) -> None:
    """The example imports paddle in its sandbox: Paddle's `cat /proc/cpuinfo` (its CPU
    feature check) is allowed, not refused."""
    log = server.log_text()
    assert "model generate" in log
    assert "/proc/cpuinfo" not in log


async def test_each_token_is_a_response_and_the_last_says_why_it_ended(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    answers = await stream(server, transport, certs_dir, [generate("Hello", 12, "one")])
    text, reason = text_of(answers["one"])
    assert reason == "length"
    assert len(answers["one"]) == 12 + 1 and len(text) == 12


@pytest.mark.float_kernels
async def test_concurrent_requests_get_the_text_each_gets_alone(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    """Greedy text alone and batched with the others: equal, since a row's logits do not
    depend on the batch beyond the last bits, and greedy decoding changes only at a near-tie."""
    jobs = [(text, 5 + 9 * i) for i, text in enumerate(PROMPTS)]
    alone = [
        text_of((await stream(server, transport, certs_dir, [generate(t, n, "a")]))["a"])
        for t, n in jobs
    ]
    together = await stream(
        server, transport, certs_dir, [generate(t, n, f"r{i}") for i, (t, n) in enumerate(jobs)]
    )
    assert [text_of(together[f"r{i}"]) for i in range(len(jobs))] == alone
    assert [len(text) for text, _ in alone] == [n for _, n in jobs]


async def test_a_seeded_request_samples_the_same_text_again(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    request = generate("Hello", 30, "s", temperature=1.5, seed=11)
    first = text_of((await stream(server, transport, certs_dir, [request]))["s"])
    again = text_of((await stream(server, transport, certs_dir, [request]))["s"])
    greedy = text_of(
        (await stream(server, transport, certs_dir, [generate("Hello", 30, "s")]))["s"]
    )
    assert first == again != greedy


async def test_a_request_the_model_cannot_run_is_an_error_and_the_stream_goes_on(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    answers = await stream(
        server,
        transport,
        certs_dir,
        [generate("Hello", 0, "zero"), generate("Hello", 100_000, "long"), generate("ok", 3, "ok")],
    )
    # The model refuses them as Triton's INVALID_ARG: the caller's mistake, not the server's.
    for request_id, word in (("zero", "max_tokens"), ("long", "context")):
        assert len(answers[request_id]) == 1
        message = str(answers[request_id][0])
        assert message.startswith("INVALID_ARGUMENT: model 'generate'") and word in message
    assert text_of(answers["ok"])[1] == "length"


async def test_a_prompt_past_the_largest_input_is_refused_before_the_model_tokenizes_it(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    """The model declares the largest input it takes (max_input_bytes): the server refuses
    a larger prompt before handing it over. Within that, the model checks a prompt's length
    before tokenizing it (a 60 MB prompt, tokenized first, held every stream for 3.6 s)."""
    answers = await stream(
        server,
        transport,
        certs_dir,
        [
            generate("x" * (1 << 20), 3, "huge"),
            generate("y" * 600, 3, "long"),
            generate("ok", 3, "ok"),
        ],
    )
    assert [str(a) for a in answers["huge"]] == [
        "INVALID_ARGUMENT: input 'text' has 1048580 bytes, more than max_input_bytes 2052 of "
        "model 'generate'"
    ]
    (long,) = answers["long"]
    assert "the prompt has 600 characters, more than the token budget of a step" in str(long)
    assert text_of(answers["ok"])[1] == "length"


def generated_tokens(server: ServerProcess) -> float:
    url = re.search(r"metrics on (http://\S+/metrics)", server.log_text())
    assert url is not None
    with urllib.request.urlopen(url.group(1), timeout=10) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "paddlequic_generated_tokens_total" and s.labels.get("model") == MODEL
    )


async def quiet_count(server: ServerProcess) -> float:
    """The generated-tokens counter once it held still for QUIET_LOOKS scrapes in a row."""
    return await held_still(lambda: generated_tokens(server), QUIET_LOOKS, CALL_TIMEOUT_S)


async def test_a_cancelled_stream_stops_its_sequence(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    request_id = f"cancel-{transport}"  # the server is shared by both transports' runs
    before = await quiet_count(server)
    async with new_channel(transport, server, certs_dir / "ca.pem") as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(generate("never mind", 240, request_id))
        for _ in range(3):
            assert (await call.read()) is not EOF
        call.cancel()
    stopped = await quiet_count(server)
    assert 3 <= stopped - before < 240
    assert await asyncio.to_thread(generated_tokens, server) == stopped
    # The engine saw the cancel and stopped stepping the sequence (not only the server
    # stopped forwarding it): it says after how many steps, short of the 240 asked for.
    left = re.compile(r"model generate: INFO \S+: request '(\S+)' cancelled after (\d+) step")
    async with asyncio.timeout(CALL_TIMEOUT_S):
        while not (steps := [m for m in left.findall(server.log_text()) if m[0] == request_id]):
            await asyncio.sleep(0.05)
    assert len(steps) == 1 and 3 <= int(steps[0][1]) < 240
