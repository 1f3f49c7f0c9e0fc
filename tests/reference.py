"""Run an exported example model in-process with Paddle: the ground truth that served outputs
are compared with. Only tests import this (paddle never enters the server's front-end)."""

from __future__ import annotations

import functools
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tests.servers import EXAMPLE_MODELS, REPO_ROOT

os.environ.setdefault("GLOG_minloglevel", "2")
warnings.filterwarnings("ignore", message="No ccache found")


@functools.cache
def _predictor(model: str, version: int, repository: Path) -> Any:
    from paddle import inference

    directory = repository / model / str(version)
    config = inference.Config(
        str(directory / "inference.json"), str(directory / "inference.pdiparams")
    )
    config.disable_glog_info()
    config.disable_gpu()
    return inference.create_predictor(config)


@functools.cache
def output_names(model: str) -> tuple[str, ...]:
    """The names the server gives an example model's outputs, in the program's order: those
    its config.pbtxt lists (the exporter writes them)."""
    from google.protobuf import text_format

    from protos.inference import model_config_pb2 as mc

    config = text_format.Parse(
        (Path(EXAMPLE_MODELS) / model / "config.pbtxt").read_text(), mc.ModelConfig()
    )
    return tuple(o.name for o in config.output)


def run_program(
    model: str,
    inputs: dict[str, np.ndarray[Any, Any]],
    version: int = 1,
    repository: Path = EXAMPLE_MODELS,
) -> list[np.ndarray[Any, Any]]:
    """The program's outputs, in its order (a sequence model's state outputs included);
    `repository`: where the model was exported, if not the example repository (a model
    exported on demand)."""
    predictor = _predictor(model, version, Path(repository))
    for name, array in inputs.items():
        handle = predictor.get_input_handle(name)
        handle.reshape(list(array.shape))
        handle.copy_from_cpu(np.ascontiguousarray(array))
    predictor.run()
    return [
        predictor.get_output_handle(name).copy_to_cpu() for name in predictor.get_output_names()
    ]


def run_reference(
    model: str, inputs: dict[str, np.ndarray[Any, Any]], version: int = 1
) -> dict[str, np.ndarray[Any, Any]]:
    """The program's outputs, under the names the server gives them."""
    outputs = run_program(model, inputs, version)
    return dict(zip(output_names(model), outputs, strict=True))


KWS_STATE = 64  # the keyword spotter's GRU state (scripts/export_models.py)


def kws_reference(chunks: Sequence[np.ndarray[Any, Any]]) -> list[np.ndarray[Any, Any]]:
    """The keyword spotter's scores for one sequence of chunks, run alone in-process: the
    state each chunk leaves is the next one's, as the server's sequence batcher carries it."""
    state = np.zeros((1, KWS_STATE), np.float32)
    scores = []
    for index, chunk in enumerate(chunks):
        start = np.full((1, 1), float(index == 0), np.float32)
        score, state = run_program("kws", {"features": chunk, "start": start, "gru_state": state})
        scores.append(score)
    return scores


# Inputs for each example model: batch 3, sequence length 7 where the length varies.
def example_inputs(model: str, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    if model == "mlp":
        return {"input": rng.standard_normal((3, 256), dtype=np.float32)}
    if model == "resnet18":
        return {"image": rng.standard_normal((2, 3, 224, 224), dtype=np.float32)}
    if model == "text_classifier":
        return {"token_ids": rng.integers(0, 1000, (3, 7), dtype=np.int64)}
    if model == "two_tower":
        return {
            "user": rng.standard_normal((3, 32), dtype=np.float32),
            "item": rng.standard_normal((3, 48), dtype=np.float32),
        }
    raise KeyError(model)


EXAMPLES = ("mlp", "resnet18", "text_classifier", "two_tower")


def call_inputs(model: str, call: int) -> dict[str, np.ndarray[Any, Any]]:
    """Inputs for the call numbered `call`, seeded by that number: no two calls of a test send
    the same tensors, so an answer given to the wrong caller fails its check."""
    return example_inputs(model, seed=CALL_SEED + call)


# Above the seeds tests pass to example_inputs by hand, so call inputs never repeat theirs.
CALL_SEED = 1_000_000


def run_ensemble_reference(
    config: Any, inputs: dict[str, np.ndarray[Any, Any]], ensembles: Mapping[str, Any] | None = None
) -> dict[str, np.ndarray[Any, Any]]:
    """An ensemble's outputs (a ModelConfig with ensemble_scheduling) composed in-process from
    its Paddle steps, in the order its config lists them; a step naming one of `ensembles`
    (name -> its ModelConfig) is composed the same way."""
    tensors = dict(inputs)
    for step in config.ensemble_scheduling.step:
        step_inputs = {name: tensors[tensor] for name, tensor in step.input_map.items()}
        if ensembles and step.model_name in ensembles:
            outputs = run_ensemble_reference(ensembles[step.model_name], step_inputs, ensembles)
        else:
            outputs = run_reference(step.model_name, step_inputs)
        tensors.update(
            {tensor_name: outputs[name] for name, tensor_name in step.output_map.items()}
        )
    return {output.name: tensors[output.name] for output in config.output}


# The sentiment example's Python steps (examples/sentiment): their numpy logic, here.
SENTIMENT_LABELS = ("negative", "neutral", "positive", "mixed")
_TOKEN_IDS, _UNKNOWN_ID = 32, 1


def tokenize(texts: Sequence[str]) -> np.ndarray[Any, Any]:
    """The `tokenizer` step: lower-cased words' line numbers in vocab.txt (1: unknown), cut
    or padded with 0 to 32 ids."""
    vocab = (REPO_ROOT / "examples/sentiment/tokenizer/1/vocab.txt").read_text().split()
    index = {word: i for i, word in enumerate(vocab)}
    ids = np.zeros((len(texts), _TOKEN_IDS), np.int64)
    for row, text in enumerate(texts):
        words = re.findall(r"[a-z0-9']+", text.lower())[:_TOKEN_IDS]
        ids[row, : len(words)] = [index.get(word, _UNKNOWN_ID) for word in words]
    return ids


def run_sentiment_reference(texts: Sequence[str]) -> tuple[list[str], list[float]]:
    """The `sentiment` ensemble in-process: tokenizer, text_classifier in Paddle, then
    label_postprocess's softmax; each text's label and that label's probability."""
    (logits,) = run_reference("text_classifier", {"token_ids": tokenize(texts)}).values()
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=1, keepdims=True)
    best = probabilities.argmax(axis=1)
    return [SENTIMENT_LABELS[i] for i in best], [
        float(probabilities[r, i]) for r, i in enumerate(best)
    ]


def assert_outputs(expected: dict[str, np.ndarray[Any, Any]], response: Any) -> None:
    """A served ModelInferResponse holds exactly `expected` (the reference's outputs for this
    call's own input), in order, each compared by value."""
    from clients.inference_client import parse_response

    served = parse_response(response)
    assert list(served) == list(expected)
    for name, array in expected.items():
        assert served[name].shape == array.shape, name
        if array.dtype == np.object_:
            assert served[name].tolist() == array.tolist(), name
        else:
            np.testing.assert_allclose(served[name], array, rtol=1e-4, atol=1e-5, err_msg=name)


def assert_matches_reference(
    model: str, inputs: dict[str, np.ndarray[Any, Any]], response: Any
) -> None:
    """A served ModelInferResponse holds the same outputs as in-process Paddle, in order."""
    assert_outputs(run_reference(model, inputs), response)
