"""vLLM's KV-cache events at the gateway, one concern a file (as vLLM's router keeps them):
``decoder`` (the wire format), ``subscriber`` (one node's stream, sequence and mode), ``manager``
(every subscriber of the gateway), ``report`` (their state to Redis for the dashboard) and
``collector`` (their Prometheus metrics)."""
