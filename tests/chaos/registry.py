"""Every attack of the suite, in the order it runs, with the outcomes that count as answered."""

from __future__ import annotations

from tests.chaos import floods, messages, streams, workers
from tests.chaos.harness import AttackSpec


def _both(*outcomes: str) -> frozenset[str]:
    return frozenset(f"{t} {o}" for t in ("h2", "h3") for o in outcomes)


REFUSED = "refused at transport"
# A stream may take every request (the server answered them; its memory is bounded by the RSS
# goal) or hold the writer back.
STREAM_HELD = (
    "wrote all, never read",
    "writes held back by flow control",
    "RESOURCE_EXHAUSTED",
    "CANCELLED",
)
REPLIES = frozenset(
    f"server replied {kind}" for kind in (*floods.LONG_HEADER_TYPES, "short header")
)

ATTACKS = (
    AttackSpec(
        "random model names",
        floods.random_names,
        frozenset({"NOT_FOUND"}),
        pending="metrics grow a series per unknown model name until branch pipeline is merged",
    ),
    AttackSpec("never-reading streams", streams.never_reading_streams, _both(*STREAM_HELD)),
    AttackSpec(
        "oversized messages",
        messages.oversized_messages,
        _both("RESOURCE_EXHAUSTED", REFUSED),
        pending="HTTP/3 answers an over-limit message without a status until h3bounds is merged",
    ),
    AttackSpec(
        "metadata bombs",
        messages.metadata_bombs,
        _both("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "INTERNAL", REFUSED),
        pending="HTTP/3 accepts 1 MiB of metadata until branch h3bounds is merged",
    ),
    AttackSpec(
        "HTTP/3 Initial flood",
        floods.initial_flood,
        REPLIES | {REFUSED},
        pending="every Initial creates connection state until branch h3bounds is merged",
    ),
    AttackSpec(
        "idle connections",
        floods.idle_connections,
        _both("connected", REFUSED, "UNAVAILABLE", "no answer"),
    ),
    AttackSpec(
        "slow-reading HTTP/3 client",
        streams.slow_reader,
        frozenset({"read slowly, then cancelled", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}),
    ),
    AttackSpec(
        "worker SIGKILL under load",
        workers.worker_sigkill,
        frozenset({"killed", "replaced"}),
        pending="requests inside a killed worker fail until branch watchdog is merged",
    ),
    AttackSpec(
        "worker SIGSTOP under load",
        workers.worker_sigstop,
        frozenset({"stopped", "replaced"}),
        pending="no execution_timeout_ms watchdog until branch watchdog is merged",
    ),
    AttackSpec(
        "poison input",
        workers.poison_input,
        frozenset({"UNAVAILABLE", "INTERNAL", "INVALID_ARGUMENT"}),
        pending="no testing_crash_on trigger until branch watchdog is merged",
    ),
    AttackSpec("hot reload under load", workers.hot_reload, frozenset({"OK"})),
)
