"""A real redis-server for the shared ticket store's tests: own port, own directory, no
persistence, stopped by the fixture that started it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from tests.servers import free_port

START_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    """CI installs redis-server (.ci/run), so there a missing binary fails instead of skipping."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing in CI (.ci/run installs it)")
        pytest.skip("redis-server is not installed (Debian package redis-server)")
    return binary


@contextmanager
def running_redis(directory: Path, port: int | None = None) -> Iterator[str]:
    """Yields the server's redis:// URL once it answers PING."""
    binary = redis_server_binary()
    port = port or free_port()
    directory.mkdir(parents=True, exist_ok=True)
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir"]
    with (directory / "redis.log").open("wb") as log:
        process = subprocess.Popen([*args, str(directory), "--appendonly", "no"], stdout=log)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError as exc:
                if process.poll() is not None or time.monotonic() > deadline:
                    logged = directory / "redis.log"
                    raise RuntimeError(f"redis-server did not start: {logged}") from exc
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
