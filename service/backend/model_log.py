"""How a Python model's `pb_utils.Logger` lines travel to the server's log: on its worker's
output pipe with its prints, each line marked with its level, so the front-end logs it at that
level under the same per-model budget as any other line (service/workers/model_output.py).

A model could mark a print itself: that only sets the level of its own line, which stays named
for the model and within its budget."""

from __future__ import annotations

import logging

MARK = "\x1e"  # ASCII record separator: never in text a model means to print
LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "V": logging.DEBUG}


def marked(letter: str, message: str) -> str:
    """The lines to write for one message (each of its lines marked)."""
    return "".join(f"{MARK}{letter} {line}\n" for line in message.split("\n"))


def level_of(raw: bytes) -> tuple[int, bytes]:
    """A line's level and its text (INFO and the line as it is where it is not marked)."""
    if raw[:1] == MARK.encode() and raw[2:3] == b" ":
        level = LEVELS.get(raw[1:2].decode(errors="replace"))
        if level is not None:
            return level, raw[3:]
    return logging.INFO, raw
