"""Scraping a server's Prometheus endpoint in tests: urllib on 127.0.0.1, parsed with
prometheus_client's own parser."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    assert url.startswith("http://127.0.0.1:"), url
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def scrape_until(url: str, predicate, timeout: float = 60.0) -> dict:
    """Scrapes until `predicate(metrics)` holds; returns that scrape."""
    end = time.monotonic() + timeout
    while not predicate(metrics := scrape(url)):
        assert time.monotonic() < end, f"condition not reached in time: {metrics}"
        time.sleep(0.05)
    return metrics
