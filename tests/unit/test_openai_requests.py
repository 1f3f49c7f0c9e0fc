"""OpenAI request bodies (service/http/openai_requests.py): whatever JSON a caller sends, the
answer is a request or a refusal naming the field, never another exception (a 500)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.http.openai_requests import (
    MAX_TOKENS,
    Messages,
    OpenAIError,
    completion_request,
    rendered,
)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=4,
)
FIELDS = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "top_p",
        "logprobs",
        "user",
        "echo",
        "max_completion_tokens",
    ]
)


# The machine is shared: generating nested JSON can be slow there, never wrong.
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(FIELDS, JSON, max_size=4), st.booleans())
def test_any_body_is_a_request_or_a_named_refusal(document: dict[str, Any], chat: bool) -> None:
    base: dict[str, Any] = {"model": "generate"}
    base |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    try:
        request = completion_request(base | document, chat)
    except OpenAIError as exc:
        assert exc.param is None or exc.param in document or exc.param.startswith("messages")
        return
    assert 1 <= request.sampling.max_tokens <= MAX_TOKENS


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("n", 1, True),
        ("n", 2, False),
        ("top_p", 1.0, True),
        ("top_p", 0.9, False),
        ("echo", False, True),
        ("echo", 0, False),
        ("logprobs", None, True),
        ("logprobs", 1, False),
    ],
)
def test_unserved_fields_pass_only_at_their_default(field: str, value: Any, allowed: bool) -> None:
    document = {"model": "generate", "prompt": "hi", field: value}
    if allowed:
        completion_request(document, chat=False)
    else:
        with pytest.raises(OpenAIError) as refused:
            completion_request(document, chat=False)
        assert refused.value.param == field


def test_a_chat_is_rendered_by_the_models_template() -> None:
    messages = Messages((("system", "be {role}"), ("user", "hi")))
    assert (
        rendered(messages, "<{role}>{content}\n", "m") == "<system>be {role}\n<user>hi\n<assistant>"
    )
    with pytest.raises(OpenAIError, match="declares no chat template"):
        rendered(messages, None, "m")
