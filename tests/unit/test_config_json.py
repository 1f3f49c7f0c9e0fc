"""The config JSON a Python model is given (service/model/config_json.py), over random
ModelConfigs: every 64-bit integer a JSON number, every field without presence printed at its
default, and the text parses back (with protobuf's own parser, as Triton's does) to the same
ModelConfig."""

from __future__ import annotations

import json
from typing import Any, cast

from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.inference import model_config_pb2 as mc
from service.model.config_json import config_json

CONFIG = cast(Descriptor, mc.ModelConfig.DESCRIPTOR)
INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_INT64: INT64,
    FieldDescriptor.TYPE_UINT64: UINT64,
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: st.text(max_size=4),
    FieldDescriptor.TYPE_FLOAT: st.sampled_from([0.0, 0.5, -2.0]),
    FieldDescriptor.TYPE_DOUBLE: st.sampled_from([0.0, 0.25, 1e6]),
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.enum_type is not None:
        return st.sampled_from([v.number for v in field.enum_type.values])
    return SCALARS[field.type]


@st.composite
def messages(draw: st.DrawFn, descriptor: Descriptor, depth: int = 0) -> Message:
    """Any message of `descriptor`: each field set or left unset, oneofs one member at most."""
    message = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if not draw(st.booleans()):
            continue
        if field.containing_oneof is not None and message.WhichOneof(field.containing_oneof.name):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = (
                field.message_type.fields_by_name["key"],
                field.message_type.fields_by_name["value"],
            )
            target = getattr(message, field.name)
            for k in draw(st.lists(_scalar(key), max_size=2, unique=True)):
                if value.message_type is not None:
                    if depth < 3:
                        target[k].CopyFrom(draw(messages(value.message_type, depth + 1)))
                else:
                    target[k] = draw(_scalar(value))
        elif field.message_type is not None:
            if depth >= 3:
                continue
            count = 1 if not field.is_repeated else draw(st.integers(0, 2))
            for _ in range(count):
                child = draw(messages(field.message_type, depth + 1))
                if field.is_repeated:
                    getattr(message, field.name).add().CopyFrom(child)
                else:
                    getattr(message, field.name).CopyFrom(child)
                    getattr(message, field.name).SetInParent()
        elif field.is_repeated:
            getattr(message, field.name).extend(draw(st.lists(_scalar(field), max_size=3)))
        else:
            setattr(message, field.name, draw(_scalar(field)))
    return message


def _check(descriptor: Descriptor, printed: dict[str, Any], where: str) -> None:
    """Every field without presence is there; every 64-bit integer is an int."""
    for field in descriptor.fields:
        path = f"{where}.{field.name}"
        if field.name not in printed:
            assert field.has_presence, f"{path} missing"
            continue
        value = printed[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            inner = field.message_type.fields_by_name["value"]
            for v in value.values():
                _check_value(inner, v, path)
        elif field.is_repeated:
            for v in value:
                _check_value(field, v, path)
        else:
            _check_value(field, value, path)


def _check_value(field: FieldDescriptor, value: Any, path: str) -> None:
    if field.type in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64):
        assert type(value) is int, f"{path} is {value!r}"
    elif field.message_type is not None:
        _check(field.message_type, value, path)


@settings(max_examples=300, deadline=None)
@given(messages(CONFIG))
def test_64_bit_integers_are_numbers_and_the_text_parses_back(config: mc.ModelConfig) -> None:
    config.name = config.name or "m"  # an empty config prints as "" (Triton's too)
    text = config_json(config)
    printed = json.loads(text)
    _check(CONFIG, printed, "ModelConfig")
    assert json_format.Parse(text, mc.ModelConfig()) == config


def test_dims_as_triton_example_models_compare_them() -> None:
    """What decoupled/square_model.py checks: `in_config["dims"] == [1]`, types by name."""
    config = mc.ModelConfig(
        name="square_int32",
        input=[mc.ModelInput(name="IN", data_type=mc.TYPE_INT32, dims=[1])],
        dynamic_batching=mc.ModelDynamicBatching(max_queue_delay_microseconds=100),
        version_policy=mc.ModelVersionPolicy(specific=mc.ModelVersionPolicy.Specific(versions=[3])),
    )
    printed = json.loads(config_json(config))
    assert printed["input"] == [
        {
            "name": "IN",
            "data_type": "TYPE_INT32",
            "format": "FORMAT_NONE",
            "dims": [1],
            "is_shape_tensor": False,
            "allow_ragged_batch": False,
            "optional": False,
            "is_non_linear_format_io": False,
        }
    ]
    assert printed["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert printed["version_policy"] == {"specific": {"versions": [3]}}
    assert printed["max_batch_size"] == 0 and printed["output"] == []
    assert printed["parameters"] == {} and printed["instance_group"] == []


def test_an_empty_config_prints_as_nothing() -> None:
    assert config_json(mc.ModelConfig()) == ""
