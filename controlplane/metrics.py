"""The control plane's Prometheus endpoint (``GET /metrics`` on the web process): one page from
every app.

Each app registers what it exports (``@exports_metrics``, a function yielding metric families read
at scrape time) when it is ready: the policies (published version, publishes), telemetry (node
health, the RTT matrix, task lag); core serves them all without importing any of them. Nothing is
counted on a request path, so a scrape costs a few small queries and Redis reads.

Access: with ``GORGO_METRICS_TOKEN`` set, a scrape must send ``Authorization: Bearer <token>``;
without it only loopback clients are answered (a one-machine ``make run``), everyone else gets 403.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable, Iterator

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

MetricsSource = Callable[[], Iterable[Metric]]

LOOPBACK_ADDRESSES = frozenset({"127.0.0.1", "::1"})

_sources: list[MetricsSource] = []


def exports_metrics(source: MetricsSource) -> MetricsSource:
    """Register ``source``: it yields metric families, read at every scrape."""
    if source not in _sources:
        _sources.append(source)
    return source


class _Sources(Collector):
    def describe(self) -> list[Metric]:
        return []  # only known at scrape time

    def collect(self) -> Iterator[Metric]:
        for source in _sources:
            yield from source()


def _allowed(request: HttpRequest) -> bool:
    token = settings.GORGO_METRICS_TOKEN
    if not token:
        return request.META.get("REMOTE_ADDR") in LOOPBACK_ADDRESSES
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip(), token)


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text exposition of every registered source."""
    if not _allowed(request):
        message = (
            "send Authorization: Bearer <GORGO_METRICS_TOKEN>"
            if settings.GORGO_METRICS_TOKEN
            else "GORGO_METRICS_TOKEN is not set: /metrics answers loopback clients only"
        )
        return HttpResponse(message + "\n", status=403, content_type="text/plain")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Sources())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_PLAIN_0_0_4)
