"""A decoupled Python model's requests in its worker: one ResponseFlow each, from the moment
the request arrives (so a Cancel or a Credit finds it at once) until its final response, and
execute() called on one request at a time (an `async def execute` runs on an event loop of its
own, as Triton runs it). What execute() does wrong fails that request with
Triton's messages; the worker and the other requests go on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import numpy as np

from service.backend.python_model import PythonModel
from service.backend.python_runtime import triton_python_backend_utils as pb_utils
from service.backend.response_flow import Outbox, ResponseFlow


class DecoupledRequests:
    """The worker's open decoupled requests, keyed as the worker numbers them. admit/credit/
    cancel come from the threads reading the sockets, execute from the one running the model;
    each request's replies leave through the outbox of the process that sent it."""

    def __init__(self, model: PythonModel, window: int) -> None:
        self._model = model
        self._window = window
        self._flows: dict[int, ResponseFlow] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # for `async def execute`

    def admit(
        self, request_id: int, caller_id: str, outputs: tuple[str, ...], outbox: Outbox
    ) -> None:
        requested = self._requested(outputs)

        def check(response: pb_utils.InferenceResponse) -> dict[str, np.ndarray[Any, Any]]:
            return self._model.response_outputs(response, requested)

        label = f"request '{caller_id}' of model '{self._model.name}'"
        self._flows[request_id] = ResponseFlow(
            request_id, label, self._window, outbox, check, self._ended
        )

    def execute(
        self,
        request_id: int,
        inputs: Mapping[str, np.ndarray[Any, Any]],
        outputs: tuple[str, ...],
        caller_id: str,
        parameters: str,
    ) -> None:
        """A request cancelled while it waited is not started."""
        flow = self._flows.get(request_id)
        if flow is None or flow.is_cancelled():
            if flow is not None:
                flow.fail("cancelled before it started")
            return
        tensors = [pb_utils.Tensor(name, array) for name, array in inputs.items()]
        requested = self._requested(outputs)
        request = pb_utils.InferenceRequest(tensors, requested, caller_id, parameters, flow)
        try:
            returned = self._model.execute([request])
        except Exception as exc:
            self._fail(flow, f"{type(exc).__name__}: {exc}")
            return
        if asyncio.iscoroutine(returned):
            self._in_background(returned, flow, request)
        else:
            self._returned(returned, flow)

    def _in_background(
        self,
        coroutine: Coroutine[Any, Any, Any],
        flow: ResponseFlow,
        request: pb_utils.InferenceRequest,
    ) -> None:
        """`async def execute`: as in Triton, on one event loop of the instance's, so the next
        request starts while this one awaits. The request lives until the outcome is known
        (released sooner, it would be failed as abandoned instead)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="async", daemon=True).start()
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        future.add_done_callback(lambda done: self._settled(done, flow, request))

    def _settled(
        self,
        done: concurrent.futures.Future[Any],
        flow: ResponseFlow,
        request: pb_utils.InferenceRequest,
    ) -> None:
        try:
            returned = done.result()
        except Exception as exc:
            self._fail(flow, f"{type(exc).__name__}: {exc}")
        else:
            self._returned(returned, flow)

    def _returned(self, returned: Any, flow: ResponseFlow) -> None:
        if returned is not None:
            reason = (
                f"Python model '{self._model.name}' is using the decoupled mode and the "
                "execute function must return None."
            )
            self._fail(flow, reason)

    def fail(self, request_id: int, reason: str) -> None:
        """The request cannot run (its Submit is unreadable)."""
        flow = self._flows.get(request_id)
        if flow is not None:
            self._fail(flow, reason)

    def credit(self, request_id: int, count: int) -> None:
        flow = self._flows.get(request_id)
        if flow is not None:
            flow.credit(count)

    def cancel(self, request_id: int) -> None:
        flow = self._flows.get(request_id)
        if flow is not None:
            flow.cancel()

    def cancel_where(self, chosen: Callable[[int], bool]) -> None:
        """Every request whose key is `chosen` cancelled (the process that sent them is
        gone)."""
        for request_id, flow in self._flows.copy().items():
            if chosen(request_id):
                flow.cancel()

    def stop(self) -> None:
        """Shutdown: nothing more leaves, and senders blocked on the window return."""
        for flow in self._flows.copy().values():
            flow.stop()

    def _requested(self, outputs: tuple[str, ...]) -> tuple[str, ...]:
        """As in Triton, a request that names no output asks for all of them."""
        return outputs or tuple(spec.name for spec in self._model.outputs)

    def _fail(self, flow: ResponseFlow, reason: str) -> None:
        """Triton's message for a request whose execute() failed."""
        flow.fail(
            f"Failed to process the request(s) for model '{self._model.name}', message: {reason}"
        )

    def _ended(self, request_id: int) -> None:
        self._flows.pop(request_id, None)
