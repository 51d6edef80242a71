"""OpenTelemetry traces of the gateway: one span per inference request, off unless configured.

Tracing is on when an OTLP endpoint is configured the standard way (``OTEL_EXPORTER_OTLP_ENDPOINT``
or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) and not switched off (``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none``). Every other standard variable applies as the SDK reads it
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER[_ARG]``,
``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_BSP_*``...). When it is off, :func:`tracing_from_env`
returns None without importing OpenTelemetry, and the request path pays one ``is None`` test.

The span follows the OpenTelemetry GenAI semantic conventions (``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.request.max_tokens``, ``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens``, ``gen_ai.response.finish_reasons``...) and carries gorgo's routing
decision under ``gorgo.*`` (node, regions, policy, cost terms, matched tokens, runner-up). An
incoming W3C ``traceparent`` is continued, and the gateway's own span context is sent to the node
in ``traceparent``/``tracestate``, so a traced vLLM (``--otlp-traces-endpoint``) joins the trace.

The OpenTelemetry packages are the optional extra ``tracing`` (``pip install 'gorgo[tracing]'``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from routing.env import parse_bool

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.trace import Span

    from routing.contract import NodeSpec, RequestRecord

logger = logging.getLogger("routing.tracing")

OPERATION_NAMES = {"chat": "chat", "completions": "text_completion", "embeddings": "embeddings"}
PROVIDER = "vllm"
_TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})


class TracingUnavailable(RuntimeError):
    """Tracing is configured but cannot run (the ``tracing`` extra is not installed)."""


def tracing_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard OTEL_* variables ask for traces (no OpenTelemetry import)."""
    if _sdk_disabled(environ.get("OTEL_SDK_DISABLED", "")):
        return False
    exporters = {part.strip().lower() for part in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    if "otlp" not in exporters:
        return False
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    )


def _sdk_disabled(raw: str) -> bool:
    """Unset, empty or a false word leaves the SDK on; anything else turns it off (the safe side)."""
    if not raw.strip():
        return False
    try:
        return parse_bool(raw)
    except ValueError:
        return True


def tracing_from_env(
    region: str, gateway_id: str, environ: Mapping[str, str] = os.environ
) -> GatewayTracing | None:
    """The gateway's tracing when the environment asks for it, else None (nothing imported)."""
    if not tracing_enabled(environ):
        return None
    processor = _otlp_processor(environ)
    tracing = GatewayTracing.with_processor(processor, region=region, gateway_id=gateway_id)
    logger.info("tracing on: OTLP %s", environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
    return tracing


def _otlp_processor(environ: Mapping[str, str]) -> SpanProcessor:
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip() or "http/protobuf"
    try:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise TracingUnavailable(
                f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported (use http/protobuf or grpc)"
            )
    except ImportError as exc:
        extra = "opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else "gorgo[tracing]"
        raise TracingUnavailable(
            f"an OTLP endpoint is configured but OpenTelemetry is not installed ({exc.name}): "
            f"pip install '{extra}', or unset OTEL_EXPORTER_OTLP_ENDPOINT"
        ) from None
    # The exporter reads its endpoint, headers, timeout and compression from OTEL_EXPORTER_OTLP_*;
    # the batch processor exports off the event loop, in its own thread.
    return BatchSpanProcessor(OTLPSpanExporter())


class _Choice(msgspec.Struct):
    finish_reason: str | None = None


class _Answer(msgspec.Struct):
    id: str | None = None
    model: str | None = None
    choices: list[_Choice] = []


class _Sampling(msgspec.Struct):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None


_answer_decoder = msgspec.json.Decoder(_Answer)
_sampling_decoder = msgspec.json.Decoder(_Sampling)


class GatewayTracing:
    """Starts and finishes the request spans of one gateway process."""

    def __init__(self, provider: TracerProvider, *, region: str, gateway_id: str) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._tracer = provider.get_tracer("gorgo.routing")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER
        self._region = region
        self._gateway_id = gateway_id

    @classmethod
    def with_processor(cls, processor: SpanProcessor, *, region: str, gateway_id: str) -> GatewayTracing:
        """A tracer provider of its own (resource from OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win; "gorgo-gateway" only replaces the SDK's
        # "unknown_service" placeholder.
        resource = Resource.create({"gorgo.region": region, "service.instance.id": gateway_id})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "gorgo-gateway"}))
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(processor)
        return cls(provider, region=region, gateway_id=gateway_id)

    def start(
        self,
        scope_headers: Sequence[tuple[bytes, bytes]],
        upstream_headers: list[tuple[bytes, bytes]],
        endpoint: str,
        body: bytes,
        start_time_s: float,
    ) -> Span:
        """Open the request's span (continuing an incoming ``traceparent``) and put its context in
        the headers that go to the node, replacing the client's own trace headers."""
        from opentelemetry.trace import set_span_in_context

        carrier = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in scope_headers
            if name.lower() in (b"traceparent", b"tracestate")
        }
        parent = self._propagator.extract(carrier) if carrier else None
        operation = OPERATION_NAMES.get(endpoint, endpoint)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.system": PROVIDER,
            "gorgo.gateway.region": self._region,
            "gorgo.gateway.id": self._gateway_id,
        }
        try:
            sampling = _sampling_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            sampling = None  # the gateway answers the bad body with a 400; the span says so
        model = None
        if sampling is not None:
            model = sampling.model
            max_tokens = sampling.max_completion_tokens or sampling.max_tokens
            for key, value in (
                ("gen_ai.request.model", model),
                ("gen_ai.request.max_tokens", max_tokens),
                ("gen_ai.request.temperature", sampling.temperature),
                ("gen_ai.request.top_p", sampling.top_p),
            ):
                if value is not None:
                    attributes[key] = value
        span = self._tracer.start_span(
            f"{operation} {model}" if model else operation,
            context=parent,
            kind=self._kind,
            attributes=attributes,
            start_time=int(start_time_s * 1e9),
        )
        upstream_headers[:] = [item for item in upstream_headers if item[0].lower() not in _TRACE_HEADERS]
        outgoing: dict[str, str] = {}
        self._propagator.inject(outgoing, context=set_span_in_context(span))
        upstream_headers.extend(
            (name.encode("latin-1"), value.encode("latin-1")) for name, value in outgoing.items()
        )
        return span

    def answer(self, span: Span, data: bytes, *, stream: bool) -> None:
        """Read the response id, model and finish reasons from a body, or from a stream's tail."""
        reasons: list[str] = []
        documents = [data] if not stream else _stream_events(data)
        for document in documents:
            try:
                answer = _answer_decoder.decode(document)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if answer.id:
                span.set_attribute("gen_ai.response.id", answer.id)
            if answer.model:
                span.set_attribute("gen_ai.response.model", answer.model)
            reasons.extend(choice.finish_reason for choice in answer.choices if choice.finish_reason)
        if reasons:
            span.set_attribute("gen_ai.response.finish_reasons", reasons)

    def finish(self, span: Span, record: RequestRecord, node: NodeSpec | None) -> None:
        """Close the span with what the request record knows (model, tokens, node, cost, status)."""
        from opentelemetry.trace import StatusCode

        attributes: dict[str, Any] = {
            "http.response.status_code": record.status,
            "gorgo.stream": record.stream,
            "gorgo.prompt_tokens_estimated": record.prompt_tokens_est,
            "gorgo.routing.decision_us": record.routing_us,
            "gorgo.gateway_ms": record.gateway_ms,
        }
        optional = {
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": record.cached_tokens,
            "gorgo.policy.version": record.policy_version,
            "gorgo.policy.algorithm": record.algorithm,
            "gorgo.node.region": record.node_region,
            "gorgo.ttft_ms": record.ttft_ms,
            "error.type": str(record.status) if record.status >= 400 else None,
        }
        attributes.update({key: value for key, value in optional.items() if value is not None})
        if node is not None:
            host, _, port = node.base_url.split("://", 1)[-1].partition("/")[0].rpartition(":")
            attributes.update(
                {"gorgo.node.name": node.name, "gorgo.node.id": node.id, "server.address": host}
            )
            if port.isdigit():
                attributes["server.port"] = int(port)
        for prefix, cost in (("gorgo.cost", record.cost), ("gorgo.runner_up", record.runner_up)):
            if cost is not None:
                attributes.update(
                    {
                        f"{prefix}.node_id": cost.node_id,
                        f"{prefix}.total_ms": cost.total_ms,
                        f"{prefix}.rtt_ms": cost.rtt_ms,
                        f"{prefix}.queue_ms": cost.queue_ms,
                        f"{prefix}.prefill_ms": cost.prefill_ms,
                        f"{prefix}.matched_tokens": cost.matched_tokens,
                        f"{prefix}.uncached_tokens": cost.uncached_tokens,
                    }
                )
        span.set_attributes(attributes)
        if record.status >= 500:
            span.set_status(StatusCode.ERROR, record.error or None)
        span.end()

    def shutdown(self) -> None:
        """Flush what is buffered (bounded by the processor's own export timeout)."""
        self.provider.shutdown()


def _stream_events(tail: bytes) -> list[bytes]:
    """The JSON documents of the complete ``data:`` events in a stream's last bytes."""
    events = []
    for line in tail.split(b"\n"):
        line = line.strip()
        if line.startswith(b"data:") and line != b"data: [DONE]":
            events.append(line[5:].strip())
    return events
