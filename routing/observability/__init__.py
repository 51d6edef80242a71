"""What the gateway tells operators: its own Prometheus exporter (``exporter``), OpenTelemetry
traces (``tracing``) and the per-request record stream (``request_log``)."""
