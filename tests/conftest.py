from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reference import EXAMPLES
from tests.servers import ServerProcess, model_repository, running_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real server process with every example model, shared by the session's tests.
    Tests that disturb it (kill workers, stop it) start their own."""
    root = tmp_path_factory.mktemp("server")
    repository = model_repository(root / "models", EXAMPLES)
    with running_server(repository, root / "server.log") as process:
        yield process


@pytest.fixture(scope="session")
def certs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Development certificates shared by every server of the session (created by the first)."""
    return tmp_path_factory.mktemp("certs")
