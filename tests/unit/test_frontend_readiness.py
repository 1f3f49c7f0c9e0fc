"""A server with front-end processes is ready only once each has said its listeners accept
calls: a readiness probe answered by the first one up said nothing of the others."""

from __future__ import annotations

from service.frontends.parent import FrontendReadiness
from service.registry.versions import ModelRegistry


def test_ready_once_every_frontend_listens_and_a_restart_keeps_it() -> None:
    changes: list[bool] = []
    models = ModelRegistry(lambda: changes.append(models.accepting))
    models.loading_done = True
    readiness = FrontendReadiness(models, 3)
    assert not models.all_ready
    readiness.listening("0")
    readiness.listening("0")  # the same front-end, restarted: still one of three
    readiness.listening("2")
    assert not models.all_ready and changes == []
    readiness.listening("1")
    assert models.all_ready and changes == [True]  # watchers (health, views) told once
    readiness.listening("1")
    assert models.all_ready and changes == [True]
