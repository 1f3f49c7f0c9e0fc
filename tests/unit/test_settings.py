"""Server options that need more than a type: refused at parse time with a usage error."""

from __future__ import annotations

import pytest

from service import settings


def test_max_concurrent_rpcs_is_bounded_and_positive() -> None:
    assert settings.parse([]).max_concurrent_rpcs == 1024
    assert settings.parse(["--max-concurrent-rpcs", "3"]).max_concurrent_rpcs == 3
    with pytest.raises(SystemExit):
        settings.parse(["--max-concurrent-rpcs", "0"])
