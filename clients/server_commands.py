"""The `paddlequic` commands that run server code (serve, topology, keygen, sign, verify).
They import it when they run, so a client-only install (`pip install paddlequic`) starts fast
and says what to install instead of failing with a traceback."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def server_extra(command: str) -> Iterator[None]:
    """`pip install paddlequic` installs the client only: server commands then stop with one
    line saying what to install instead of a traceback."""
    try:
        yield
    except ModuleNotFoundError as exc:
        raise SystemExit(
            f"error: `paddlequic {command}` needs the server, which this install lacks "
            f"(no module {exc.name!r}): pip install 'paddlequic[server]'"
        ) from None


def serve(argv: Sequence[str]) -> int:
    with server_extra("serve"):
        from service.server import main as serve_main

    return serve_main(argv)


def topology(argv: Sequence[str]) -> int:
    with server_extra("topology"):  # NVML is imported when the command runs
        from service.topology_command import main as topology_main

        return topology_main(argv)


def _keygen(args: argparse.Namespace) -> int:
    with server_extra("keygen"):
        from service.lifecycle.signatures import generate_keys

    private = Path(args.out).with_suffix(".key")
    public = private.with_suffix(".pub")
    fingerprint = generate_keys(private, public)
    print(f"ECDSA P-256 key {fingerprint[:16]}: private {private} (mode 0600, keep it secret)")
    print(f"public {public}: copy it into the server's --trusted-keys directory")
    return 0


def _sign(args: argparse.Namespace) -> int:
    with server_extra("sign"):
        from service.lifecycle.signatures import sign

    print(f"signed: {sign(Path(args.model_dir), Path(args.key))}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Each version as the server checks it at load."""
    with server_extra("verify"):
        from service.lifecycle.repository import RepositoryError, read_config
        from service.lifecycle.signatures import load_trust
        from service.lifecycle.signing import SignatureError, TrustError, check_version
        from service.model.files import ENSEMBLE

    model_dir = Path(args.model_dir)
    try:
        trust = load_trust(
            Path(args.trusted_keys) if args.trusted_keys else None,
            Path(args.trusted_ca) if args.trusted_ca else None,
        )
        versions = sorted(
            int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()
        )
    except (TrustError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        # An ensemble has no files: version 1 stands for its config without version directories.
        ensemble = read_config(model_dir, model_dir.name).platform == ENSEMBLE
    except RepositoryError as exc:
        print(f"REFUSED: {exc}", file=sys.stderr)
        return 1
    if ensemble:
        versions = versions or [1]
    if not versions:
        print(f"REFUSED: {model_dir} has no version directories", file=sys.stderr)
        return 1
    refused = 0
    for version in versions:
        try:
            signer = check_version(
                model_dir, model_dir.name, version, trust, None, ensemble=ensemble
            )
        except SignatureError as exc:
            print(f"REFUSED version {version}: {exc}", file=sys.stderr)
            refused += 1
            continue
        print(f"OK version {version}: signed by {signer}; config.pbtxt and every file match")
    return 1 if refused else 0


def add_signing_parsers(sub: Any) -> None:
    """keygen, sign and verify, on the CLI's subcommand parsers."""
    keygen = sub.add_parser("keygen", help="create an ECDSA P-256 key pair for signing models")
    keygen.add_argument("--out", default="model-signing", help="NAME: writes NAME.key, NAME.pub")
    sign = sub.add_parser(
        "sign", help="sign a model directory (OpenSSF model-signing): writes MODEL/model.sig"
    )
    sign.add_argument("model_dir")
    sign.add_argument("--key", required=True, help="the private key (PEM) from keygen")
    verify = sub.add_parser("verify", help="check a model's versions as the server would")
    verify.add_argument("model_dir")
    verify.add_argument("--trusted-keys", help="directory of public keys (*.pem, *.pub)")
    verify.add_argument("--trusted-ca", help="PEM file of CA certificates")


SIGNING_HANDLERS = {"keygen": _keygen, "sign": _sign, "verify": _verify}
