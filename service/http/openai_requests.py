"""The bodies of OpenAI's `POST /v1/completions` and `/v1/chat/completions`, checked: each field
this server honours within its bound (the bound named in the refusal), and a field it does not
honour refused by name unless it holds OpenAI's default (`n: 1` passes, `n: 2` is refused:
never silently ignored)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from service.http.textgen import Sampling
from service.inference.errors import ServiceError, echoed

# Per request.
MAX_TOKENS = 4096  # max_tokens (the model may allow fewer: its own refusal says so)
DEFAULT_MAX_TOKENS = 16  # OpenAI's for completions; chat's too (the server knows no context)
MAX_PROMPT_CHARS = 1 << 16  # a prompt, or a chat's messages once rendered
MAX_MESSAGES = 256  # a chat's messages
MAX_STOP = 4  # stop sequences, as OpenAI allows
MAX_STOP_CHARS = 256  # each
MAX_TEMPERATURE = 2.0  # OpenAI's range is 0 to 2
MAX_MODEL_CHARS = 256
ROLES = ("system", "user", "assistant")

# Fields served as OpenAI defines them; `user` is the caller's own label, stored nowhere.
_COMMON = {"model", "max_tokens", "temperature", "seed", "stop", "stream", "stream_options", "n"}
_HONOURED = {
    False: _COMMON | {"prompt", "user"},
    True: _COMMON | {"messages", "max_completion_tokens", "user"},
}
# Fields not served, with the values that mean "not used" (accepted, as OpenAI's defaults).
_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "top_p": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None, False),
}


class OpenAIError(ServiceError):
    """A refusal as OpenAI words it: the field it concerns (`param`) and a short `kind` (its
    `code`), besides the message naming the bound."""

    def __init__(
        self,
        message: str,
        param: str | None,
        kind: str,
        code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
    ) -> None:
        super().__init__(code, message)
        self.param = param
        self.kind = kind


@dataclass(frozen=True)
class Messages:
    """A chat's messages (role, content), to be rendered by the model's template."""

    items: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | Messages  # a chat's messages until the model's template renders them
    sampling: Sampling  # its prompt empty for a chat
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


def completion_request(document: Any, chat: bool) -> CompletionRequest:
    if not isinstance(document, dict):
        raise OpenAIError("the request body must be a JSON object", None, "invalid_body")
    _refuse_unserved(document, chat)
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' must name a model (GET /v1/models)", "model", "invalid_value")
    if len(model) > MAX_MODEL_CHARS:
        raise OpenAIError(
            f"'model' has {len(model)} characters; at most {MAX_MODEL_CHARS}",
            "model",
            "invalid_value",
        )
    n = document.get("n")
    if n is not None and n != 1:
        raise OpenAIError(
            f"'n' is {echoed(str(n))}: this server generates one choice per request (n: 1)",
            "n",
            "unsupported_value",
        )
    stream = _boolean(document, "stream")
    options = document.get("stream_options")
    if options is not None and not stream:
        raise OpenAIError(
            "'stream_options' is only allowed with 'stream': true",
            "stream_options",
            "invalid_value",
        )
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise OpenAIError(
            "'stream_options' takes one field, include_usage", "stream_options", "invalid_value"
        )
    include_usage = _boolean(options or {}, "include_usage")
    prompt: str | Messages = (
        _messages(document.get("messages")) if chat else _prompt(document.get("prompt"))
    )
    sampling = Sampling(
        prompt if isinstance(prompt, str) else "",
        _max_tokens(document, chat),
        _temperature(document.get("temperature")),
        _seed(document.get("seed")),
        _stop(document.get("stop")),
    )
    return CompletionRequest(model, prompt, sampling, stream, include_usage)


def rendered(messages: Messages, template: str | None, model: str) -> str:
    """The chat's prompt: each message through the model's template (its `{role}` and
    `{content}` replaced), then the template's part before `{content}` for the answer."""
    if template is None:
        raise OpenAIError(
            f"model '{model}' declares no chat template (model config parameter "
            "chat_template); use /v1/completions with a prompt",
            "messages",
            "no_chat_template",
        )
    role_at, content_at = template.find("{role}"), template.find("{content}")
    if role_at < 0 or content_at < role_at:
        raise OpenAIError(
            f"model '{model}': its chat_template must hold {{role}} and then {{content}}",
            None,
            "invalid_chat_template",
            grpc.StatusCode.INTERNAL,
        )
    parts = [_message(template, role, content) for role, content in messages.items]
    parts.append(template[:content_at].replace("{role}", "assistant"))
    prompt = "".join(parts)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise OpenAIError(
            f"the messages make a prompt of {len(prompt)} characters; at most {MAX_PROMPT_CHARS}",
            "messages",
            "prompt_too_long",
        )
    return prompt


def _message(template: str, role: str, content: str) -> str:
    # Split first: a message's text holding "{role}" stays as it was written.
    before, _, after = template.partition("{content}")
    return before.replace("{role}", role) + content + after.replace("{role}", role)


def _refuse_unserved(document: Mapping[str, Any], chat: bool) -> None:
    for key, value in document.items():
        if key in _HONOURED[chat]:
            continue
        defaults = _DEFAULTS.get(key)
        if defaults is None:
            raise OpenAIError(
                f"unknown field '{echoed(key)}'", echoed(key), "unsupported_parameter"
            )
        if not any(_same(value, d) for d in defaults):
            raise OpenAIError(
                f"'{key}' is not supported by this server; leave it out or set it to "
                f"{json.dumps(defaults[-1])}",
                key,
                "unsupported_parameter",
            )


def _same(value: Any, default: Any) -> bool:
    """JSON's equality: `false` is not `0`, `1.0` is `1`."""
    if default is None or isinstance(default, bool):
        return value is default
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == default
    return bool(value == default)


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]  # a batch of one prompt
    if not isinstance(value, str):
        raise OpenAIError(
            "'prompt' must be a string (one prompt: send a request per prompt)",
            "prompt",
            "invalid_value",
        )
    if len(value) > MAX_PROMPT_CHARS:
        raise OpenAIError(
            f"'prompt' has {len(value)} characters; at most {MAX_PROMPT_CHARS}",
            "prompt",
            "prompt_too_long",
        )
    return value


def _messages(value: Any) -> Messages:
    if not isinstance(value, list) or not value:
        raise OpenAIError("'messages' must be a non-empty array", "messages", "invalid_value")
    if len(value) > MAX_MESSAGES:
        raise OpenAIError(
            f"'messages' holds {len(value)} messages; at most {MAX_MESSAGES}",
            "messages",
            "too_many_messages",
        )
    items = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
            raise OpenAIError(
                f"'{where}' must be an object with role and content", where, "invalid_value"
            )
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise OpenAIError(
                f"'{where}.role' must be one of {', '.join(ROLES)}", where, "invalid_value"
            )
        if isinstance(content, list):  # content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise OpenAIError(
                    f"'{where}.content' parts must be text parts", where, "unsupported_value"
                )
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise OpenAIError(f"'{where}.content' must be a string", where, "invalid_value")
        if len(content) > MAX_PROMPT_CHARS:
            raise OpenAIError(
                f"'{where}.content' has {len(content)} characters; at most {MAX_PROMPT_CHARS}",
                where,
                "prompt_too_long",
            )
        items.append((str(role), content))
    return Messages(tuple(items))


def _max_tokens(document: Mapping[str, Any], chat: bool) -> int:
    key = "max_completion_tokens" if chat and "max_completion_tokens" in document else "max_tokens"
    value = document.get(key)
    if value is None:
        return DEFAULT_MAX_TOKENS
    if not _integer(value) or value < 1:
        raise OpenAIError(f"'{key}' must be an integer of at least 1", key, "invalid_value")
    if value > MAX_TOKENS:
        raise OpenAIError(
            f"'{key}' is {value}; at most {MAX_TOKENS} per request", key, "max_tokens_too_large"
        )
    return int(value)


def _temperature(value: Any) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value <= MAX_TEMPERATURE
    ):
        raise OpenAIError(
            f"'temperature' must be a number from 0 to {MAX_TEMPERATURE:g}",
            "temperature",
            "invalid_value",
        )
    return float(value)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if not _integer(value) or not -(2**63) <= value < 2**63:
        raise OpenAIError("'seed' must be a 64-bit integer", "seed", "invalid_value")
    return int(value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise OpenAIError("'stop' must be a string or an array of strings", "stop", "invalid_value")
    if len(stops) > MAX_STOP:
        raise OpenAIError(
            f"'stop' holds {len(stops)} sequences; at most {MAX_STOP}", "stop", "invalid_value"
        )
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise OpenAIError(
            f"a stop sequence has more than {MAX_STOP_CHARS} characters", "stop", "invalid_value"
        )
    return tuple(stops)


def _boolean(document: Mapping[str, Any], key: str) -> bool:
    value = document.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(f"'{key}' must be true or false", key, "invalid_value")
    return value


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
