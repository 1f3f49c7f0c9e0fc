"""`make bench-worker-loop` (scripts/bench_worker_loop.py) at its smallest: each batch size,
with requests of one form and of two taking turns, gives a row whose parts are measured;
never how fast."""

from __future__ import annotations

from google.protobuf import text_format

from protos.inference import model_config_pb2 as mc
from scripts.bench_common import worker_predictor
from scripts.bench_worker_loop import BATCHES, FORMS, MODEL, measure
from tests.servers import EXAMPLE_MODELS


def test_each_case_gives_a_row_with_every_part_measured() -> None:
    config = text_format.Parse(
        (EXAMPLE_MODELS / MODEL / "config.pbtxt").read_text(), mc.ModelConfig()
    )
    model = worker_predictor(EXAMPLE_MODELS / MODEL)
    cases = [(forms, batch) for forms in FORMS for batch in BATCHES]
    rows = [measure(model, config, 0, forms, batch, runs=3) for forms, batch in cases]
    assert [(row.forms, row.batch) for row in rows] == cases
    for row in rows:
        assert row.predictor_us > 0 and row.worker_us > 0 and row.caller_us > 0, row
        assert 0 < row.inside_us < row.worker_us, row  # the run is a part of the loop
