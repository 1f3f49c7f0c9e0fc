"""The OpenAI-compatible API and the batchstream API on the `generate` example, against the real
server process: the `openai` package in its own process and raw HTTP (httpx over HTTP/1.1 and
HTTP/2, plain sockets where a client must misbehave), the text compared with the gRPC stream's
for the same generation, each bound hit once, and a client that leaves shown to stop the
engine (its step count stops growing)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import h2.config
import h2.connection
import httpx
import pytest

from clients.inference_client import InferenceClient
from service.http.batchstream import MAX_IN_FLIGHT, MAX_LINE_BYTES, MAX_LINES
from service.http.openai_requests import MAX_MESSAGES, MAX_PROMPT_CHARS, MAX_TOKENS
from tests.servers import (
    EXAMPLE_MODELS,
    HTTP_PORT,
    REPO_ROOT,
    ServerProcess,
    paused,
    running_server,
)

pytestmark = pytest.mark.e2e

BODY_TIMEOUT_S = 2.0
CHAT_TEMPLATE = "<{role}>{content}\\n"  # as config.pbtxt spells it (text format escapes)
PROMPT = "Once upon a time"
CLIENT_TIMEOUT_S = 240
STEPS = "paddlequic_inter_token_seconds_count"
ACTIVE = "paddlequic_active_generations"


@dataclass(frozen=True)
class Server:
    port: int
    process: ServerProcess

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def generations(self, name: str) -> float:
        """A generation metric, summed over the generation models."""
        return sum(s.value for s in self.process.metrics() if s.name == name)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`generate` and `mlp` as exported, `chat` (a copy of `generate`, which declares a chat
    template) and `nochat` (one without it)."""
    root = tmp_path_factory.mktemp("openai")
    repository = root / "models"
    repository.mkdir()
    for name in ("generate", "mlp"):
        (repository / name).symlink_to(EXAMPLE_MODELS / name)
    example = (EXAMPLE_MODELS / "generate" / "config.pbtxt").read_text()
    assert f'"chat_template", value: {{ string_value: "{CHAT_TEMPLATE}" }}' in example
    for name, config in (
        ("chat", example),
        ("nochat", "".join(x for x in example.splitlines(True) if "chat_template" not in x)),
    ):
        shutil.copytree(EXAMPLE_MODELS / "generate", repository / name)
        named = config.replace('name: "generate"', f'name: "{name}"')
        (repository / name / "config.pbtxt").write_text(named)
    args = (*("--http-port", HTTP_PORT), *("--http-body-timeout", str(BODY_TIMEOUT_S)))
    with running_server(repository, root / "server.log", args) as process:
        yield Server(process.http_port, process)


def grpc_text(server: Server, prompt: str, max_tokens: int, model: str = "generate") -> str:
    """The greedy generation as gRPC's stream gives it."""
    with InferenceClient(f"grpc://127.0.0.1:{server.process.port}") as client:
        return "".join(c.text for c in client.generate(model, prompt, max_tokens))


def post(server: Server, path: str, document: Any, http2: bool = False) -> httpx.Response:
    with httpx.Client(base_url=server.base, http1=not http2, http2=http2, timeout=60) as client:
        return client.post(path, json=document)


def data_events(payload: bytes) -> list[Any]:
    """The documents of `data: ...` events; `[DONE]` as the string."""
    events = payload.split(b"\n\n")
    assert events.pop() == b""
    assert all(e.startswith(b"data: ") for e in events), payload
    parsed = [e.removeprefix(b"data: ") for e in events]
    return [p.decode() if p == b"[DONE]" else json.loads(p) for p in parsed]


def openai_client(server: Server, script: str) -> Any:
    """`script` run with the `openai` package in its own process, `client` bound to the
    server; what it prints is JSON."""
    prelude = (
        f"import json, openai\nclient = openai.OpenAI(base_url='{server.base}/v1', api_key='x')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", prelude + script],
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_models_lists_the_generation_models(server: Server) -> None:
    with httpx.Client(base_url=server.base) as client:
        answer = client.get("/v1/models")
    assert answer.status_code == 200
    listed = answer.json()
    assert listed["object"] == "list"
    assert sorted(m["id"] for m in listed["data"]) == ["chat", "generate", "nochat"]  # not mlp
    assert all(m["object"] == "model" for m in listed["data"])


def test_the_openai_package_gets_the_generation_grpc_streams(server: Server) -> None:
    """Completions and chat, whole and streamed, through the `openai` package: the text is
    the greedy generation gRPC's stream gives, usage counts the model's tokens (one a
    character), and a field it does not serve set to anything but its default is refused."""
    answered = openai_client(
        server,
        f"""
whole = client.completions.create(model="generate", prompt={PROMPT!r}, max_tokens=12)
pieces = list(client.completions.create(
    model="generate", prompt={PROMPT!r}, max_tokens=12, stream=True,
    stream_options={{"include_usage": True}},
))
chat = client.chat.completions.create(
    model="chat", messages=[{{"role": "user", "content": "hi"}}], max_tokens=8
)
chat_pieces = list(client.chat.completions.create(
    model="chat", messages=[{{"role": "user", "content": "hi"}}], max_tokens=8, stream=True
))
try:
    client.completions.create(model="generate", prompt="x", max_tokens=2, n=2)
    refused = None
except openai.BadRequestError as exc:
    refused = [exc.status_code, exc.body]
print(json.dumps({{
    "text": whole.choices[0].text,
    "reason": whole.choices[0].finish_reason,
    "usage": whole.usage.model_dump(exclude_none=True),
    "streamed": "".join(c.choices[0].text for c in pieces if c.choices),
    "streamed_usage": pieces[-1].usage.model_dump(exclude_none=True),
    "chat": chat.choices[0].message.content,
    "chat_role": chat.choices[0].message.role,
    "chat_streamed": "".join(c.choices[0].delta.content or "" for c in chat_pieces),
    "chat_first_role": chat_pieces[0].choices[0].delta.role,
    "chat_reason": chat_pieces[-1].choices[0].finish_reason,
    "refused": refused,
}}))
""",
    )
    expected = grpc_text(server, PROMPT, 12)
    assert answered["text"] == answered["streamed"] == expected
    assert answered["reason"] == "length"
    usage = {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 12,
        "total_tokens": len(PROMPT) + 12,
    }
    assert answered["usage"] == answered["streamed_usage"] == usage
    chat_text = grpc_text(server, "<user>hi\n<assistant>", 8, "chat")
    assert answered["chat"] == answered["chat_streamed"] == chat_text
    assert (answered["chat_role"], answered["chat_first_role"]) == ("assistant", "assistant")
    assert answered["chat_reason"] == "length"
    status, body = answered["refused"]
    assert status == 400
    assert (body["param"], body["code"]) == ("n", "unsupported_value")


@pytest.mark.parametrize("http2", [False, True])
def test_streams_are_server_sent_events_ending_with_done(server: Server, http2: bool) -> None:
    """vLLM's framing over raw HTTP: `data: <chunk>` events, the first chat chunk carrying the
    role, a usage chunk with no choices last when asked, then `data: [DONE]`."""
    request = {
        "model": "chat",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = post(server, "/v1/chat/completions", request, http2)
    assert answer.status_code == 200
    assert answer.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
    assert answer.headers["content-type"] == "text/event-stream"
    *chunks, usage, done = data_events(answer.content)
    assert done == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in [*chunks, usage])
    assert len({c["id"] for c in [*chunks, usage]}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == grpc_text(server, "<system>be brief\n<user>hi\n<assistant>", 5, "chat")


def test_a_stop_sequence_ends_the_generation_in_the_engine(server: Server) -> None:
    """The text ends before the stop sequence, and so does the model's work: the engine
    takes few steps past it, far short of max_tokens."""
    expected = grpc_text(server, PROMPT, 40)
    stop = expected[6:8]
    cut = expected[: expected.find(stop)]
    before = server.generations(STEPS)
    answer = post(
        server,
        "/v1/completions",
        {"model": "generate", "prompt": PROMPT, "max_tokens": 200, "stop": [stop, "never"]},
    )
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == (cut, "stop")
    settled = wait_idle(server)
    assert settled - before < 100


def test_calls_are_counted_as_the_model_s_streams(server: Server) -> None:
    """A completion is counted as the ModelStreamInfer call it stands for, on its model."""

    def count() -> float:
        labels = {"transport": "http", "rpc": "ModelStreamInfer", "model": "generate", "code": "OK"}
        return sum(
            s.value
            for s in server.process.metrics()
            if s.name == "paddlequic_requests_total"
            and all(s.labels.get(k) == v for k, v in labels.items())
        )

    before = count()
    answer = post(server, "/v1/completions", {"model": "generate", "prompt": "x", "max_tokens": 2})
    assert answer.status_code == 200
    assert count() == before + 1


def test_temperature_and_seed_reach_the_model(server: Server) -> None:
    """A seeded sample is the one gRPC's stream gives for the same temperature and seed."""
    request = {"model": "generate", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.8}
    answer = post(server, "/v1/completions", request | {"seed": 7})
    assert answer.status_code == 200, answer.text
    with InferenceClient(f"grpc://127.0.0.1:{server.process.port}") as client:
        sampled = "".join(c.text for c in client.generate("generate", PROMPT, 12, 0.8, 7))
    assert answer.json()["choices"][0]["text"] == sampled
    assert sampled != grpc_text(server, PROMPT, 12)


def wait_idle(server: Server) -> float:
    """Once no generation runs and the step count stopped growing: the step count."""
    deadline = time.monotonic() + 30
    while server.generations(ACTIVE) != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    steps = server.generations(STEPS)
    time.sleep(0.5)
    assert server.generations(STEPS) == steps
    return steps


@pytest.mark.parametrize(
    ("path", "request_fields", "status", "param", "named"),
    [
        ("/v1/completions", {"max_tokens": MAX_TOKENS + 1}, 400, "max_tokens", str(MAX_TOKENS)),
        ("/v1/completions", {"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, 400, "prompt", "65536"),
        ("/v1/completions", {"n": 2}, 400, "n", "n: 1"),
        ("/v1/completions", {"frobnicate": 1}, 400, "frobnicate", "'frobnicate'"),
        ("/v1/completions", {"top_p": 0.5}, 400, "top_p", "set it to 1"),
        ("/v1/completions", {"temperature": 3}, 400, "temperature", "from 0 to 2"),
        ("/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
        ("/v1/completions", {"model": "mlp"}, 404, None, "not a generation model"),
        ("/v1/completions", {"model": "nope"}, 404, None, "nope"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)},
            400,
            "messages",
            f"at most {MAX_MESSAGES}",
        ),
        (
            "/v1/chat/completions",
            {"model": "nochat"},
            400,
            "messages",
            "declares no chat template",
        ),
    ],
)
def test_refusals_are_openai_errors_naming_the_bound(
    server: Server,
    path: str,
    request_fields: dict[str, Any],
    status: int,
    param: str | None,
    named: str,
) -> None:
    request: dict[str, Any] = {"model": "chat", "max_tokens": 4}
    request |= (
        {"prompt": "x"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    answer = post(server, path, request | request_fields)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert named in error["message"]
    assert error["type"] == "invalid_request_error"


def test_fields_at_their_defaults_pass(server: Server) -> None:
    """Fields not served pass at OpenAI's defaults; max_tokens is 16 unless set."""
    request = {
        "model": "generate",
        "prompt": "x",
        "n": 1,
        "top_p": 1,
        "presence_penalty": 0,
        "logprobs": None,
        "echo": False,
        "user": "me",
    }
    answer = post(server, "/v1/completions", request)
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    assert choice["text"] == grpc_text(server, "x", 16)
    assert answer.json()["usage"]["completion_tokens"] == 16


def test_an_error_from_the_model_keeps_the_openai_shape(server: Server) -> None:
    """The model refuses (prompt plus max_tokens past its context): its message, 400."""
    answer = post(
        server, "/v1/completions", {"model": "generate", "prompt": "x" * 200, "max_tokens": 100}
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_argument")


def raw_request(server: Server, path: str, body: bytes) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    connection.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return connection


def wait_generating(server: Server) -> None:
    deadline = time.monotonic() + 60
    while server.generations(ACTIVE) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)


class H2Stream:
    """One HTTP/2 request (h2c by prior knowledge) on a plain socket, which the test resets
    while the connection stays open."""

    def __init__(self, server: Server, path: str) -> None:
        self.socket = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        self.h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2c.initiate_connection()
        headers = [(":method", "POST"), (":path", path), (":scheme", "http"), (":authority", "x")]
        self.h2c.send_headers(1, headers)
        self.flush()

    def send(self, data: bytes, end: bool) -> None:
        self.h2c.send_data(1, data, end_stream=end)
        self.flush()

    def reset(self) -> None:
        self.h2c.reset_stream(1)
        self.flush()

    def flush(self) -> None:
        self.socket.sendall(self.h2c.data_to_send())

    def close(self) -> None:
        self.socket.close()


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("leaving", ["closes its HTTP/1.1 connection", "resets its HTTP/2 stream"])
def test_a_client_that_leaves_stops_its_generation(
    server: Server, stream: bool, leaving: str
) -> None:
    """The client leaves while its generation runs (streamed or not): the server lets the
    generation go, freeing its place, and delivers nothing more; an HTTP/2 stream reset is
    enough, its connection open. The model is held still meanwhile, so what is asserted does
    not depend on how fast it generates."""
    before = server.generations(STEPS)
    request = {"model": "generate", "prompt": "x", "max_tokens": 250, "stream": stream}
    body = json.dumps(request).encode()
    (instance,) = server.process.instances("generate")
    with paused(instance.pid):
        if leaving.startswith("closes"):
            with raw_request(server, "/v1/completions", body):
                wait_generating(server)
            let_go(server)
        else:
            h2_stream = H2Stream(server, "/v1/completions")
            try:
                h2_stream.send(body, end=True)
                wait_generating(server)
                h2_stream.reset()
                let_go(server)  # its connection still open
            finally:
                h2_stream.close()
    assert wait_idle(server) == before


def let_go(server: Server) -> None:
    """Until the server has let every generation go (bounded)."""
    deadline = time.monotonic() + 60
    while server.generations(ACTIVE) != 0:
        assert time.monotonic() < deadline, "the server kept a generation its client left"
        time.sleep(0.02)


def test_batchstream_reset_over_http2_cancels_its_requests(server: Server) -> None:
    """A batchstream whose HTTP/2 stream is reset, its body not ended and its connection
    open: its requests are let go, and nothing more is delivered (the model held still
    meanwhile, as in the test above)."""
    before = server.generations(STEPS)
    (instance,) = server.process.instances("generate")
    with paused(instance.pid):
        h2_stream = H2Stream(server, "/v1/inference/advanced/batchstream")
        try:
            line = {"prompt": "x", "max_tokens": 250, "model": "generate"}
            h2_stream.send(lines(*({"request_id": f"r{i}", **line} for i in range(3))), end=False)
            wait_generating(server)
            h2_stream.reset()
            let_go(server)
        finally:
            h2_stream.close()
    assert wait_idle(server) == before


class Chunked:
    """A batchstream request over a plain socket: its body sent as HTTP/1.1 chunks when the
    test says, the events read as they come."""

    def __init__(self, server: Server) -> None:
        self.socket = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        self.socket.sendall(
            b"POST /v1/inference/advanced/batchstream HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        self.received = b""

    def send(self, data: bytes) -> None:
        self.socket.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def end(self) -> None:
        self.socket.sendall(b"0\r\n\r\n")

    def events(self, count: int) -> list[tuple[str, dict[str, Any]]]:
        """The first `count` events of the answer (name, document)."""
        while self.received.count(b"\n\n") < count:  # the head ends \r\n\r\n
            data = self.socket.recv(65536)
            assert data, self.received
            self.received += data
        return sse_named(self.received)[:count]

    def close(self) -> None:
        self.socket.close()


def sse_named(payload: bytes) -> list[tuple[str, dict[str, Any]]]:
    """`event: NAME\\ndata: JSON` events, wherever HTTP/1.1's chunk sizes fall between them."""
    found = []
    for part in payload.split(b"event: ")[1:]:
        name, _, rest = part.partition(b"\ndata: ")
        found.append((name.decode(), json.loads(rest.split(b"\n\n")[0])))
    return found


def lines(*documents: Any) -> bytes:
    return b"".join(json.dumps(d).encode() + b"\n" for d in documents)


def batchstream(
    server: Server, body: bytes, http2: bool = False
) -> list[tuple[str, dict[str, Any]]]:
    with httpx.Client(base_url=server.base, http1=not http2, http2=http2, timeout=120) as client:
        answer = client.post("/v1/inference/advanced/batchstream", content=body)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "text/event-stream"
    return sse_named(answer.content)


@pytest.mark.parametrize("http2", [False, True])
def test_batchstream_answers_each_request_and_names_those_that_fail(
    server: Server, http2: bool
) -> None:
    """A completion event per request, its text the generation gRPC's stream gives; an error
    event naming each request that fails (a bad prompt, a malformed line, an unknown field,
    the model's own refusal) without failing the others; `done` once all ended."""
    body = (
        lines(
            {"request_id": "req-001", "prompt": PROMPT, "max_tokens": 9, "model": "generate"},
            {"request_id": "req-002", "prompt": 7, "model": "generate"},
        )
        + b"{not json\n\n"
        + lines(
            {"request_id": "req-004", "prompt": "x", "colour": "red"},
            {"request_id": "req-005", "prompt": "x" * 200, "max_tokens": 100, "model": "chat"},
            {"request_id": "req-006", "prompt": "hi", "max_tokens": 4, "model": "chat"},
        )
    )
    events = batchstream(server, body, http2)
    name, done = events.pop()
    assert name == "done"
    assert done == {"requests": 6, "completed": 2, "failed": 4}
    completions = {d["request_id"]: d for n, d in events if n == "completion"}
    errors = {d["line"]: d for n, d in events if n == "error"}
    assert completions["req-001"]["text"] == grpc_text(server, PROMPT, 9)
    assert completions["req-001"]["finish_reason"] == "length"
    assert completions["req-001"]["usage"]["completion_tokens"] == 9
    assert completions["req-006"]["text"] == grpc_text(server, "hi", 4, "chat")
    assert (errors[2]["request_id"], errors[2]["code"]) == ("req-002", "invalid_prompt")
    assert (errors[3]["request_id"], errors[3]["code"]) == (None, "invalid_json")
    assert (errors[4]["request_id"], errors[4]["code"]) == ("req-004", "unsupported_field")
    assert "'colour'" in errors[4]["message"]
    assert (errors[5]["request_id"], errors[5]["code"]) == ("req-005", "invalid_argument")


def test_batchstream_starts_a_request_when_its_line_arrives(server: Server) -> None:
    """The first request completes while the body is still open; the second line, sent
    after that, runs too."""
    stream = Chunked(server)
    try:
        stream.send(lines({"request_id": "a", "prompt": "x", "max_tokens": 3, "model": "chat"}))
        ((name, first),) = stream.events(1)
        assert (name, first["request_id"]) == ("completion", "a")
        stream.send(lines({"request_id": "b", "prompt": "y", "max_tokens": 3, "model": "chat"}))
        stream.end()
        (_, (name, second), (end, counts)) = stream.events(3)
        assert (name, second["request_id"], end) == ("completion", "b", "done")
        assert counts["completed"] == 2
    finally:
        stream.close()


def test_batchstream_bounds_requests_in_flight_and_a_leaving_client_cancels_them(
    server: Server,
) -> None:
    """One line past MAX_IN_FLIGHT running requests is refused, naming the bound; closing the
    connection cancels every running request of the stream (the engine stops)."""
    before = server.generations(STEPS)
    (instance,) = server.process.instances("generate")
    with paused(instance.pid):  # nothing generated until every line is in: asserted exactly
        stream = Chunked(server)
        try:
            stream.send(
                lines(
                    *(
                        {"request_id": f"r{i}", "prompt": "x", "max_tokens": 250}
                        | {"model": "generate"}
                        for i in range(MAX_IN_FLIGHT + 1)
                    )
                )
            )
            ((name, refused),) = stream.events(1)
            assert (name, refused["request_id"], refused["code"]) == (
                "error",
                f"r{MAX_IN_FLIGHT}",
                "too_many_in_flight",
            )
            assert str(MAX_IN_FLIGHT) in refused["message"]
            wait_generating(server)
        finally:
            stream.close()
        let_go(server)
    assert wait_idle(server) == before


def test_batchstream_bounds_the_bytes_of_a_line(server: Server) -> None:
    """An overlong line fails alone, named by its number; the next line runs."""
    overlong = b'{"request_id": "big", "prompt": "' + b"x" * MAX_LINE_BYTES + b'"}\n'
    ok = {"request_id": "ok", "prompt": "x", "max_tokens": 2, "model": "chat"}
    events = batchstream(server, overlong + lines(ok))
    assert [n for n, _ in events] == ["error", "completion", "done"]
    error = events[0][1]
    assert (error["line"], error["code"]) == (1, "line_too_long")
    assert str(MAX_LINE_BYTES) in error["message"]


def test_batchstream_bounds_the_lines_of_a_body(server: Server) -> None:
    events = batchstream(server, b"{}\n" * (MAX_LINES + 1))
    assert sum(d["code"] == "invalid_request_id" for _, d in events if "code" in d) == MAX_LINES
    name, refused = events[-2]
    assert (name, refused["code"], refused["request_id"]) == ("error", "too_many_lines", None)
    assert str(MAX_LINES) in refused["message"]
    assert events[-1][0] == "done"


def test_batchstream_ends_a_body_that_goes_quiet(server: Server) -> None:
    """A body that sends nothing for --http-body-timeout while none of its requests runs
    ends the stream, saying so: whether its requests failed at once or ran to their end
    first."""
    for line in (
        b"{}\n",
        lines({"request_id": "a", "prompt": "x", "max_tokens": 2, "model": "chat"}),
    ):
        stream = Chunked(server)
        try:
            stream.send(line)
            events = stream.events(3)
        finally:
            stream.close()
        assert [n for n, _ in events] == [
            "error" if line == b"{}\n" else "completion",
            "error",
            "done",
        ]
        assert events[1][1]["code"] == "body_timeout"
        assert "--http-body-timeout" in events[1][1]["message"]


def test_readme_openai_examples(server: Server) -> None:
    """The OpenAI section's commands, as README.md prints them, against this server's port."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("### OpenAI-compatible API and batchstream")[1].split("```sh\n")[1]
    commands = section.split("```")[0].replace("\\\n", " ").splitlines()
    outputs = []
    for command in commands:
        local = command.replace("localhost:8000", f"127.0.0.1:{server.port}")
        done = subprocess.run(["bash", "-c", local], capture_output=True, timeout=60, text=True)
        assert done.returncode == 0, (command, done.stderr)
        outputs.append(done.stdout)
    assert [m["id"] for m in json.loads(outputs[0])["data"]] == ["chat", "generate", "nochat"]
    assert json.loads(outputs[1])["choices"][0]["text"] == grpc_text(server, PROMPT, 16)
    *chunks, done = data_events(outputs[2].encode())
    assert done == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks) == grpc_text(server, PROMPT, 8)
    events = sse_named(outputs[3].encode())
    assert sorted(n for n, _ in events) == ["completion", "done", "error"]
    (error,) = (d for n, d in events if n == "error")
    assert error | {"message": ""} == {
        "request_id": "req-002",
        "line": 2,
        "code": "invalid_prompt",
        "message": "",
    }
