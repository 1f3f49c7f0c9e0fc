"""Server options: bounded defaults, values from flags and environment, refused values."""

from __future__ import annotations

import pytest

from service import settings


def test_max_concurrent_rpcs_is_bounded_and_positive() -> None:
    assert settings.parse([]).max_concurrent_rpcs == 1024
    assert settings.parse(["--max-concurrent-rpcs", "3"]).max_concurrent_rpcs == 3
    with pytest.raises(SystemExit):
        settings.parse(["--max-concurrent-rpcs", "0"])


def test_transport_limits_are_bounded_by_default() -> None:
    defaults = settings.parse([])
    assert defaults.max_metadata_bytes == 16 << 10
    assert defaults.h2_max_connections == 1024
    assert defaults.h2_handshake_timeout == 10.0
    assert defaults.idle_timeout == 60.0
    assert defaults.h3_max_connections == 1024
    assert defaults.h3_max_connections_per_address == 64
    assert defaults.h3_handshake_timeout == 10.0
    assert defaults.h3_retry == "auto"


def test_transport_limits_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PADDLEQUIC_H3_MAX_CONNECTIONS_PER_ADDRESS", "8")
    chosen = settings.parse(["--h3-retry", "always", "--max-metadata-bytes", "4096"])
    assert (chosen.h3_retry, chosen.max_metadata_bytes) == ("always", 4096)
    assert chosen.h3_max_connections_per_address == 8


def test_an_unknown_retry_mode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        settings.parse(["--h3-retry", "sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err


def test_alt_svc_max_age_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert settings.parse([]).alt_svc_max_age == 3600
    assert settings.parse(["--alt-svc-max-age", "0"]).alt_svc_max_age == 0
    with pytest.raises(SystemExit):
        settings.parse(["--alt-svc-max-age", "-1"])
    assert "--alt-svc-max-age must be from 0" in capsys.readouterr().err


def test_h3_token_lifetime_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert settings.parse([]).h3_token_lifetime == 86400.0
    monkeypatch.setenv("PADDLEQUIC_H3_TOKEN_LIFETIME", "0")
    assert settings.parse([]).h3_token_lifetime == 0.0
    for bad in ("-1", "nan", str(settings.MAX_H3_TOKEN_LIFETIME + 1)):
        with pytest.raises(SystemExit):
            settings.parse(["--h3-token-lifetime", bad])
        assert "--h3-token-lifetime must be from 0" in capsys.readouterr().err


def test_server_name_flag_and_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ServerMetadata answers: `triton` for Triton's clients that compare it."""
    assert settings.parse([]).server_name == "paddlequic"
    monkeypatch.setenv("PADDLEQUIC_SERVER_NAME", "triton")
    assert settings.parse([]).server_name == "triton"
    assert settings.parse(["--server-name", "edge-1"]).server_name == "edge-1"
    for bad in ("", "x" * (settings.MAX_SERVER_NAME + 1), "tab\there", "caf\u00e9"):
        with pytest.raises(SystemExit):
            settings.parse(["--server-name", bad])
        assert "--server-name takes 1 to 128 printable ASCII" in capsys.readouterr().err


def test_h3_receive_budgets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    defaults = settings.parse([])
    assert (defaults.h3_receive_budget, defaults.h3_receive_budget_per_address) == (
        1 << 30,
        256 << 20,
    )
    monkeypatch.setenv("PADDLEQUIC_H3_RECEIVE_BUDGET_PER_ADDRESS", str(32 << 20))
    assert settings.parse([]).h3_receive_budget_per_address == 32 << 20
    with pytest.raises(SystemExit):
        settings.parse(["--h3-receive-budget", "1000"])
    assert "--h3-receive-budget must be at least one stream window" in capsys.readouterr().err


def test_model_memory_budget_flag_and_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert settings.parse([]).model_memory_budget == 0  # off
    monkeypatch.setenv("PADDLEQUIC_MODEL_MEMORY_BUDGET", "2048")
    assert settings.parse([]).model_memory_budget == 2048
    assert settings.parse(["--model-memory-budget", "512"]).model_memory_budget == 512
    with pytest.raises(SystemExit):
        settings.parse(["--model-memory-budget", "-1"])
    assert "--model-memory-budget must be at least 0" in capsys.readouterr().err


def test_metrics_connections_are_bounded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    defaults = settings.parse([])
    assert (defaults.metrics_max_connections, defaults.metrics_timeout) == (16, 10.0)
    monkeypatch.setenv("PADDLEQUIC_METRICS_TIMEOUT", "2.5")
    chosen = settings.parse(["--metrics-max-connections", "4"])
    assert (chosen.metrics_max_connections, chosen.metrics_timeout) == (4, 2.5)
    for bad in (
        ["--metrics-max-connections", "0"],
        ["--metrics-timeout", "0"],
        ["--metrics-timeout", "nan"],
    ):
        with pytest.raises(SystemExit):
            settings.parse(bad)
        assert "--metrics-max-connections must be at least 1" in capsys.readouterr().err


def test_rest_connections_are_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    assert settings.parse([]).http_max_connections == 1024
    assert settings.parse(["--http-max-connections", "8"]).http_max_connections == 8
    with pytest.raises(SystemExit):
        settings.parse(["--http-max-connections", "0"])
    assert "--http-max-connections must be at least 1" in capsys.readouterr().err
