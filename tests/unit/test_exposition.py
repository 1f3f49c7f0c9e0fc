"""Python models' metric families as the metrics endpoint writes them (Triton's text format):
read back by prometheus_client's parser as the families, kinds, labels and values they are."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from service.observability.exposition import families_text
from service.workers.model_metrics import Family, Series


def test_families_read_back_as_written() -> None:
    odd = (("model", 'a "quoted"\nvalue\\'),)
    families = [
        Family("hits", "counter", "hits seen\nper model", {odd: Series((), 3.0)}),
        Family("level", "gauge", "a gauge", {(): Series((), float("inf"))}),
        Family("spread", "histogram", "x seen", {(): Series((1.0, 10.0), 55.5, [1, 1, 1], 3)}),
    ]
    text = families_text(families).decode()
    assert "# TYPE hits counter" in text.splitlines()  # not hits_total, as Triton writes it
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert (
        parsed["hits"].type == "counter" and parsed["hits"].documentation == "hits seen\nper model"
    )
    (hits,) = parsed["hits"].samples
    assert (hits.labels, hits.value) == ({"model": 'a "quoted"\nvalue\\'}, 3.0)
    assert parsed["level"].samples[0].value == float("inf")
    buckets = [
        (s.labels.get("le"), s.value)
        for s in parsed["spread"].samples
        if s.name.endswith("_bucket")
    ]
    assert buckets == [("1.0", 1.0), ("10.0", 2.0), ("+Inf", 3.0)]
