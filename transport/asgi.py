"""ASGI's shapes (https://asgi.readthedocs.io) as plain dicts, as every server passes them: what
an HTTP server of this package hands an application, and what the server's REST app takes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
