"""The classification extension's top k, as Triton formats it (src/classification.cc):
`score:index[:label]`, best first, equal scores in index order, per batch entry."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oip.bytes_tensor import deserialize_bytes
from oip.datatypes import BY_NAME
from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.inference.classification import (
    MAX_LABEL_FILE_BYTES,
    LabelFileError,
    class_counts,
    read_labels,
    top_k,
)
from service.inference.errors import ServiceError
from service.inference.jobs import OutputTensor


def _tensor(array: np.ndarray, datatype: str = "FP32") -> OutputTensor:
    return OutputTensor("out", BY_NAME[datatype], array.shape, array.tobytes())


def _texts(tensor: OutputTensor) -> list[str]:
    count = int(np.prod(tensor.shape))
    return [t.decode() for t in deserialize_bytes(tensor.data, count)]


def test_batched_rows_each_ranked_with_labels() -> None:
    probs = np.array([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]], np.float32)
    answered = top_k(_tensor(probs), 2, batched=True, labels=(b"cat", b"dog"))
    assert answered.datatype.name == "BYTES" and answered.shape == (2, 2)
    # Index 2 has no label line: no label, as Triton answers it.
    assert _texts(answered) == ["0.700000:1:dog", "0.200000:2", "0.500000:0:cat", "0.250000:1:dog"]


def test_k_beyond_the_classes_answers_them_all_and_integers_print_as_integers() -> None:
    answered = top_k(_tensor(np.array([3, -1, 7], np.int32), "INT32"), 10, False, ())
    assert answered.shape == (3,)
    assert _texts(answered) == ["7:2", "3:0", "-1:1"]


@pytest.mark.parametrize("datatype", ["BYTES", "BOOL", "FP16", "BF16"])
def test_unranked_types_refused_with_tritons_text(datatype: str) -> None:
    tensor = OutputTensor("out", BY_NAME[datatype], (1,), b"\0\0\0\0\0")
    with pytest.raises(ServiceError, match=f"unsupported type '{datatype}'"):
        top_k(tensor, 1, False, ())


def test_class_count_parameter_as_triton_checks_it() -> None:
    request = pb.ModelInferRequest()
    request.outputs.add(name="a").parameters["classification"].int64_param = 3
    request.outputs.add(name="b")
    assert class_counts(request) == {"a": 3}
    request.outputs[1].parameters["classification"].int64_param = 0
    with pytest.raises(ServiceError, match="expected >= 0"):
        class_counts(request)
    request.outputs[1].parameters["classification"].string_param = "3"
    with pytest.raises(ServiceError, match="expected int64_param"):
        class_counts(request)


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.integers(-5, 5), min_size=1, max_size=12).map(tuple), min_size=1, max_size=4
    ).filter(lambda rows: len({len(r) for r in rows}) == 1),
    k=st.integers(1, 15),
)
def test_top_k_is_a_stable_descending_sort(rows: list[tuple[int, ...]], k: int) -> None:
    array = np.array(rows, np.float64) / 4
    texts = _texts(top_k(_tensor(array, "FP64"), k, True, ()))
    width = min(k, array.shape[1])
    for r, row in enumerate(rows):
        want = sorted(range(len(row)), key=lambda i: -row[i])[:width]
        got = texts[r * width : (r + 1) * width]
        assert got == [f"{row[i] / 4:f}:{i}" for i in want]


def _config(label_filename: str) -> mc.ModelConfig:
    return mc.ModelConfig(output=[mc.ModelOutput(name="out", label_filename=label_filename)])


def test_labels_read_one_a_line(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_bytes(b"zero\none\n\nthree")
    assert read_labels(tmp_path, _config("labels.txt")) == {"out": (b"zero", b"one", b"", b"three")}


@pytest.mark.parametrize("name", ["../labels.txt", "sub/labels.txt", "/etc/hostname", "..", "link"])
def test_label_file_outside_the_model_directory_refused(tmp_path: Path, name: str) -> None:
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (tmp_path / "labels.txt").write_text("a\n")
    (model / "sub" / "labels.txt").write_text("a\n")
    (model / "link").symlink_to(tmp_path / "labels.txt")
    with pytest.raises(LabelFileError):
        read_labels(model, _config(name))


def test_label_file_bound_per_file(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_bytes(b"x" * (MAX_LABEL_FILE_BYTES + 1))
    with pytest.raises(LabelFileError, match="over"):
        read_labels(tmp_path, _config("labels.txt"))
