"""tests/servers.py's json_lines: the tests read a server's log while it writes it, so the last
line may be half written (CI at eac2339 failed a test on one); only whole lines are parsed."""

from __future__ import annotations

import json
from itertools import accumulate

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.servers import json_lines

record = st.dictionaries(st.sampled_from(["level", "message", "request_id"]), st.text(max_size=20))


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(records=st.lists(record, min_size=1, max_size=5), cut=st.integers(0, 200))
def test_a_half_written_last_line_is_left_for_the_next_read(
    records: list[dict[str, str]], cut: int
) -> None:
    lines = [json.dumps(r) + "\n" for r in records] + ["I1206 a line grpc wrote\n"]
    text = "".join(lines)
    written = text[: len(text) - cut]  # what a reader found: the writer stopped anywhere
    ends = accumulate(len(line) for line in lines)  # where each line's newline is written
    assert json_lines(written) == [
        r for r, end in zip(records, ends, strict=False) if end <= len(written)
    ]
