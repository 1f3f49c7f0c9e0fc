"""Python models' metric families as the metrics endpoint writes them (Triton's text format):
read back by prometheus_client's parser as the families, kinds, labels and values they are."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from service.observability.exposition import families_text, serve
from service.observability.scrape_bounds import ScrapeLimits
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


def test_the_metrics_thread_sleeps_in_the_kernel_until_a_scrape_or_its_stop() -> None:
    """No poll for shutdown: the idle thread is not switched in at all, a scrape is
    answered, and shutdown() returns with the thread ended."""

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"up 1\n"]

    server = serve("127.0.0.1", 0, app, ScrapeLimits())
    thread = next(t for t in threading.enumerate() if t.name == "metrics")
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        assert urllib.request.urlopen(url).read() == b"up 1\n"  # its loop is running
        status = Path(f"/proc/self/task/{thread.native_id}/status")
        while "State:\tS" not in status.read_text():  # back in select(), or still on its way
            time.sleep(0.01)
        before = _slept(status.read_text())
        time.sleep(0.5)  # a span to look at, not a timing asserted on
        assert _slept(status.read_text()) == before  # it never woke up to sleep again
        assert urllib.request.urlopen(url).read() == b"up 1\n"
    finally:
        server.shutdown()
        server.server_close()
    thread.join(5.0)
    assert not thread.is_alive()


def _slept(status: str) -> int:
    """How many times the thread went to sleep (a poll loop sleeps again at each timeout)."""
    return next(
        int(line.split()[1])
        for line in status.splitlines()
        if line.startswith("voluntary_ctxt_switches")
    )
