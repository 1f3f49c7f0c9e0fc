"""The model repository on disk: names and versions from the network, config.pbtxt, version
policies, and completing a config from what the model file declares. No server, no Paddle."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from google.protobuf import text_format

from protos.inference import model_config_pb2 as mc
from service.inference.errors import ServiceError, echoed
from service.inference.tensors import TensorSpec
from service.lifecycle.repository import (
    ModelRepository,
    RepositoryError,
    complete_config,
    fetch_names,
    select_versions,
)
from service.registry.names import check_model_name, parse_version

MLP_CONFIG = """
name: "mlp"
platform: "paddle_inference"
max_batch_size: 8
"""


def add_version(model_dir: Path, version: int | str, program: str = "inference.json") -> Path:
    """An empty placeholder version: loading the repository never opens the Paddle files."""
    path = model_dir / str(version)
    path.mkdir(parents=True)
    (path / program).touch()
    (path / Path(program).with_suffix(".pdiparams").name).touch()
    return path


def add_model(
    root: Path, name: str, config: str | None = MLP_CONFIG, versions: Sequence[int] = (1,)
) -> Path:
    model_dir = root / name
    model_dir.mkdir(parents=True)
    if config is not None:
        (model_dir / "config.pbtxt").write_text(config)
    for version in versions:
        add_version(model_dir, version)
    return model_dir


def repository_error(root: Path, name: str) -> str:
    with pytest.raises(RepositoryError) as info:
        ModelRepository(root).load(name)
    return str(info.value)


# check_model_name / parse_version: what arrives from the network.


@pytest.mark.parametrize(
    "name", ["mlp", "resnet18", "two_tower", "text-classifier", "v1.2", "_x", "A", "a" * 128]
)
def test_plain_names_are_accepted(name: str) -> None:
    assert check_model_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "..",
        "../x",
        "x/../../y",
        "/etc/passwd",
        "a/b",
        "a\\b",
        "mlp/..",
        "a..b",
        ".hidden",
        "-flag",
        "a b",
        "mlp\0",
        "mlp\n",
        "mödel",
        "a" * 129,
    ],
)
def test_names_that_could_escape_the_repository_are_refused(name: str) -> None:
    with pytest.raises(ServiceError) as info:
        check_model_name(name)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert repr(echoed(name)) in info.value.message
    assert "no path separators or '..'" in info.value.message


@pytest.mark.parametrize(
    ("text", "version"),
    [("", None), ("0", 0), ("1", 1), ("007", 7), ("42", 42), (str(2**63 - 1), 2**63 - 1)],
)
def test_versions_are_decimal_numbers(text: str, version: int | None) -> None:
    assert parse_version(text) == version


@pytest.mark.parametrize(
    "text",
    [
        *("one", "-1", "+1", "1.0", " 1", "1 ", "0x1", "1e3", "\uff11", "\u00b2", str(2**63)),
        "9" * 5000,  # more digits than int() converts (and than any version has)
        "1" + "0" * 19,
    ],
)
def test_anything_else_is_not_a_version(text: str) -> None:
    with pytest.raises(ServiceError) as info:
        parse_version(text)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith(
        f"failed to get model version from specified version string '{echoed(text)}' is not a "
        "version number"
    )


def test_leading_zeros_do_not_count_as_digits() -> None:
    assert parse_version("0" * 5000 + "7") == 7


# select_versions: Triton's version_policy.


def policy(text: str) -> mc.ModelVersionPolicy:
    return text_format.Parse(text, mc.ModelVersionPolicy())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", [7]),  # no policy: the newest version
        ("latest {}", [7]),
        ("latest { num_versions: 1 }", [7]),
        ("latest { num_versions: 2 }", [3, 7]),
        ("latest { num_versions: 10 }", [1, 2, 3, 7]),
        ("all {}", [1, 2, 3, 7]),
        ("specific { versions: [1, 3] }", [1, 3]),
        ("specific { versions: [3, 1, 3] }", [1, 3]),
        ("specific { versions: [5] }", []),
    ],
)
def test_select_versions(text: str, expected: list[int]) -> None:
    assert select_versions(policy(text), [1, 2, 3, 7]) == expected


def test_select_versions_of_nothing() -> None:
    assert select_versions(policy("all {}"), []) == []
    assert select_versions(policy(""), []) == []


# ModelRepository: loading, and errors that say how to fix them.


def test_load_finds_versions_and_files(tmp_path: Path) -> None:
    add_model(tmp_path, "mlp", versions=(1, 2, 10))
    model = ModelRepository(tmp_path).load("mlp")
    assert (model.name, model.path, model.config.max_batch_size) == ("mlp", tmp_path / "mlp", 8)
    (files,) = model.versions  # latest 1 by default; 10 sorts after 2 numerically
    assert files.version == 10
    assert files.model_file == tmp_path / "mlp" / "10" / "inference.json"
    assert files.params_file == tmp_path / "mlp" / "10" / "inference.pdiparams"


def test_load_honours_the_version_policy(tmp_path: Path) -> None:
    add_model(tmp_path, "mlp", MLP_CONFIG + "version_policy { all {} }", versions=(3, 1, 2))
    assert [f.version for f in ModelRepository(tmp_path).load("mlp").versions] == [1, 2, 3]


def test_without_config_the_directory_names_the_model(tmp_path: Path) -> None:
    add_model(tmp_path, "bare", config=None)
    config = ModelRepository(tmp_path).load("bare").config
    assert (config.name, config.platform, config.max_batch_size) == ("bare", "paddle_inference", 0)


def test_legacy_pdmodel_loads(tmp_path: Path) -> None:
    model_dir = add_model(tmp_path, "old", config=None, versions=())
    add_version(model_dir, 1, program="model.pdmodel")
    (files,) = ModelRepository(tmp_path).load("old").versions
    assert (files.model_file.name, files.params_file.name) == ("model.pdmodel", "model.pdiparams")


def test_model_names_skips_files_and_odd_names(tmp_path: Path) -> None:
    add_model(tmp_path, "b")
    add_model(tmp_path, "a")
    (tmp_path / "README.md").write_text("not a model")
    (tmp_path / ".cache").mkdir()
    assert ModelRepository(tmp_path).model_names() == ["a", "b"]


def test_missing_repository_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(RepositoryError) as info:
        ModelRepository(tmp_path / "nowhere").model_names()
    message = str(info.value)
    assert str(tmp_path / "nowhere") in message
    assert "`make models`" in message
    assert "--model-repository" in message


def test_missing_model(tmp_path: Path) -> None:
    message = repository_error(tmp_path, "ghost")
    assert "'ghost' not found" in message
    assert str(tmp_path) in message


def test_load_refuses_traversal_before_touching_the_disk(tmp_path: Path) -> None:
    add_model(tmp_path / "outside", "secret")
    with pytest.raises(ServiceError) as info:
        ModelRepository(tmp_path / "repo").load("../outside/secret")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_no_version_directories(tmp_path: Path) -> None:
    model_dir = add_model(tmp_path, "mlp", versions=())
    (model_dir / "latest").mkdir()  # not a number: not a version
    message = repository_error(tmp_path, "mlp")
    assert "no version directories" in message
    assert str(model_dir) in message
    assert "`make models`" in message


def test_version_directory_without_model_files(tmp_path: Path) -> None:
    model_dir = add_model(tmp_path, "mlp", versions=())
    (model_dir / "1").mkdir()
    (model_dir / "1" / "inference.json").touch()  # params missing
    message = repository_error(tmp_path, "mlp")
    assert str(model_dir / "1") in message
    assert "inference.pdiparams" in message
    assert "`make models`" in message


def test_unparsable_config_names_the_file(tmp_path: Path) -> None:
    model_dir = add_model(tmp_path, "mlp", config='name: "mlp"\nmax_batch_size: lots\n')
    message = repository_error(tmp_path, "mlp")
    assert str(model_dir / "config.pbtxt") in message
    assert "max_batch_size" in message
    assert "2:" in message  # the line of the mistake


def test_unknown_config_field_names_the_file(tmp_path: Path) -> None:
    model_dir = add_model(tmp_path, "mlp", config=MLP_CONFIG + "max_batch: 4\n")
    message = repository_error(tmp_path, "mlp")
    assert str(model_dir / "config.pbtxt") in message
    assert "max_batch" in message


def test_config_name_must_match_the_directory(tmp_path: Path) -> None:
    model_dir = add_model(tmp_path, "mlp2")
    message = repository_error(tmp_path, "mlp2")
    assert str(model_dir / "config.pbtxt") in message
    assert "'mlp'" in message
    assert "'mlp2'" in message


def test_other_platforms_are_refused(tmp_path: Path) -> None:
    add_model(tmp_path, "mlp", config='name: "mlp"\nplatform: "onnxruntime_onnx"\n')
    message = repository_error(tmp_path, "mlp")
    assert "'onnxruntime_onnx' is not served here" in message
    assert "platform: 'paddle_inference'" in message


def test_negative_max_batch_size_is_refused(tmp_path: Path) -> None:
    add_model(tmp_path, "mlp", config='name: "mlp"\nmax_batch_size: -1\n')
    assert "max_batch_size must be >= 0" in repository_error(tmp_path, "mlp")


def test_policy_selecting_nothing_lists_what_exists(tmp_path: Path) -> None:
    config = MLP_CONFIG + "version_policy { specific { versions: [9] } }"
    add_model(tmp_path, "mlp", config, versions=(1, 2))
    message = repository_error(tmp_path, "mlp")
    assert "selects none" in message
    assert "[1, 2]" in message


# complete_config: inputs/outputs from the model file.

MODEL_INPUTS = (
    TensorSpec("user", "FP32", (-1, 32)),
    TensorSpec("ids", "INT64", (-1, -1)),
)
MODEL_OUTPUTS = (TensorSpec("fetch_name_0", "FP32", (-1, 16)),)


def config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def described(
    entries: Sequence[mc.ModelInput | mc.ModelOutput],
) -> list[tuple[str, str, list[int]]]:
    return [(e.name, mc.DataType.Name(e.data_type), list(e.dims)) for e in entries]


def test_missing_inputs_and_outputs_come_from_the_model() -> None:
    """With batching the leading batch dimension is implied, so it is dropped from dims."""
    given = config('name: "m" max_batch_size: 4')
    done = complete_config(given, MODEL_INPUTS, MODEL_OUTPUTS)
    assert described(done.input) == [("user", "TYPE_FP32", [32]), ("ids", "TYPE_INT64", [-1])]
    assert described(done.output) == [("fetch_name_0", "TYPE_FP32", [16])]
    assert not given.input, "the caller's config was modified"


def test_without_batching_dims_keep_every_axis() -> None:
    done = complete_config(config('name: "m"'), MODEL_INPUTS, MODEL_OUTPUTS)
    assert described(done.input) == [
        ("user", "TYPE_FP32", [-1, 32]),
        ("ids", "TYPE_INT64", [-1, -1]),
    ]
    assert described(done.output) == [("fetch_name_0", "TYPE_FP32", [-1, 16])]


def test_listed_inputs_are_kept_and_only_outputs_filled() -> None:
    given = config(
        'name: "m" max_batch_size: 4 '
        'input [{ name: "ids" data_type: TYPE_INT64 dims: [ 12 ] },'
        '       { name: "user" data_type: TYPE_FP32 dims: [ 32 ] }]'
    )
    done = complete_config(given, MODEL_INPUTS, MODEL_OUTPUTS)
    assert described(done.input) == [("ids", "TYPE_INT64", [12]), ("user", "TYPE_FP32", [32])]
    assert described(done.output) == [("fetch_name_0", "TYPE_FP32", [16])]


def test_config_input_the_model_lacks_is_refused() -> None:
    given = config('name: "m" input [{ name: "usr" data_type: TYPE_FP32 dims: [ 32 ] }]')
    with pytest.raises(RepositoryError) as info:
        complete_config(given, MODEL_INPUTS, MODEL_OUTPUTS)
    message = str(info.value)
    assert "input 'usr'" in message
    assert "['ids', 'user']" in message


TWO_OUTPUTS = (
    TensorSpec("fetch_name_0", "FP32", (-1, 16)),
    TensorSpec("fetch_name_1", "INT64", (-1, 1)),
)


def test_named_outputs_map_to_the_program_outputs_in_order() -> None:
    given = config(
        'name: "m" max_batch_size: 4 output ['
        '{ name: "embedding" data_type: TYPE_FP32 dims: [ 16 ] },'
        '{ name: "label" data_type: TYPE_INT64 dims: [ 1 ] }]'
    )
    done = complete_config(given, MODEL_INPUTS, TWO_OUTPUTS)
    assert described(done.output) == [
        ("embedding", "TYPE_FP32", [16]),
        ("label", "TYPE_INT64", [1]),
    ]
    assert fetch_names(given, TWO_OUTPUTS) == {"embedding": "fetch_name_0", "label": "fetch_name_1"}


def test_outputs_named_as_the_program_names_them_need_no_mapping() -> None:
    given = config(
        'name: "m" output [{ name: "fetch_name_1" data_type: TYPE_INT64 dims: [-1, 1] }]'
    )
    done = complete_config(given, MODEL_INPUTS, TWO_OUTPUTS)
    assert described(done.output) == [("fetch_name_1", "TYPE_INT64", [-1, 1])]
    assert fetch_names(given, TWO_OUTPUTS) == {}
    assert fetch_names(config('name: "m"'), TWO_OUTPUTS) == {}


def test_a_name_kept_at_its_position_maps_too() -> None:
    given = config(
        'name: "m" output [{ name: "fetch_name_0" data_type: TYPE_FP32 dims: [ -1, 16 ] },'
        '{ name: "label" data_type: TYPE_INT64 dims: [ -1, 1 ] }]'
    )
    complete_config(given, MODEL_INPUTS, TWO_OUTPUTS)
    assert fetch_names(given, TWO_OUTPUTS) == {"label": "fetch_name_1"}


@pytest.mark.parametrize(
    ("outputs", "words"),
    [
        ('{ name: "logits" data_type: TYPE_FP32 dims: [ 16 ] }', "lists 1 output(s) ['logits']"),
        (
            '{ name: "a" data_type: TYPE_FP32 dims: [ 16 ] },'
            '{ name: "b" data_type: TYPE_FP32 dims: [ 1 ] }',
            "output 'b' (the model's output 1, 'fetch_name_1') is TYPE_FP32 in config.pbtxt "
            "but TYPE_INT64",
        ),
        (
            '{ name: "a" data_type: TYPE_FP32 dims: [ 4, 4 ] },'
            '{ name: "b" data_type: TYPE_INT64 dims: [ 1 ] }',
            "output 'a' (the model's output 0, 'fetch_name_0') has dims [4, 4]",
        ),
        (
            '{ name: "fetch_name_1" data_type: TYPE_FP32 dims: [ 16 ] },'
            '{ name: "b" data_type: TYPE_INT64 dims: [ 1 ] }',
            "output 'fetch_name_1' at position 0 but the model's output 0 is 'fetch_name_0'",
        ),
        (
            '{ name: "a" data_type: TYPE_FP32 dims: [ 16 ] },'
            '{ name: "a" data_type: TYPE_INT64 dims: [ 1 ] }',
            "output(s) ['a'] twice",
        ),
    ],
)
def test_named_outputs_are_checked_at_load(outputs: str, words: str) -> None:
    given = config(f'name: "m" max_batch_size: 4 output [{outputs}]')
    with pytest.raises(RepositoryError) as info:
        complete_config(given, MODEL_INPUTS, TWO_OUTPUTS)
    assert words in str(info.value)
    assert "model 'm'" in str(info.value)


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ('input [{ name: "ids" data_type: TYPE_INT32 dims: [ -1 ] }]', "TYPE_INT32"),
        ('output [{ name: "fetch_name_0" data_type: TYPE_FP16 dims: [ 16 ] }]', "TYPE_FP16"),
    ],
)
def test_datatype_mismatch_is_refused(entry: str, words: str) -> None:
    with pytest.raises(RepositoryError) as info:
        complete_config(config(f'name: "m" max_batch_size: 4 {entry}'), MODEL_INPUTS, MODEL_OUTPUTS)
    message = str(info.value)
    assert f"is {words} in config.pbtxt" in message
    assert "in the model" in message


def test_rank_mismatch_mentions_the_implied_batch_dimension() -> None:
    given = config(
        'name: "m" max_batch_size: 4 input [{ name: "user" data_type: TYPE_FP32 dims: [ -1, 32 ] }]'
    )
    with pytest.raises(RepositoryError) as info:
        complete_config(given, MODEL_INPUTS, MODEL_OUTPUTS)
    message = str(info.value)
    assert "dims [-1, 32]" in message
    assert "shape [-1, 32]" in message
    assert "batch dimension is implied by max_batch_size" in message
