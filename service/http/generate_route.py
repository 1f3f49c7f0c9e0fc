"""Triton's generate routes (`/v2/models/NAME[/versions/V]/generate[_stream]`): a JSON
object of scalars as a request, its responses as JSON (generate) or server-sent events
(generate_stream). Over any inference plane: the server's, or a front-end's for the versions it
serves itself, whose decoupled requests go to their workers on its own sockets."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

from service.dataplane.plane import InferencePlane
from service.http.generate import (
    TextDecoder,
    event,
    generate_inputs,
    generate_request,
    single,
    sse,
)
from service.http.json_tensors import parsed
from service.http.reply import Reply
from service.http.textgen import checked
from service.inference import errors
from service.inference.jobs import StreamAnswer
from service.inference.validation import Decoding
from service.registry.versions import ServedVersion


class GenerateRoute:
    def __init__(self, plane: InferencePlane) -> None:
        self.plane = plane

    async def generate(
        self, model: str, version: str, body: bytes, stream: bool, client: str
    ) -> Reply:
        """Triton's generate (`stream`: generate_stream). A decoupled model's responses stream
        as they come; an error before the first is the reply's status, as for /infer. `client`:
        whom the request counts against for the fair share of a decoupled version's places."""
        async with self.plane.serving(model, version, None) as served:
            # Until the request is queued (a stream's first response): not evicted meanwhile.
            return await self._generate(served, body, stream, client)

    async def _generate(
        self, served: ServedVersion, body: bytes, stream: bool, client: str
    ) -> Reply:
        request = generate_request(parsed(body))
        validator = served.validator
        assert validator is not None  # a resolved version serves

        def admit() -> Decoding:
            return validator.check(generate_inputs(request, validator), ())

        job = await self.plane.admitted(served, admit)
        if not served.decoupled:
            inferred = await self.plane.infer(served, job, None, {})
            answered = inferred.answered
            answer = event(answered.name, str(answered.version), inferred.outputs)
            if stream:
                return Reply(200, events=single(sse(answer)))
            return Reply(200, answer, model_version=str(answered.version))
        answers = self.plane.runner.stream(served, job, "", request.parameters_json, None, client)
        if stream:
            return Reply(200, events=await _first_then_rest(served, answers))
        async with contextlib.aclosing(answers) as responses:
            collected = [a async for a in responses if checked(a).outputs]
        if len(collected) != 1:
            raise errors.invalid(
                f"model '{served.name}' answered with {len(collected)} responses; generate "
                "takes one: use generate_stream"
            )
        return Reply(200, event(served.name, str(served.version), collected[0].outputs))


async def _first_then_rest(
    served: ServedVersion, answers: AsyncGenerator[StreamAnswer, None]
) -> AsyncGenerator[bytes, None]:
    """The events of a decoupled model's responses, the first one awaited here (so that a
    refusal before it, a full queue, is the reply's status)."""
    decoder = TextDecoder()
    version = str(served.version)
    try:
        first = checked(await anext(answers))
    except BaseException:
        await answers.aclose()
        raise

    async def events() -> AsyncGenerator[bytes, None]:
        async with contextlib.aclosing(answers) as rest:
            answer: StreamAnswer | None = first
            while answer is not None:
                if answer.error is not None:
                    yield sse({"error": answer.error})
                    return
                if answer.outputs:
                    yield sse(decoder.event(served.name, version, answer.outputs, answer.final))
                answer = None if answer.final else await anext(rest, None)

    return events()
