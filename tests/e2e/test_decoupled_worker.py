"""A decoupled Python model's worker process (tests/fixtures/python_decoupled), driven over
its real socket with the worker protocol as the server drives it: spawned and loaded by
service/workers/launch.py, then Submit, Credit, Cancel and Shutdown messages, and the Responses
counted. The model's own view (what send() raised, how many sends returned) comes back from
it as a later request's `report`."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from google.protobuf import text_format
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.inference import model_config_pb2 as mc
from service.backend.python_runtime import triton_python_backend_utils as pb_utils
from service.backend.sandbox import landlock, seccomp
from service.model.files import PYTHON_BACKEND, ModelFiles
from service.workers import launch, protocol
from service.workers.model_output import ModelOutput, OutputBudget, OutputReader
from service.workers.spec import WorkerSpec
from service.workers.tensor_io import input_array, wire_form

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "python_decoupled"
WINDOW = protocol.RESPONSE_WINDOW
# Bounds each wait for the worker, so a broken worker fails the test instead of hanging it.
TIMEOUT_S = 60.0
PROPERTY = settings(max_examples=12, deadline=None, derandomize=True, database=None)
# Triton's `async def execute` for decoupled models, on the fixture's config: `wait` answers
# once, then awaits until a later `wake` request (on the same event loop) lets it finish.
ASYNC_MODEL = """
import asyncio
import json
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def index(i):
    return pb_utils.InferenceResponse([pb_utils.Tensor("index", np.array([i], np.int32))])


class TritonPythonModel:
    def initialize(self, args):
        self.waiting = {}

    async def execute(self, requests):
        for request in requests:
            (tag,) = pb_utils.get_input_tensor_by_name(request, "tag").as_numpy().tolist()
            params = json.loads(request.parameters())
            sender = request.get_response_sender()
            if params["mode"] == "wait":
                self.waiting[tag.decode()] = woken = asyncio.Event()
                sender.send(index(0))
                await woken.wait()
                sender.send(index(1), FINAL)
            elif params["mode"] == "wake":
                self.waiting.pop(params["of"]).set()
                sender.send(flags=FINAL)
            elif params["mode"] == "raise":
                await asyncio.sleep(0)
                raise ValueError("refused after an await")
            elif params["mode"] == "return_list":
                return [index(0)]
"""
CLOSED = f"TritonModelException: {pb_utils.SENDER_CLOSED}"
T = TypeVar("T")


class Worker:
    """A real worker process and the server's end of its socket, run on an event loop of its
    own (a thread) so that synchronous tests and hypothesis can drive it."""

    def __init__(self, root: Path, model_py: str | None = None) -> None:
        version = root / "decoupled" / "1"
        shutil.copytree(FIXTURE, root / "decoupled")
        if model_py is not None:
            (version / "model.py").write_text(model_py)
        config = text_format.Parse(
            (root / "decoupled" / "config.pbtxt").read_text(), mc.ModelConfig()
        )
        model = version / "model.py"
        self.spec = WorkerSpec(
            "decoupled_0", "decoupled", ModelFiles(1, version, model, model), {},
            backend=PYTHON_BACKEND, config=config.SerializeToString(),
        )  # fmt: skip
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self._pending: dict[int, list[protocol.Response]] = {}
        self._next_id = 0
        self.loaded = self._call(self._start())

    async def _start(self) -> protocol.Loaded:
        spawned = await launch.spawn(self.spec)
        self.process = spawned.process
        assert spawned.output is not None
        output = ModelOutput("decoupled", OutputBudget())
        self._output = OutputReader(spawned.output, output).done
        self._reader, self._writer = await asyncio.open_unix_connection(sock=spawned.messages)
        return await launch.load(self.spec, self._reader, self._writer, spawned.process)

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(TIMEOUT_S)
        finally:
            future.cancel()

    def send(self, message: protocol.Message) -> None:
        async def write() -> None:
            self._writer.write(protocol.encode(message))
            await self._writer.drain()

        self._call(write())

    def received(self, request_id: int) -> list[protocol.Response]:
        """The request's responses read so far."""
        return self._pending[request_id]

    def next_response(self) -> protocol.Response:
        """The next message, a Response of any request (kept with its request's)."""
        message = self._read()
        assert isinstance(message, protocol.Response), message
        self._pending[message.request_id].append(message)
        return message

    def _read(self) -> protocol.Message | None:
        return self._call(launch.read_message(self._reader, lambda: protocol.MAX_MESSAGE))

    def submit(
        self,
        mode: str,
        count: int = 0,
        tag: str = "",
        outputs: tuple[str, ...] = ("index", "report"),
        **parameters: Any,
    ) -> int:
        self._next_id += 1
        request_id = self._next_id
        tag = tag or f"r{request_id}"
        inputs = {"count": np.array([count], np.int32), "tag": np.array([tag.encode()], object)}
        refs, data = [], b""
        for name, array in inputs.items():
            dtype, raw = wire_form(array)
            refs.append(protocol.TensorRef(name, dtype, array.shape, len(data), raw.nbytes))
            data += raw.tobytes()
        text = json.dumps({"mode": mode, **parameters})
        self.send(protocol.Submit(request_id, tuple(refs), data, outputs, tag, text))
        self._pending[request_id] = []
        return request_id

    def responses(self, request_id: int, count: int) -> list[protocol.Response]:
        """The request's first `count` responses (others' are kept for later)."""
        got = self._pending[request_id]
        while len(got) < count:
            self.next_response()
        return got[:count]

    def until_final(self, request_id: int) -> list[protocol.Response]:
        got = self._pending[request_id]
        while not got or not got[-1].final:
            self.responses(request_id, len(got) + 1)
        return got

    def report(self, of: int, **wait: Any) -> dict[str, Any]:
        """What the model saw of request `of`, once it sent `at_least` responses."""
        (answer,) = self.until_final(self.submit("report", of=f"r{of}", **wait))
        assert answer.error is None, answer.error
        (report,) = outputs(answer)["report"].tolist()
        result: dict[str, Any] = json.loads(report)
        return result

    def stop(self) -> list[protocol.Message]:
        """Shutdown, then every message the worker still wrote before it exited."""
        self.send(protocol.Shutdown())
        left = []
        while (message := self._read()) is not None:
            left.append(message)
        assert self._call(self.process.wait()) == 0
        self._call(asyncio.wait([self._output]))
        self._loop.call_soon_threadsafe(self._loop.stop)
        return left


def outputs(response: protocol.Response) -> dict[str, np.ndarray[Any, Any]]:
    return {ref.name: input_array(response.data, ref) for ref in response.outputs}


def indices(responses: list[protocol.Response]) -> list[int]:
    return [int(outputs(r)["index"][0]) for r in responses if "index" in outputs(r)]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    process = Worker(tmp_path_factory.mktemp("decoupled"))
    yield process
    process.stop()


def credited(worker: Worker, request_id: int) -> list[protocol.Response]:
    """Every response of the request, each credited as it is taken, as the server does (those
    taken before were credited by the caller)."""
    got = worker.received(request_id)
    while not got or not got[-1].final:
        got = worker.responses(request_id, len(got) + 1)
        worker.send(protocol.Credit(request_id, 1))
    return got


@PROPERTY
@given(count=st.integers(1, 3 * WINDOW))
def test_responses_sent_inside_execute_arrive_in_order_the_last_final(
    worker: Worker, count: int
) -> None:
    """Credit reaches the worker while execute() itself waits on the window."""
    got = credited(worker, worker.submit("repeat", count))
    assert indices(got) == list(range(count))
    assert [r.final for r in got] == [False] * (count - 1) + [True]
    assert all(r.error is None and [o.name for o in r.outputs] == ["index"] for r in got)


def test_a_response_is_what_its_tensors_held_when_it_was_sent(worker: Worker) -> None:
    """As in Triton, send() takes the data: the model may reuse its arrays at once."""
    assert indices(credited(worker, worker.submit("reuse", 2 * WINDOW))) == list(range(2 * WINDOW))


def test_a_response_carries_the_outputs_its_request_asked_for(worker: Worker) -> None:
    """A request that names none asks for all (as in Triton); one that names only `report`
    gets responses without `index`."""
    everything = credited(worker, worker.submit("repeat", 2, outputs=()))
    assert indices(everything) == [0, 1]
    pruned = credited(worker, worker.submit("repeat", 2, outputs=("report",)))
    assert [(r.outputs, r.final, r.error) for r in pruned] == [((), False, None), ((), True, None)]


def test_a_flags_only_final_ends_a_request_answered_from_a_thread(worker: Worker) -> None:
    got = credited(worker, worker.submit("repeat_then_flags", 3))
    assert indices(got) == [0, 1, 2]
    assert (got[-1].final, got[-1].outputs, got[-1].data, got[-1].error) == (True, (), b"", None)
    nothing = credited(worker, worker.submit("repeat_then_flags", 0))
    assert [(r.final, r.outputs, r.error) for r in nothing] == [(True, (), None)]


def test_responses_of_two_requests_interleave(worker: Worker) -> None:
    first = worker.submit("turns", 3, parity=0)
    second = worker.submit("turns", 3, parity=1)
    order: list[tuple[int, int]] = []
    while len(order) < 6:
        message = worker.next_response()
        if not message.final:
            order.append((message.request_id, indices([message])[0]))
    assert order == [(first, 0), (second, 0), (first, 1), (second, 1), (first, 2), (second, 2)]
    assert worker.until_final(first)[-1].final and worker.until_final(second)[-1].final


@PROPERTY
@given(
    count=st.integers(0, 3 * WINDOW),
    credits=st.lists(st.integers(1, WINDOW), min_size=1, max_size=6),
)
def test_without_credit_no_more_than_the_window_goes_out(
    worker: Worker, count: int, credits: list[int]
) -> None:
    """Each Credit lets exactly that many more data responses out; the model's send() waits
    meanwhile and writable() says so. The final response needs no credit."""
    request = worker.submit("repeat_then_flags", count)
    taken = 0
    for credit in credits:
        expected = min(count, WINDOW + taken)
        worker.responses(request, expected)
        if expected < count:
            report = worker.report(request, at_least=expected)
            assert (report["sent"], report["writable"]) == (expected, False)
            assert len(worker.received(request)) == expected
        credit = min(credit, expected - taken)  # the server credits only what it took
        worker.send(protocol.Credit(request, credit))
        taken += credit
    worker.send(protocol.Credit(request, len(worker.received(request)) - taken))
    got = credited(worker, request)
    assert indices(got) == list(range(count)) and len(got) == count + 1 and got[-1].final


def test_a_request_without_credit_holds_only_itself(worker: Worker) -> None:
    """One caller that stops reading stops its own request; the others go on."""
    slow = worker.submit("repeat_then_flags", 3 * WINDOW)
    worker.responses(slow, WINDOW)
    fast = credited(worker, worker.submit("repeat_then_flags", 2 * WINDOW))
    assert indices(fast) == list(range(2 * WINDOW)) and fast[-1].final
    report = worker.report(slow, at_least=WINDOW)
    assert (report["sent"], report["writable"], len(worker.received(slow))) == (
        WINDOW,
        False,
        WINDOW,
    )
    worker.send(protocol.Credit(slow, WINDOW))
    assert indices(credited(worker, slow)) == list(range(3 * WINDOW))


def test_the_final_response_needs_no_credit(worker: Worker) -> None:
    """Sent through a full window, flags-only or the worker's error, so the model's final
    send() never waits for a slow reader."""
    flags = worker.submit("repeat_then_flags", WINDOW)
    assert [r.final for r in worker.responses(flags, WINDOW + 1)] == [False] * WINDOW + [True]
    last = worker.submit("repeat", WINDOW + 1)  # its last data response is the final one
    assert indices(worker.responses(last, WINDOW + 1)) == list(range(WINDOW + 1))
    dropped = worker.submit("drop_after", WINDOW)
    got = worker.responses(dropped, WINDOW + 1)
    assert got[-1].final and got[-1].error is not None and "released" in got[-1].error


@PROPERTY
@given(credits=st.integers(0, 2 * WINDOW))
def test_cancel_makes_is_cancelled_true_and_the_model_stop(worker: Worker, credits: int) -> None:
    request = worker.submit("until_cancelled")
    for taken in range(credits):
        worker.responses(request, WINDOW + taken)
        worker.send(protocol.Credit(request, 1))
    worker.responses(request, WINDOW + credits)
    assert worker.report(request, at_least=WINDOW + credits)["sent"] == WINDOW + credits
    worker.send(protocol.Cancel(request))
    report = worker.report(request, until_cancelled=True)
    # The send the window held returned (its response dropped), and the loop saw the cancel.
    assert (report["sent"], report["cancelled"]) == (WINDOW + credits + 1, True)
    # Nothing more went out for it, not even the final response the model sent after.
    assert len(worker.received(request)) == WINDOW + credits
    worker.send(protocol.Credit(request, WINDOW))
    assert indices(credited(worker, worker.submit("repeat", 2))) == [0, 1]
    assert len(worker.received(request)) == WINDOW + credits


def test_a_send_after_the_final_raises_tritons_exception(worker: Worker) -> None:
    request = worker.submit("after_final")
    assert [(r.final, r.outputs) for r in worker.until_final(request)] == [(True, ())]
    report = worker.report(request)
    assert (report["again"], report["again_flags"]) == (CLOSED, CLOSED)


def test_a_released_sender_ends_its_request_with_an_error(worker: Worker) -> None:
    dropped = worker.submit("drop")
    first, last = worker.until_final(dropped)
    assert indices([first]) == [0] and first.error is None
    released = "the model released its response sender without sending "
    assert last.error is not None and released in last.error
    assert f"request 'r{dropped}' of model 'decoupled'" in last.error
    (ignored,) = worker.until_final(worker.submit("ignore"))
    assert ignored.error is not None and released in ignored.error
    # Held past execute(): nothing until the model lets go of it.
    held = worker.submit("hold")
    release = worker.submit("release", held=f"r{held}")
    assert [(r.final, r.error) for r in worker.until_final(release)] == [(True, None)]
    (error,) = worker.until_final(held)
    assert error.final and error.error is not None and released in error.error


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("return_list", "is using the decoupled mode and the execute function must return None."),
        ("raise", "message: ValueError: refused on purpose"),
    ],
)
def test_execute_that_fails_ends_its_request_with_an_error(
    worker: Worker, mode: str, message: str
) -> None:
    got = worker.until_final(worker.submit(mode))
    failed = got[-1]
    assert failed.final and failed.error is not None and message in failed.error
    assert failed.error.startswith("Failed to process the request(s) for model 'decoupled'")
    assert indices(got) == ([0] if mode == "raise" else [])
    assert indices(credited(worker, worker.submit("repeat", 1))) == [0]


def test_the_models_error_response_is_not_final_unless_flagged(worker: Worker) -> None:
    error, last = worker.until_final(worker.submit("error"))
    assert (error.error, error.final, error.outputs) == ("the model says no", False, ())
    assert (indices([last]), last.final, last.error) == ([0], True, None)


@pytest.mark.parametrize(
    ("name", "dtype", "value", "message"),
    [
        ("index", "float64", 1.5, "output 'index' is float64, its config says INT32"),
        ("index", "int64", 1 << 40, "output 'index' is int64, its config says INT32"),
        ("report", "int32", 1, "output 'report' must hold bytes or str, not int32"),
        ("report", "object", 1.5, "cannot convert 'float' object to bytes"),
        ("nope", "int32", 1, "the response has output 'nope', which the config does not"),
    ],
)
def test_a_response_the_config_does_not_allow_fails_its_request(
    worker: Worker, name: str, dtype: str, value: Any, message: str
) -> None:
    request = worker.submit("bad", name=name, dtype=dtype, value=value)
    (failed,) = worker.until_final(request)
    assert failed.final and failed.outputs == () and failed.error is not None
    assert message in failed.error and f"request 'r{request}'" in failed.error
    report = worker.report(request)
    assert report["bad"].startswith("TritonModelException: ") and message in report["bad"]
    assert report["after"] == CLOSED
    assert indices(credited(worker, worker.submit("repeat", 1))) == [0]


@pytest.mark.skipif(
    not seccomp.supported() or not landlock.abi(), reason="no seccomp filter or no Landlock"
)
def test_the_sandbox_holds_in_execute_and_in_the_models_threads(
    worker: Worker, tmp_path: Path
) -> None:
    """The threads the worker starts after the load, and the model's own, are confined like
    the thread that entered the sandbox: no socket, no file outside the model's directory."""
    outside = tmp_path / "outside.txt"
    outside.write_text("not for the model")
    request = worker.submit("sandbox", path=str(outside))
    assert [r.final for r in worker.until_final(request)] == [True]
    report = worker.report(request)
    denied = ("here", "thread", "read here", "read in thread")
    assert [report[k].split(":")[0] for k in denied] == ["PermissionError"] * 4, report


def test_shutdown_finalizes_and_open_requests_get_nothing_more(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    worker = Worker(tmp_path)
    blocked = worker.submit("until_cancelled")
    worker.responses(blocked, WINDOW)
    held = worker.submit("hold")
    assert worker.report(blocked, at_least=WINDOW)["sent"] == WINDOW
    inside = worker.submit("repeat", 2 * WINDOW)  # execute() itself waits in send()
    worker.responses(inside, WINDOW)
    with caplog.at_level("INFO", "paddlequic.model"):
        assert worker.stop() == []
    # finalize() ran, after execute() returned; none of them got anything more.
    assert "model decoupled: finalize: 1 senders held" in caplog.text
    assert [len(worker.received(r)) for r in (blocked, held, inside)] == [WINDOW, 0, WINDOW]


def test_async_execute_runs_on_an_event_loop_requests_overlapping(tmp_path: Path) -> None:
    worker = Worker(tmp_path, ASYNC_MODEL)
    waiting = worker.submit("wait")
    assert indices(worker.responses(waiting, 1)) == [0]
    woken = worker.submit("wake", of=f"r{waiting}")
    assert [(r.final, r.error) for r in worker.until_final(woken)] == [(True, None)]
    rest = worker.until_final(waiting)[1:]
    assert (indices(rest), rest[-1].final, rest[-1].error) == ([1], True, None)
    (failed,) = worker.until_final(worker.submit("raise"))
    assert (
        failed.error is not None and "message: ValueError: refused after an await" in failed.error
    )
    (failed,) = worker.until_final(worker.submit("return_list"))
    assert failed.error is not None and "execute function must return None." in failed.error
    assert worker.stop() == []
