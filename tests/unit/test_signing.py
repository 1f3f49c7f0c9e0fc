"""Signed models (OpenSSF model-signing): keygen -> sign -> check, every way around the check
refused with the file or key named, certificate trust, and interop with the upstream CLI."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import model_signing
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from service.lifecycle.signatures import Trust, generate_keys, load_trust, sign
from service.lifecycle.signing import (
    SIGNATURE_FILE,
    SignatureError,
    SigningPolicy,
    TrustError,
    check_version,
)
from tests.servers import EXAMPLE_MODELS, REPO_ROOT


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """mlp with a nested file in its version, so directories are covered too."""
    target = tmp_path / "repo" / "mlp"
    shutil.copytree(EXAMPLE_MODELS / "mlp", target, symlinks=True)
    (target / "1" / "extra").mkdir()
    (target / "1" / "extra" / "vocab.txt").write_text("a\nb\n")
    return target


@pytest.fixture
def key(tmp_path: Path) -> Path:
    (tmp_path / "trusted").mkdir()
    generate_keys(tmp_path / "signer.key", tmp_path / "trusted" / "signer.pub")
    return tmp_path / "signer.key"


def trusted(key: Path) -> Trust:
    return load_trust(key.parent / "trusted", None)


def upstream(*args: str) -> subprocess.CompletedProcess[str]:
    """The model_signing CLI of the pinned package."""
    command = [sys.executable, "-m", "model_signing", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_keys_are_ecdsa_p256_and_the_private_one_is_private(key: Path) -> None:
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    public = serialization.load_pem_public_key((key.parent / "trusted" / "signer.pub").read_bytes())
    assert isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name == "secp256r1"


def test_checked_bytes_are_the_copied_bytes(model: Path, key: Path, tmp_path: Path) -> None:
    """(b): the copy holds exactly what was hashed; later writes to the repository do not
    reach it."""
    sign(model, key)
    copy = tmp_path / "copy"
    copy.mkdir()
    assert check_version(model, "mlp", 1, trusted(key), copy) == "signer.pub"
    files = sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file())
    assert files == [
        "1/extra/vocab.txt",
        "1/inference.json",
        "1/inference.pdiparams",
        "config.pbtxt",
    ]
    for name in files:
        assert (copy / name).read_bytes() == (model / name).read_bytes()
        assert stat.S_IMODE((copy / name).stat().st_mode) == 0o400
    original = (copy / "1" / "inference.pdiparams").read_bytes()
    (model / "1" / "inference.pdiparams").write_bytes(b"\0" * 64)
    assert (copy / "1" / "inference.pdiparams").read_bytes() == original


def _replace(path: Path, make: Callable[[Path], object]) -> None:
    """Move `path` aside (to "moved" next to it) and make something else in its place."""
    path.rename(path.with_name("moved"))
    make(path)


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (
            lambda m: (m / "1" / "inference.pdiparams").write_bytes(b"\0" * 16),
            "mlp/1/inference.pdiparams was modified",
        ),
        (lambda m: (m / "1" / "extra" / "vocab.txt").unlink(), "1/extra/vocab.txt: signed file"),
        (lambda m: (m / "1" / "backdoor.json").write_text("{}"), "1/backdoor.json was added"),
        # (c): config.pbtxt is signed too.
        (
            lambda m: (m / "config.pbtxt").write_text(
                (m / "config.pbtxt").read_text() + 'parameters { key: "cpu_threads" '
                'value: { string_value: "64" } }\n'
            ),
            "mlp/config.pbtxt was modified",
        ),
        (
            lambda m: (
                (m / "1" / "extra" / "vocab.txt").unlink()
                or (m / "1" / "extra" / "vocab.txt").symlink_to("/etc/hostname")
            ),
            "1/extra/vocab.txt is a symlink",
        ),
        (
            lambda m: _replace(m / "1" / "extra" / "vocab.txt", os.mkfifo),
            "vocab.txt is not a regular",
        ),
        (lambda m: _replace(m / "1", lambda p: p.symlink_to("moved")), "1 is a symlink"),
        (
            lambda m: _replace(m / "config.pbtxt", lambda p: p.symlink_to("moved")),
            "config.pbtxt is a symlink",
        ),
    ],
)
def test_each_tampering_is_refused_naming_the_file(
    model: Path, key: Path, tamper: Callable[[Path], object], message: str
) -> None:
    sign(model, key)
    tamper(model)
    with pytest.raises(SignatureError, match=message):
        check_version(model, "mlp", 1, trusted(key), None)


def test_a_signature_names_its_model_and_versions(model: Path, key: Path) -> None:
    """(d): an unlisted version is refused without blocking the listed one; a signature moved
    to another model's directory is refused."""
    sign(model, key)
    shutil.copytree(model / "1", model / "2")  # an old signed version renamed into a new one
    check_version(model, "mlp", 1, trusted(key), None)
    with pytest.raises(SignatureError, match="version 2 is not in the signed manifest"):
        check_version(model, "mlp", 2, trusted(key), None)
    renamed = model.parent / "mlp_v2"
    shutil.copytree(model, renamed)
    with pytest.raises(SignatureError, match="signed for model 'mlp', not 'mlp_v2'"):
        check_version(renamed, "mlp_v2", 1, trusted(key), None)


def test_a_forged_statement_fails_the_signature(model: Path, key: Path) -> None:
    sign(model, key)
    bundle = json.loads((model / SIGNATURE_FILE).read_text())
    envelope = bundle["dsseEnvelope"]
    statement = json.loads(base64.b64decode(envelope["payload"]))
    statement["subject"][0]["name"] = "other"  # edit the statement without re-signing it
    envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    (model / SIGNATURE_FILE).write_text(json.dumps(bundle))
    with pytest.raises(SignatureError, match="not signed by a trusted key"):
        check_version(model, "mlp", 1, trusted(key), None)


def test_unknown_key_and_unsigned_models(model: Path, key: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    with pytest.raises(SignatureError, match="is not signed"):
        SigningPolicy(trusted(key), required=True).check(model, "mlp", 1, copy)
    assert not SigningPolicy(trusted(key), required=False).check(model, "mlp", 1, copy)
    stranger = tmp_path / "stranger.key"
    generate_keys(stranger, tmp_path / "stranger.pub")
    sign(model, stranger)
    hint = hashlib.sha256((tmp_path / "stranger.pub").read_bytes()).hexdigest()
    # A bad signature is refused even where unsigned models are allowed.
    with pytest.raises(SignatureError, match=f"names key {hint}.*signer.pub: Key mismatch"):
        SigningPolicy(trusted(key), required=False).check(model, "mlp", 1, copy)


def test_a_trusted_keys_file_that_is_not_a_key_stops_the_server(tmp_path: Path) -> None:
    (tmp_path / "notes.pem").write_text("not a key")
    with pytest.raises(TrustError, match=r"notes\.pem is not an ECDSA"):
        load_trust(tmp_path, None)


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    signer: object,
    signs: bool = True,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=issuer is not None and signs,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=issuer is None,
                crl_sign=issuer is None,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    assert isinstance(signer, ec.EllipticCurvePrivateKey)
    return builder.sign(signer, hashes.SHA256())


def _pem(path: Path, certificate: x509.Certificate) -> Path:
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return path


def test_certificates_chaining_to_the_trusted_ca(model: Path, tmp_path: Path) -> None:
    ca_key, leaf_key, other_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = _certificate("release CA", ca_key, None, ca_key)
    other_ca = _pem(tmp_path / "other-ca.pem", _certificate("other CA", other_key, None, other_key))
    leaf = _pem(tmp_path / "leaf.pem", _certificate("release", leaf_key, ca, ca_key))
    ca_file = _pem(tmp_path / "ca.pem", ca)
    private = tmp_path / "leaf.key"
    private.write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    model_signing.signing.Config().use_certificate_signer(
        private_key=private, signing_certificate=leaf, certificate_chain=[ca_file]
    ).set_hashing_config(
        model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE])
    ).sign(model, model / SIGNATURE_FILE)
    assert check_version(model, "mlp", 1, load_trust(None, ca_file), None) == "ca.pem"
    with pytest.raises(SignatureError, match="not signed by a trusted key"):
        check_version(model, "mlp", 1, load_trust(None, other_ca), None)
    # A leaf the CA did not give the digital-signature key usage cannot sign models.
    no_signing = _pem(
        tmp_path / "no-signing.pem", _certificate("release", leaf_key, ca, ca_key, signs=False)
    )
    model_signing.signing.Config().use_certificate_signer(
        private_key=private, signing_certificate=no_signing, certificate_chain=[ca_file]
    ).set_hashing_config(
        model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE])
    ).sign(model, model / SIGNATURE_FILE)
    with pytest.raises(SignatureError, match="not signed by a trusted key"):
        check_version(model, "mlp", 1, load_trust(None, ca_file), None)


@pytest.mark.parametrize("curve", [ec.SECP384R1(), ec.SECP521R1()], ids=lambda c: c.name)
def test_p384_and_p521_keys_are_trusted_and_other_files_ignored(
    model: Path, tmp_path: Path, curve: ec.EllipticCurve
) -> None:
    key = ec.generate_private_key(curve)
    private = tmp_path / "release.key"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "release.pem").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    (keys / "README.txt").write_text("only *.pem and *.pub files are keys")
    sign(model, private)
    assert check_version(model, "mlp", 1, load_trust(keys, None), None) == "release.pem"


def test_the_upstream_cli_verifies_our_signatures(model: Path, key: Path) -> None:
    sign(model, key)
    public = key.parent / "trusted" / "signer.pub"
    verified = upstream(
        "verify", "key", str(model), "--signature", str(model / SIGNATURE_FILE),
        "--public_key", str(public),
    )  # fmt: skip
    assert verified.returncode == 0, verified.stderr
    (model / "1" / "inference.json").write_text("{}")
    refused = upstream(
        "verify", "key", str(model), "--signature", str(model / SIGNATURE_FILE),
        "--public_key", str(public),
    )  # fmt: skip
    assert refused.returncode == 1 and "inference.json" in refused.stderr


def test_we_accept_what_the_upstream_cli_signs(model: Path, key: Path) -> None:
    signed = upstream(
        "sign", "key", str(model), "--private_key", str(key),
        "--signature", str(model / SIGNATURE_FILE),
    )  # fmt: skip
    assert signed.returncode == 0, signed.stderr
    assert check_version(model, "mlp", 1, trusted(key), None) == "signer.pub"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "clients.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)


def test_cli_round_trip(model: Path, tmp_path: Path) -> None:
    keys = tmp_path / "trusted"
    keys.mkdir()
    assert _cli("keygen", "--out", str(keys / "release")).returncode == 0
    private = keys / "release.key"
    private.rename(tmp_path / "release.key")  # the private key never sits with trusted keys
    assert _cli("sign", str(model), "--key", str(tmp_path / "release.key")).returncode == 0
    ok = _cli("verify", str(model), "--trusted-keys", str(keys))
    assert ok.returncode == 0 and "OK version 1: signed by release.pub" in ok.stdout
    (model / "1" / "inference.json").write_text("{}")
    refused = _cli("verify", str(model), "--trusted-keys", str(keys))
    assert refused.returncode == 1 and "mlp/1/inference.json was modified" in refused.stderr


ENSEMBLE_CONFIG = """
platform: "ensemble"
max_batch_size: 8
input [ { name: "features", data_type: TYPE_FP32, dims: [ 256 ] } ]
output [ { name: "probs", data_type: TYPE_FP32, dims: [ 10 ] } ]
ensemble_scheduling {
  step [
    { model_name: "mlp" model_version: -1
      input_map { key: "input" value: "features" }
      output_map { key: "probabilities" value: "probs" } }
  ]
}
"""


@pytest.mark.parametrize("version_dir", [False, True])
def test_an_ensemble_is_signed_and_checked_like_a_model(
    tmp_path: Path, key: Path, version_dir: bool
) -> None:
    """Its config.pbtxt (the steps) is what is signed; a version directory (Triton's empty
    `1/`) is optional and holds nothing unsigned."""
    pair = tmp_path / "repo" / "pair"
    pair.mkdir(parents=True)
    (pair / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    if version_dir:
        (pair / "1").mkdir()
    copy = tmp_path / "copy"
    copy.mkdir()
    policy = SigningPolicy(trusted(key), required=True)
    with pytest.raises(SignatureError, match="model 'pair' is not signed"):
        policy.check(pair, "pair", 1, copy, ensemble=True)
    sign(pair, key)
    assert policy.check(pair, "pair", 1, copy, ensemble=True)
    assert (copy / "config.pbtxt").read_text() == ENSEMBLE_CONFIG
    (pair / "1").mkdir(exist_ok=True)
    (pair / "1" / "model.py").write_text("import os\n")
    with pytest.raises(SignatureError, match=r"pair/1/model\.py was added after signing"):
        check_version(pair, "pair", 1, trusted(key), None, ensemble=True)
    (pair / "1" / "model.py").unlink()
    (pair / "config.pbtxt").write_text(ENSEMBLE_CONFIG.replace('"mlp"', '"other"'))  # its steps
    with pytest.raises(SignatureError, match=r"pair/config\.pbtxt was modified after signing"):
        check_version(pair, "pair", 1, trusted(key), None, ensemble=True)


def test_a_model_turned_into_an_ensemble_is_refused(model: Path, key: Path) -> None:
    """Replacing a signed model's config.pbtxt with an ensemble's changes its platform: the
    config no longer matches the signature, whichever way it is checked."""
    sign(model, key)
    (model / "config.pbtxt").write_text(ENSEMBLE_CONFIG.replace('"mlp"', '"resnet18"'))
    for ensemble in (True, False):
        with pytest.raises(SignatureError, match=r"mlp/config\.pbtxt was modified after signing"):
            check_version(model, "mlp", 1, trusted(key), None, ensemble=ensemble)


def test_cli_verifies_an_ensemble(tmp_path: Path, key: Path) -> None:
    pair = tmp_path / "repo" / "pair"
    pair.mkdir(parents=True)
    (pair / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    signed = _cli("sign", str(pair), "--key", str(key))
    assert signed.returncode == 0, signed.stderr
    ok = _cli("verify", str(pair), "--trusted-keys", str(key.parent / "trusted"))
    assert ok.returncode == 0 and "OK version 1: signed by signer.pub" in ok.stdout
    (pair / "config.pbtxt").write_text(ENSEMBLE_CONFIG.replace('"mlp"', '"other"'))
    refused = _cli("verify", str(pair), "--trusted-keys", str(key.parent / "trusted"))
    assert refused.returncode == 1 and "pair/config.pbtxt was modified" in refused.stderr


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda m: (m / "labels.txt").write_text("forged\n"), "mlp/labels.txt was modified"),
        (lambda m: (m / "labels.txt").unlink(), "mlp/labels.txt: signed file was removed"),
        (
            lambda m: _replace(m / "labels.txt", lambda p: p.symlink_to("moved")),
            "labels.txt is a symlink",
        ),
    ],
)
def test_a_served_label_file_is_signed_and_copied(
    model: Path, key: Path, tmp_path: Path, tamper: Callable[[Path], object], message: str
) -> None:
    """Files of the model's directory the server reads (label_filename) are checked and copied
    with the version; a label file added after signing is refused too."""
    (model / "labels.txt").write_text("cat\ndog\n")
    sign(model, key)
    copy = tmp_path / "copy"
    copy.mkdir()
    check_version(model, "mlp", 1, trusted(key), copy, served_files=("labels.txt",))
    assert (copy / "labels.txt").read_text() == "cat\ndog\n"
    tamper(model)
    with pytest.raises(SignatureError, match=message):
        check_version(model, "mlp", 1, trusted(key), None, served_files=("labels.txt",))


def test_a_label_file_added_after_signing_is_refused(model: Path, key: Path) -> None:
    sign(model, key)
    check_version(model, "mlp", 1, trusted(key), None, served_files=("labels.txt",))  # none yet
    (model / "labels.txt").write_text("cat\n")
    with pytest.raises(SignatureError, match=r"mlp/labels\.txt was added after signing"):
        check_version(model, "mlp", 1, trusted(key), None, served_files=("labels.txt",))
