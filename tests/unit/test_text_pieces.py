"""The pure parts of the text routes: stop sequences cut a stream of pieces wherever its pieces
split it (service/http/textgen.py), and an NDJSON body splits into the same lines whatever its
chunks, an overlong line dropped alone (service/http/ndjson.py)."""

from __future__ import annotations

import itertools
from typing import AnyStr

from hypothesis import given
from hypothesis import strategies as st

from service.http.ndjson import Line, LineSplitter
from service.http.textgen import StopScanner

TEXT = st.text(alphabet="abc\n", max_size=40)


def cuts(data: AnyStr, positions: list[int]) -> list[AnyStr]:
    """`data` cut at the positions (taken modulo its length)."""
    points: list[int] = sorted({p % (len(data) + 1) for p in positions})
    return [data[a:b] for a, b in itertools.pairwise([0, *points, len(data)])]


@given(TEXT, st.lists(st.text(alphabet="abc", max_size=4), max_size=4), st.lists(st.integers()))
def test_stop_sequences_cut_the_text_before_the_first_wherever_the_pieces_split(
    text: str, stops: list[str], positions: list[int]
) -> None:
    scanner = StopScanner(stops)
    sent, stopped = [], False
    for piece in cuts(text, positions):
        ready, stopped = scanner.feed(piece)
        sent.append(ready)
        if stopped:
            break
    if not stopped:
        sent.append(scanner.flush())
    # The first stop sequence to complete ends the text, where it starts: `text` cut into
    # pieces anywhere is cut in the same place.
    found = [(i + len(s), i) for s in stops if s and (i := text.find(s)) >= 0]
    assert "".join(sent) == (text[: min(found)[1]] if found else text)
    assert stopped == bool(found)


def test_text_that_may_start_a_stop_sequence_is_held_back() -> None:
    scanner = StopScanner(["END"])
    assert scanner.feed("abcE") == ("abc", False)
    assert scanner.feed("N") == ("", False)
    assert scanner.feed("x") == ("ENx", False)
    assert scanner.feed("EN") == ("", False)
    assert scanner.feed("D and more") == ("", True)


def lines_of(body: bytes, positions: list[int], max_bytes: int) -> list[Line]:
    splitter = LineSplitter(max_bytes)
    found = []
    for chunk in cuts(body, positions):
        found += splitter.feed(chunk)
    return found + splitter.end()


@given(
    st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b""))), st.lists(st.integers())
)
def test_lines_are_the_same_whatever_the_chunks(parts: list[bytes], positions: list[int]) -> None:
    body = b"\n".join(parts)
    max_bytes = 8
    expected = [
        Line(n, None if len(p) > max_bytes else p)
        for n, p in enumerate((p for p in parts if len(p) > max_bytes or p.strip()), 1)
    ]
    assert lines_of(body, positions, max_bytes) == expected


def test_an_overlong_line_is_dropped_as_it_comes() -> None:
    splitter = LineSplitter(4)
    assert splitter.feed(b"abcde") == []
    assert splitter.held == bytearray()  # nothing of it is held
    assert splitter.feed(b"fgh\nok\n") == [Line(1, None), Line(2, b"ok")]
