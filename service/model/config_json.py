"""A ModelConfig as JSON the way Triton prints it (its ModelConfigToJson): proto field names,
enum names, every field without presence at its default (scalars, lists, maps), and 64-bit
integers as JSON numbers where protobuf's JSON mapping writes strings. This is what a Python
model's `args["model_config"]` holds, so a model.py that compares `dims` to `[1]` runs here
as it does under Triton."""

from __future__ import annotations

import json
from typing import Any, cast

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from protos.inference import model_config_pb2 as mc

_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def config_json(config: mc.ModelConfig) -> str:
    """Triton's text: empty for a config that sets nothing (as Triton answers it)."""
    if config.ByteSize() == 0:
        return ""
    return json.dumps(config_dict(config))


def config_dict(config: Message) -> dict[str, Any]:
    printed = json_format.MessageToDict(
        config, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    )
    return _numbers(cast(Descriptor, config.DESCRIPTOR), printed)


def _numbers(descriptor: Descriptor, printed: dict[str, Any]) -> dict[str, Any]:
    """64-bit values as numbers; map keys stay strings (JSON has no other keys)."""
    for name, value in printed.items():
        field = descriptor.fields_by_name[name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            printed[name] = {k: _value(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            printed[name] = [_value(field, v) for v in value]
        else:
            printed[name] = _value(field, value)
    return printed


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.type in _INT64_TYPES:
        return int(value)
    if field.message_type is not None and isinstance(value, dict):
        return _numbers(field.message_type, value)
    return value
