"""RepositoryModelLoad's `config` and `file:` parameters with tritonclient itself, as
Triton's simple_grpc_model_control.py sends them, against a server in explicit model control
with `simple` in its repository: run as a separate process (tritonclient's protos and ours
cannot share one descriptor pool), so this file imports nothing from ``protos``, ``service``
or ``tests``.

Writes JSON to ``--out``: for each step, what the server answered (a value, or the message of
the error tritonclient raised, with its status).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

WIND_DOWN_S = 60.0


def simple_config(name: str, max_batch_size: str) -> str:
    """The `simple` model's config in JSON, as Triton's clients send it (int as strings)."""
    tensor = {"data_type": "TYPE_INT32", "dims": ["16"]}
    return json.dumps(
        {
            "name": name,
            "backend": "python",
            "max_batch_size": max_batch_size,
            "input": [{"name": "INPUT0", **tensor}, {"name": "INPUT1", **tensor}],
            "output": [{"name": "OUTPUT0", **tensor}, {"name": "OUTPUT1", **tensor}],
            "instance_group": [{"kind": "KIND_CPU", "count": 1}],
        }
    )


def error_of(call: Callable[[], Any]) -> dict[str, Any] | None:
    """The status and message of the error a tritonclient call raised (None: it succeeded)."""
    try:
        call()
    except InferenceServerException as exc:
        return {"status": str(exc.status()), "message": str(exc.message())}
    return None


def sums(client: grpcclient.InferenceServerClient, model: str) -> list[int]:
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
    inputs[1].set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    result = client.infer(model, inputs)
    return [int(v) for v in result.as_numpy("OUTPUT0").ravel()]


def waited_for(log: Path, text: str) -> bool:
    deadline = time.monotonic() + WIND_DOWN_S
    while text not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def plain(
    client: grpcclient.InferenceServerClient,
    model_py: bytes,
    server_log: Path | None = None,
    server_pid: int = 0,
) -> dict[str, Any]:
    good = simple_config("simple", "4")
    uploaded = simple_config("uploaded", "2")
    answers: dict[str, Any] = {
        # simple_grpc_model_control.py's malformed config
        "bad_json": error_of(
            lambda: client.load_model(
                "simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}'
            )
        ),
        "bad_config": error_of(
            lambda: client.load_model("simple", config='{"backend": "onnxruntime"}')
        ),
        "good": error_of(lambda: client.load_model("simple", config=good)),
    }
    answers["good_max_batch_size"] = client.get_model_config("simple").config.max_batch_size
    answers["good_sums"] = sums(client, "simple")
    if server_log is not None:  # a rescan (SIGHUP) keeps the override
        os.kill(server_pid, signal.SIGHUP)
        answers["rescan_kept"] = waited_for(server_log, "rescan: simple keeps")
        answers["rescanned_max_batch_size"] = client.get_model_config(
            "simple"
        ).config.max_batch_size
    answers["files_without_config"] = error_of(
        lambda: client.load_model("uploaded", files={"file:1/model.py": model_py})
    )
    for label, path in (
        ("traversal", "file:../../1/model.py"),
        ("absolute", "file:/tmp/model.py"),
        ("dot", "file:1/./model.py"),
    ):
        answers[label] = error_of(
            functools.partial(client.load_model, "uploaded", config=uploaded, files={path: b"x"})
        )
    answers["oversized"] = error_of(
        lambda: client.load_model(
            "uploaded", config=uploaded, files={"file:1/model.py": model_py + b"#" * 4096}
        )
    )
    answers["too_many"] = error_of(
        lambda: client.load_model(
            "uploaded",
            config=uploaded,
            files={f"file:1/extra{i}.txt": b"x" for i in range(5)} | {"file:1/model.py": b""},
        )
    )
    answers["refused_left_unloaded"] = client.is_model_ready("uploaded")
    answers["upload"] = error_of(
        lambda: client.load_model("uploaded", config=uploaded, files={"file:1/model.py": model_py})
    )
    answers["upload_max_batch_size"] = client.get_model_config("uploaded").config.max_batch_size
    answers["upload_sums"] = sums(client, "uploaded")
    # simple_grpc_model_control.py's override: the model completes the rest
    answers["example"] = error_of(
        lambda: client.load_model("simple", config='{"max_batch_size":"16"}')
    )
    answers["example_max_batch_size"] = client.get_model_config("simple").config.max_batch_size
    client.load_model("simple")  # no override: config.pbtxt again
    answers["reloaded_max_batch_size"] = client.get_model_config("simple").config.max_batch_size
    answers["live"] = client.is_server_live()
    return answers


def signed(
    client: grpcclient.InferenceServerClient, model_py: bytes, signed_dir: Path
) -> dict[str, Any]:
    """Under --require-signed: `signed_dir` holds config.json and the model.sig that signs
    the config.pbtxt the server writes from it, with `model_py` as 1/model.py."""
    config = (signed_dir / "config.json").read_text()
    signature = (signed_dir / "model.sig").read_bytes()
    answers = {
        "upload": error_of(
            lambda: client.load_model(
                "uploaded", config=config, files={"file:1/model.py": model_py}
            )
        ),
        "ready": client.is_model_ready("uploaded"),
        "tampered": error_of(
            lambda: client.load_model(
                "uploaded",
                config=config,
                files={"file:1/model.py": model_py + b"#", "file:model.sig": signature},
            )
        ),
        "ready_tampered": client.is_model_ready("uploaded"),
    }
    answers["signed"] = error_of(
        lambda: client.load_model(
            "uploaded",
            config=config,
            files={"file:1/model.py": model_py, "file:model.sig": signature},
        )
    )
    answers["ready_signed"] = client.is_model_ready("uploaded")
    answers["live"] = client.is_server_live()
    return answers


def restricted(client: grpcclient.InferenceServerClient, model_py: bytes) -> dict[str, Any]:
    """Under --restricted-protocol model-repository:admin-key=SECRET."""

    def upload(headers: dict[str, str] | None) -> None:
        client.load_model(
            "uploaded",
            config=simple_config("uploaded", "2"),
            files={"file:1/model.py": model_py},
            headers=headers,
        )

    return {
        "without_key": error_of(lambda: upload(None)),
        "ready_without_key": client.is_model_ready("uploaded"),
        "with_key": error_of(lambda: upload({"triton-grpc-protocol-admin-key": "SECRET"})),
        "ready_with_key": client.is_model_ready("uploaded"),
    }


def lifetime(
    client: grpcclient.InferenceServerClient, model_py: bytes, watch: Path
) -> dict[str, Any]:
    """How many uploaded directories the server holds (under `watch`, its TMPDIR) after each
    step: a load from one, a failed load, a load replacing the first, an unload."""
    config = simple_config("uploaded", "2")

    def held(expected: int) -> int:
        deadline = time.monotonic() + WIND_DOWN_S  # a replaced version winds down first
        while True:
            count = len(list(watch.glob("paddlequic-upload-*")))
            if count == expected or time.monotonic() > deadline:
                return count
            time.sleep(0.1)

    client.load_model("uploaded", config=config, files={"file:1/model.py": model_py})
    answers: dict[str, Any] = {"loaded": held(1)}
    answers["broken"] = error_of(
        lambda: client.load_model(
            "uploaded", config=config, files={"file:1/model.py": b"this is not python"}
        )
    )
    answers["after_broken"] = held(1)
    answers["ready_after_broken"] = client.is_model_ready("uploaded")
    client.load_model("uploaded", config=config, files={"file:1/model.py": model_py})
    answers["replaced"] = held(1)
    client.unload_model("uploaded")
    answers["unloaded"] = held(0)
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--model-py", required=True, type=Path)
    modes = ("plain", "signed", "restricted", "lifetime")
    parser.add_argument("--mode", choices=modes, default="plain")
    parser.add_argument("--signed-dir", type=Path)
    parser.add_argument("--watch", type=Path)
    parser.add_argument("--server-log", type=Path)
    parser.add_argument("--server-pid", type=int, default=0)
    args = parser.parse_args(argv)
    client = grpcclient.InferenceServerClient(args.url)
    try:
        model_py = args.model_py.read_bytes()
        if args.mode == "signed":
            summary = signed(client, model_py, args.signed_dir)
        elif args.mode == "lifetime":
            summary = lifetime(client, model_py, args.watch)
        elif args.mode == "plain":
            summary = plain(client, model_py, args.server_log, args.server_pid)
        else:
            summary = restricted(client, model_py)
    finally:
        client.close()
    args.out.write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
