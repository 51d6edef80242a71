"""The proxy that ties the gateway's subsystems into one request path: ``handler`` (the order of
things), ``exchange`` (what one request carries), ``relay`` (the answer to the client) and
``outcome`` (metrics, the request record, what the index learns)."""
