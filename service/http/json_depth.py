"""How deeply a JSON document nests, read from its bytes before it is parsed: a body of a
million `[` must be refused for what it is, not parsed into a million lists (Triton refuses
nesting past 100). numpy does the per-byte work, a chunk at a time, so a 64 MiB body costs a
few arrays of one chunk, not a Python loop over its bytes."""

from __future__ import annotations

import numpy as np

CHUNK = 1 << 20  # bytes scanned per step

_QUOTE = ord('"')
_OPEN = (ord("["), ord("{"))
_CLOSE = (ord("]"), ord("}"))


def nesting_depth(document: bytes, chunk_bytes: int = CHUNK) -> int:
    """The deepest nesting of arrays and objects in `document`, brackets inside strings not
    counted; for a document that is not valid JSON, a number no lower than a parser would
    reach before refusing it."""
    # Escapes hold no structure: an escaped backslash or quote is dropped (pairs of
    # backslashes first, so that `\\"` keeps its quote), which leaves every quote that is
    # left opening or closing a string.
    text = document.replace(b"\\\\", b"").replace(b'\\"', b"")
    deepest = depth = 0
    in_string = False
    for start in range(0, len(text), chunk_bytes):
        chunk = np.frombuffer(text, np.uint8, min(chunk_bytes, len(text) - start), start)
        quotes = chunk == _QUOTE
        # Inside a string from an opening quote to its closing one (inclusive of the first).
        inside = (np.cumsum(quotes, dtype=np.int64) + in_string) % 2 == 1
        steps = ((chunk == _OPEN[0]) | (chunk == _OPEN[1])).astype(np.int64) - (
            (chunk == _CLOSE[0]) | (chunk == _CLOSE[1])
        )
        steps[inside] = 0
        levels = np.cumsum(steps) + depth
        if levels.size:
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
        in_string = (int(quotes.sum()) + in_string) % 2 == 1
    return deepest
