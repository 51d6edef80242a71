"""Surviving nodes that fail: per-node circuit breakers and the retry budget (``breaker``), the
retry loop that uses them (``retry``), and the gateway's own health probe of a suspect node
(``node_probe``)."""
