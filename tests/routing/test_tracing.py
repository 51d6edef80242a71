"""OpenTelemetry traces of the gateway: off by default, on with OTEL_EXPORTER_OTLP_*, one span per
request with the GenAI attributes and gorgo's routing decision, W3C trace context to the node."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from routing.contract import GorgoParams
from routing.observability.tracing import GatewayTracing, tracing_enabled
from simulator.fleet import Fleet
from simulator.harness import wait_until
from tests.routing.support import MODEL, gateway_config, make_node, make_snapshot, publish, running_gateway
from tests.routing.test_e2e_gateway import publish_policy, start_fleet, start_gateway
from tests.simulator.conftest import small_topology

INCOMING_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
INCOMING = f"00-{INCOMING_TRACE_ID}-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("environ", "enabled"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "false"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
    ],
)
def test_it_follows_the_standard_otel_variables(environ: dict[str, str], enabled: bool) -> None:
    assert tracing_enabled(environ) is enabled


def test_it_imports_no_opentelemetry_when_off() -> None:
    code = (
        "import sys\n"
        "from routing.app import create_app\n"
        "from routing.observability.tracing import tracing_from_env\n"
        "assert tracing_from_env('us-east', 'gw', {}) is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


async def test_it_traces_each_request_with_genai_and_routing_attributes(
    spans, redis_keys, redis_url, caplog
) -> None:
    fleet = Fleet.start(small_topology(), auto_ports=True, only=["node-a"])
    await fleet.open()
    client = aioredis.Redis.from_url(redis_url)
    tracing = GatewayTracing.with_processor(SimpleSpanProcessor(spans), region="us-east", gateway_id="gw-1")
    try:
        node = make_node(1, fleet.url("node-a"), name="node-a")
        await publish(client, redis_keys, make_snapshot((node,), params=GorgoParams()))
        async with running_gateway(gateway_config(redis_keys, redis_url), tracing=tracing) as gateway:
            with caplog.at_level(logging.DEBUG, logger="simulator.trace"):
                plain = await gateway.http.post(
                    "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": "Hi there"}],
                        "max_tokens": 5,
                    },
                    headers={"traceparent": INCOMING},
                )
                streamed = await gateway.http.post(
                    "/v1/completions",
                    json={
                        "model": MODEL,
                        "prompt": "Once upon a time",
                        "max_tokens": 4,
                        "temperature": 0.5,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    },
                )
                missing = await gateway.http.post(
                    "/v1/chat/completions",
                    json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
                )
    finally:
        await client.aclose()
        await fleet.close()

    assert (plain.status_code, streamed.status_code, missing.status_code) == (200, 200, 404)
    chat, completion, refused = spans.get_finished_spans()

    # The client's trace is continued, and the node receives the gateway's span as its parent.
    assert chat.name == f"chat {MODEL}"
    assert chat.kind is SpanKind.SERVER
    assert format(chat.context.trace_id, "032x") == INCOMING_TRACE_ID
    assert format(chat.parent.span_id, "016x") == "00f067aa0ba902b7"
    sent = re.findall(r"node-a traceparent=(\S+)", caplog.text)
    assert sent[0] == f"00-{INCOMING_TRACE_ID}-{chat.context.span_id:016x}-01"
    assert sent[1].split("-")[1] == format(completion.context.trace_id, "032x")  # a new trace

    attributes = chat.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "vllm"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.request.max_tokens"] == 5
    assert attributes["gen_ai.response.model"] == MODEL
    assert attributes["gen_ai.response.id"] == plain.json()["id"]
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["gen_ai.usage.input_tokens"] == plain.json()["usage"]["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == 5
    assert attributes["http.response.status_code"] == 200
    assert attributes["server.address"] == "127.0.0.1"
    assert attributes["gorgo.node.name"] == "node-a"
    assert attributes["gorgo.node.id"] == 1
    assert attributes["gorgo.gateway.region"] == "us-east"
    assert attributes["gorgo.policy.version"] == 1
    assert attributes["gorgo.policy.algorithm"] == "gorgo"
    assert attributes["gorgo.cost.node_id"] == 1
    assert attributes["gorgo.cost.total_ms"] > 0
    assert attributes["gorgo.cost.uncached_tokens"] > 0
    assert "gorgo.cost.matched_tokens" in attributes and "gorgo.cost.prefill_ms" in attributes
    assert attributes["gorgo.ttft_ms"] > 0
    assert chat.status.status_code is StatusCode.UNSET

    assert completion.name == f"text_completion {MODEL}"
    assert completion.attributes["gen_ai.operation.name"] == "text_completion"
    assert completion.attributes["gen_ai.request.temperature"] == 0.5
    assert completion.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert completion.attributes["gen_ai.usage.output_tokens"] == 4
    assert completion.attributes["gorgo.stream"] is True
    assert completion.parent is None

    assert refused.attributes["http.response.status_code"] == 404
    assert refused.attributes["error.type"] == "404"
    assert "gorgo.node.name" not in refused.attributes
    assert chat.resource.attributes["service.name"] == "gorgo-gateway"
    assert chat.resource.attributes["gorgo.region"] == "us-east"


class _Collector(BaseHTTPRequestHandler):
    """A stand-in OpenTelemetry collector: keeps every OTLP/HTTP trace export it receives."""

    received: list[bytes]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces":
            self.server.received.append(body)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    server.received = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.e2e
def test_it_exports_to_the_otlp_endpoint_of_the_environment(
    processes, redis_keys, redis_url, collector
) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    urls = start_fleet(processes, ("us-east-1",))
    publish_policy(redis_url, redis_keys, urls, version=1)
    gateway = start_gateway(
        processes,
        redis_url,
        redis_keys,
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_address[1]}",
            "OTEL_SERVICE_NAME": "gateway-under-test",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        },
    )
    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3},
        timeout=30,
    )
    assert response.status_code == 200
    wait_until(lambda: collector.received, 15, what="an OTLP trace export", describe=processes.logs)

    export = ExportTraceServiceRequest.FromString(collector.received[0])
    resource_spans = export.resource_spans[0]
    resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
    span = resource_spans.scope_spans[0].spans[0]
    attributes = {kv.key: kv.value for kv in span.attributes}
    assert resource["service.name"] == "gateway-under-test"
    assert span.name == f"chat {MODEL}"
    assert attributes["gen_ai.request.model"].string_value == MODEL
    assert attributes["gorgo.node.name"].string_value == "us-east-1"
    assert attributes["gen_ai.usage.output_tokens"].int_value == 3
