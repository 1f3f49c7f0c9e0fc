"""The `sentiment` example (tokenizer -> text_classifier -> label_postprocess) as `make models`
exports it, asked with the numpy client, Triton's tritonclient and grpcurl, all with BYTES.

Exports the pipeline into its own repository (beside a link to the exported text_classifier),
which also tests the exporter's copying of Python models and ensembles."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from scripts import export_models
from tests.interop.test_grpcurl import GRPCURL, grpcurl_ok
from tests.reference import run_sentiment_reference
from tests.servers import REPO_ROOT, ServerProcess, model_repository, paused, running_server

TEXTS = ("A wonderful, brilliant movie!", "boring and awful", "")
SCRIPT = Path(__file__).with_name("sentiment_check.py")
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def sentiment_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("sentiment")
    repository = model_repository(directory / "models", ["text_classifier"])
    export_models.main(["--out", str(repository), "--only", *export_models.PIPELINES])
    with running_server(repository, directory / "server.log") as server:
        yield server


def ask(server: ServerProcess, model: str, inputs: dict[str, Any]) -> dict[str, Any]:
    request = build_request(model, inputs)
    return parse_response(server.stub.ModelInfer(request, timeout=TIMEOUT_S))


def test_the_ensemble_answers_as_its_steps_do(sentiment_server: ServerProcess) -> None:
    text = np.array([[t.encode()] for t in TEXTS], dtype=np.object_)
    got = ask(sentiment_server, "sentiment", {"text": text})
    assert got["label"].shape == (3, 1) and got["score"].shape == (3, 1)
    labels, scores = run_sentiment_reference(TEXTS)
    assert [v.decode() for v in got["label"].reshape(-1)] == labels
    np.testing.assert_allclose(got["score"].reshape(-1), scores, rtol=1e-5)
    # Deterministic: one text alone gets what it got in the batch.
    alone = ask(sentiment_server, "sentiment", {"text": text[1:2]})
    assert alone["label"].tolist() == got["label"][1:2].tolist()
    np.testing.assert_allclose(alone["score"], got["score"][1:2], rtol=1e-5)


def test_with_front_ends_they_run_the_ensemble_with_the_parent_stopped(tmp_path: Path) -> None:
    """Its Python steps' code names no BLS call and their configs say nothing, so they take
    their instance queues (python_code.py) and every step is a version the front-ends queue
    for: a front-end runs the whole ensemble itself."""
    names = ["tokenizer", "text_classifier", "label_postprocess", "sentiment"]
    repository = model_repository(tmp_path / "models", names)
    args = ["--frontends", "2", "--no-h3"]
    text = np.array([[t.encode()] for t in TEXTS], dtype=np.object_)
    labels, scores = run_sentiment_reference(TEXTS)
    with running_server(repository, tmp_path / "server.log", args) as server:
        ask(server, "sentiment", {"text": text})  # this front-end's queues attached
        with paused(server.process.pid):
            got = ask(server, "sentiment", {"text": text})
    assert [v.decode() for v in got["label"].reshape(-1)] == labels
    np.testing.assert_allclose(got["score"].reshape(-1), scores, rtol=1e-5)


def test_tritonclient_sends_and_reads_bytes(sentiment_server: ServerProcess) -> None:
    finished = subprocess.run(
        [sys.executable, str(SCRIPT), "--url", sentiment_server.address, *TEXTS],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 0, finished.stderr
    summary = json.loads(finished.stdout)
    labels, scores = run_sentiment_reference(TEXTS)
    assert summary["model_name"] == "sentiment"
    assert summary["labels"] == labels
    assert summary["shapes"] == [[3, 1], [3, 1]]
    np.testing.assert_allclose(summary["scores"], scores, rtol=1e-5)


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl is not installed (dev extra)")
def test_grpcurl_with_typed_bytes_contents(sentiment_server: ServerProcess) -> None:
    request = {
        "model_name": "sentiment",
        "inputs": [
            {
                "name": "text",
                "datatype": "BYTES",
                "shape": [1, 1],
                "contents": {"bytes_contents": [base64.b64encode(TEXTS[0].encode()).decode()]},
            }
        ],
    }
    response = json.loads(
        grpcurl_ok(sentiment_server, "inference.GRPCInferenceService/ModelInfer", data=request)
    )
    outputs = {o["name"]: o for o in response["outputs"]}
    assert outputs["label"]["datatype"] == "BYTES" and outputs["score"]["datatype"] == "FP32"
    raw = dict(zip(outputs, response["raw_output_contents"], strict=True))
    label = base64.b64decode(raw["label"])
    score = np.frombuffer(base64.b64decode(raw["score"]), dtype="<f4")
    labels, scores = run_sentiment_reference(TEXTS[:1])
    assert label == len(labels[0]).to_bytes(4, "little") + labels[0].encode()
    np.testing.assert_allclose(score, scores, rtol=1e-5)
