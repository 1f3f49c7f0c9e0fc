"""The `paddlequic` command line. `serve` imports the server lazily, so client commands start
fast and never load server code."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from clients import __version__
from clients.perf.command import add_arguments as add_perf_arguments
from clients.server_commands import SIGNING_HANDLERS, add_signing_parsers, serve, topology

DEFAULT_URL = os.environ.get("PADDLEQUIC_URL", "grpc://localhost:8001")
DEFAULT_CA_FILE = os.environ.get("PADDLEQUIC_CA_FILE") or (
    "certs/ca.pem" if Path("certs/ca.pem").is_file() else None
)
DEFAULT_CLIENT_CERT = os.environ.get("PADDLEQUIC_CLIENT_CERT") or None
DEFAULT_CLIENT_KEY = os.environ.get("PADDLEQUIC_CLIENT_KEY") or None
# NAME=VALUE pairs separated by `;`: secrets stay out of the command line (visible in ps).
DEFAULT_HEADERS = [h for h in os.environ.get("PADDLEQUIC_HEADERS", "").split(";") if h.strip()]


def _client(args: argparse.Namespace, tickets: Any = None, policy: Any = None) -> Any:
    from clients.inference_client import InferenceClient

    return InferenceClient(
        args.url,
        ca_file=args.ca_file,
        ticket_cache=tickets,
        client_cert=args.client_cert,
        client_key=args.client_key,
        metadata=[_header(h) for h in args.header or DEFAULT_HEADERS],
        transport_policy=policy,
    )


def _header(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name.strip():
        raise ValueError("--header takes NAME=VALUE (the value is not shown)")
    return name.strip().lower(), value


def _models(args: argparse.Namespace) -> int:
    with _client(args) as client:
        rows = [(m.name, m.version, m.state, m.reason) for m in client.index()]
    width = max((len(r[0]) for r in rows), default=5)
    print(f"{'MODEL':<{width}}  VERSION  STATE        REASON")
    for name, version, state, reason in rows:
        print(f"{name:<{width}}  {version:<7}  {state:<11}  {reason}")
    return 0


def _health(args: argparse.Namespace) -> int:
    with _client(args) as client:
        status = client.health(args.model or "")
    print(f"{args.model or 'server'}: {status}")
    return 0 if status == "SERVING" else 1


def _certs(args: argparse.Namespace) -> int:
    from transport.tls.certs import (
        describe_trust,
        ensure_dev_certificates,
        issue_client_certificate,
    )

    certs, created = ensure_dev_certificates(Path(args.dir), force=args.force)
    print(f"{'created' if created else 'kept'} development certificates in {certs.directory}")
    print(describe_trust(certs))
    for name in args.client or ():
        cert, key = issue_client_certificate(Path(args.dir), name)
        print(f"client certificate {name!r}: {cert}, key {key} (mode 0600)")
        print(f"  paddlequic infer --client-cert {cert} --client-key {key} ...")
    return 0


def random_inputs(
    metadata: Any, batch: int, seq_len: int, rng: np.random.Generator
) -> dict[str, np.ndarray[Any, Any]]:
    """Random tensors matching the model's metadata: the first -1 is the batch, other -1s a
    sequence length; integers stay small so embedding ids are in range."""
    from clients.tensors import random_array

    arrays = {}
    for tensor in metadata.inputs:
        shape = [
            (batch if axis == 0 else seq_len) if d == -1 else d
            for axis, d in enumerate(tensor.shape)
        ]
        arrays[tensor.name] = random_array(tensor.datatype, shape, rng)
    return arrays


def _infer(args: argparse.Namespace) -> int:
    from clients.sequences import SequenceParameters
    from clients.tickets import SessionTicketCache
    from clients.transport_policy import TransportPolicy

    tickets = (
        SessionTicketCache(args.tickets) if args.url.startswith(("h3://", "auto://")) else None
    )
    policy = TransportPolicy()  # auto://: what one connection learned, the next starts from
    client = _client(args, tickets, policy)
    try:
        if args.random:
            metadata = client.metadata(args.model, args.model_version)
            inputs = random_inputs(metadata, args.batch, args.seq_len, np.random.default_rng(0))
        elif args.input:
            inputs = {}
            for item in args.input:
                name, sep, path = item.partition("=")
                if not sep:
                    raise SystemExit(f"--input takes NAME=FILE.npy, got {item!r}")
                inputs[name] = np.load(Path(path))
        else:
            raise SystemExit("give --input NAME=FILE.npy (one per input) or --random")
        sequence = SequenceParameters() if args.sequence else None
        if sequence is not None:
            print(f"sequence id: {sequence.sequence_id}")
        for call in range(1, args.repeat + 1):
            if args.reconnect and call > 1:
                client.close()
                client = _client(args, tickets, policy)
            started = time.perf_counter()
            parameters = None if sequence is None else sequence.next(end=call == args.repeat)
            outputs = client.infer(
                args.model, inputs, version=args.model_version, parameters=parameters
            )
            if args.repeat > 1:
                elapsed = (time.perf_counter() - started) * 1e3
                mode = client.connect_mode
                print(f"call {call}: {client.transport} {mode:<14} {elapsed:8.2f} ms")
        print(f"transport: {client.transport}")
    finally:
        client.close()
    for name, array in outputs.items():
        print(f"{name}: {array.dtype} {list(array.shape)}")
        with np.printoptions(precision=4, suppress=True, threshold=40, edgeitems=3):
            print(array)
    return 0


def _generate(args: argparse.Namespace) -> int:
    """The text on stdout as it comes; how it ended on stderr."""
    from clients.generation import REQUIRED_INPUTS, GenerationError

    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    with _client(args) as client:
        try:
            names = [t.name for t in client.metadata(args.model, args.model_version).inputs]
        except grpc.RpcError as exc:
            raise SystemExit(_unreachable(args, exc)) from None
        if not set(REQUIRED_INPUTS) <= set(names):
            raise SystemExit(
                f"error: model {args.model!r} takes inputs {names}: `paddlequic generate` needs "
                "a generation model (inputs text and max_tokens, decoupled), such as the "
                "generate example"
            )
        started = time.perf_counter()
        first: float | None = None
        chunks = client.generate(
            args.model, args.prompt, args.max_tokens, args.temperature, args.seed,
            args.model_version, args.timeout,
        )  # fmt: skip
        finish, count = None, 0
        try:
            for chunk in chunks:
                count += 1
                first = first or time.perf_counter() - started
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                finish = chunk.finish_reason
        except GenerationError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C: the generation is cancelled, not left running
            print(f"\n[interrupted after {count} responses]", file=sys.stderr)
            return 130
        finally:
            chunks.close()  # cancels the generation when interrupted
    print()
    elapsed = time.perf_counter() - started
    print(
        f"[{finish or 'ended'}: {count} responses in {elapsed:.2f} s, first after "
        f"{(first or elapsed) * 1e3:.1f} ms]",
        file=sys.stderr,
    )
    return 0


def _unreachable(args: argparse.Namespace, exc: grpc.RpcError) -> str:
    """A failed first call, with what to check when the server could not be reached."""
    text = f"error: {exc.code().name}: {exc.details()}"
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        text += f"\n  is a server listening at {args.url}? (--url or PADDLEQUIC_URL)"
        if args.url.startswith(("h3://", "grpcs://")):
            text += "; for TLS, --ca-file names the CA that signed its certificate"
    return text


def _perf(args: argparse.Namespace) -> int:
    from clients.perf.command import run

    return run(args, [_header(h) for h in args.header or DEFAULT_HEADERS])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paddlequic", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the server (see `paddlequic serve --help`)", add_help=False)
    sub.add_parser(
        "topology",
        help="devices, links and where each model instance would go (--topology FILE)",
        add_help=False,
    )

    def client_command(name: str, help_text: str) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=help_text)
        command.add_argument(
            "--url",
            default=DEFAULT_URL,
            help="grpc://HOST:PORT (HTTP/2), h3://HOST:PORT (HTTP/3) or auto://HOST:PORT "
            "(HTTP/2, moving to HTTP/3 once the server advertises it and UDP gets through) "
            f"(env PADDLEQUIC_URL; default {DEFAULT_URL})",
        )
        command.add_argument(
            "--ca-file",
            default=DEFAULT_CA_FILE,
            help="CA certificate that signed the server's, for h3:// and grpcs:// "
            f"(env PADDLEQUIC_CA_FILE; default {DEFAULT_CA_FILE or 'system roots'})",
        )
        command.add_argument(
            "--client-cert",
            default=DEFAULT_CLIENT_CERT,
            help="PEM client certificate for servers that ask for one (mutual TLS) "
            "(env PADDLEQUIC_CLIENT_CERT)",
        )
        command.add_argument(
            "--client-key",
            default=DEFAULT_CLIENT_KEY,
            help="its PEM private key (env PADDLEQUIC_CLIENT_KEY; default: in --client-cert)",
        )
        command.add_argument(
            "--header",
            action="append",
            metavar="NAME=VALUE",
            help="call metadata, repeatable, e.g. a restricted protocol's "
            "triton-grpc-protocol-KEY=VALUE (env PADDLEQUIC_HEADERS, `;`-separated)",
        )
        return command

    certs = sub.add_parser("certs", help="create a development CA and server certificate")
    certs.add_argument("--dir", default="certs", help="where to write them (default certs)")
    certs.add_argument("--force", action="store_true", help="replace existing ones")
    certs.add_argument(
        "--client",
        action="append",
        metavar="NAME",
        help="also issue a client certificate NAME (mutual TLS), repeatable: "
        "DIR/client-NAME.pem and DIR/client-NAME-key.pem",
    )
    add_signing_parsers(sub)
    client_command("models", "list the model repository and each version's state")
    health = client_command("health", "check server (or one model's) health")
    health.add_argument("--model", help="a model name; the whole server when omitted")
    infer = client_command("infer", "run one inference and print the outputs")
    infer.add_argument("model")
    infer.add_argument("--model-version", default="", help="version; the newest ready if omitted")
    infer.add_argument("--input", action="append", metavar="NAME=FILE.npy", help="an input tensor")
    infer.add_argument("--random", action="store_true", help="random inputs shaped by metadata")
    infer.add_argument("--batch", type=int, default=1, help="batch size for --random")
    infer.add_argument("--seq-len", type=int, default=8, help="variable dims for --random")
    infer.add_argument("--repeat", type=int, default=1, help="send the request N times")
    infer.add_argument(
        "--sequence",
        action="store_true",
        help="the --repeat requests are one sequence of a sequence model (first starts it, last "
        "ends it), under a random 63-bit id: without a client certificate the id is the "
        "sequence's only key",
    )
    infer.add_argument(
        "--reconnect", action="store_true", help="a new connection for every call (with --repeat)"
    )
    infer.add_argument(
        "--tickets",
        help="h3, auto: keep TLS session tickets and the server's address token in this file "
        "(mode 0600, secret) so a later run resumes with 0-RTT and skips a QUIC Retry",
    )
    generate = client_command(
        "generate", "stream a generation model's text as it is produced (decoupled models)"
    )
    generate.add_argument("model")
    generate.add_argument("prompt")
    generate.add_argument(
        "--max-tokens", type=int, default=64, help="tokens at most (default %(default)s)"
    )
    generate.add_argument(
        "--temperature", type=float, help="sample at this temperature (default: greedy)"
    )
    generate.add_argument("--seed", type=int, help="the sampling seed (repeatable answers)")
    generate.add_argument("--model-version", default="", help="version; the newest if omitted")
    generate.add_argument(
        "--timeout", type=float, help="seconds for the whole generation (default: none)"
    )
    perf = client_command(
        "perf", "load-test a model: throughput and latency per concurrency (like perf_analyzer)"
    )
    add_perf_arguments(perf)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.getLogger("quic").setLevel(logging.CRITICAL)  # errors reach the user as statuses
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    if argv[:1] == ["topology"]:
        return topology(argv[1:])
    args = build_parser().parse_args(argv)
    handlers = {
        "models": _models,
        "health": _health,
        "infer": _infer,
        "generate": _generate,
        "perf": _perf,
        "certs": _certs,
        **SIGNING_HANDLERS,
    }
    try:
        return handlers[args.command](args)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:  # OSError: e.g. a certificate file that is missing
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
