"""A protobuf message (a model's config, statistics) as the JSON Triton's REST API answers:
every field, default values included, under its .proto name, 64-bit integers as numbers
(protobuf's own JSON writes them as strings; Triton turns them back, and its clients read
numbers)."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

_INT64 = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def proto_json(message: Message) -> dict[str, Any]:
    document = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _numbers(message.DESCRIPTOR, document)
    return document


def _numbers(descriptor: Any, document: dict[str, Any]) -> None:
    """64-bit integers of `document` (a message of `descriptor`) back to numbers, in place."""
    for name, value in document.items():
        field = descriptor.fields_by_name[name]
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            field = entry.fields_by_name["value"]
            entry = field.message_type
            if entry is not None:
                for item in value.values():
                    _numbers(entry, item)
            elif field.type in _INT64:
                document[name] = {k: int(v) for k, v in value.items()}
        elif entry is not None:
            for item in value if isinstance(value, list) else [value]:
                _numbers(entry, item)
        elif field.type in _INT64:
            document[name] = [int(v) for v in value] if isinstance(value, list) else int(value)
