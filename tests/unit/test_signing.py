"""Signed model versions: the keygen -> sign -> verify round trip and every tampering case."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from service.signing import (
    SIGNATURE_FILE,
    SignatureError,
    SigningPolicy,
    generate_keys,
    load_trusted_keys,
    sign,
)
from tests.servers import EXAMPLE_MODELS, REPO_ROOT


@pytest.fixture
def version(tmp_path: Path) -> Path:
    target = tmp_path / "mlp" / "1"
    shutil.copytree(EXAMPLE_MODELS / "mlp" / "1", target)
    (target / "extra").mkdir()
    (target / "extra" / "vocab.txt").write_text("a\nb\n")
    return target


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    directory.mkdir()
    generate_keys(tmp_path / "signer.key", directory / "signer.pub")
    return tmp_path / "signer.key"


def trusted(keys: Path) -> SigningPolicy:
    return SigningPolicy(load_trusted_keys(keys.parent / "keys"), required=True)


def test_private_key_is_created_private(keys: Path) -> None:
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600


def test_a_signed_version_verifies(version: Path, keys: Path) -> None:
    sign(version, keys)
    trusted(keys).check(version)


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (
            lambda v: (v / "inference.pdiparams").write_bytes(b"\0" * 16),
            "inference.pdiparams was modified",
        ),
        (lambda v: (v / "extra" / "vocab.txt").unlink(), "extra/vocab.txt was removed"),
        (lambda v: (v / "backdoor.json").write_text("{}"), "backdoor.json was added"),
    ],
)
def test_each_tampering_is_refused_naming_the_file(
    version: Path, keys: Path, tamper: object, message: str
) -> None:
    sign(version, keys)
    tamper(version)  # type: ignore[operator]
    with pytest.raises(SignatureError, match=message):
        trusted(keys).check(version)


def test_a_forged_manifest_fails_the_signature(version: Path, keys: Path) -> None:
    sign(version, keys)
    signature = version / SIGNATURE_FILE
    document = json.loads(signature.read_text())
    document["files"][0][0] = "renamed.json"  # edit the manifest without re-signing it
    signature.write_text(json.dumps(document))
    with pytest.raises(SignatureError, match="signature does not match"):
        trusted(keys).check(version)


def test_unknown_key_and_unsigned_versions(version: Path, keys: Path, tmp_path: Path) -> None:
    with pytest.raises(SignatureError, match="not signed"):
        trusted(keys).check(version)
    SigningPolicy(load_trusted_keys(keys.parent / "keys"), required=False).check(version)
    stranger = tmp_path / "stranger.key"
    generate_keys(stranger, tmp_path / "stranger.pub")
    sign(version, stranger)
    with pytest.raises(SignatureError, match="unknown key"):
        trusted(keys).check(version)
    with pytest.raises(SignatureError, match="unknown key"):
        SigningPolicy(load_trusted_keys(keys.parent / "keys"), required=False).check(version)


def test_cli_round_trip(version: Path, tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "clients.cli", *args]
        return subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)

    keys = tmp_path / "trusted"
    keys.mkdir()
    assert cli("keygen", "--out", str(keys / "release")).returncode == 0
    private = keys / "release.key"
    private.rename(tmp_path / "release.key")  # the private key never sits with trusted keys
    assert cli("sign", str(version), "--key", str(tmp_path / "release.key")).returncode == 0
    ok = cli("verify", str(version), "--trusted-keys", str(keys))
    assert ok.returncode == 0 and "every file matches" in ok.stdout
    (version / "inference.json").write_text("{}")
    refused = cli("verify", str(version), "--trusted-keys", str(keys))
    assert refused.returncode == 1 and "inference.json was modified" in refused.stderr
