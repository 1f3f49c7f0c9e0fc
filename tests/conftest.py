from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import EXAMPLE_MODELS, ServerProcess, running_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real server process with every example model, shared by the session's tests.
    Tests that disturb it (kill workers, stop it) start their own."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(Path(EXAMPLE_MODELS), log) as process:
        yield process
