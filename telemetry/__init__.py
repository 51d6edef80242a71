"""Telemetry: the workers that keep the control plane's and the gateways' picture of the fleet true.

RTT probes from every region, vLLM ``/metrics`` scrapes, health hysteresis, request-log aggregation
into TTFT breakdowns, retention, live state in Redis and pushes to the dashboard. See
docs/telemetry.md.
"""
