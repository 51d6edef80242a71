"""HTTP on both sides of the gateway: the client side (``client_side``: the HTTP/1.1 server that
faces clients, ``asgi``: the ASGI glue the proxy reads and answers through) and the upstream
client that talks to the nodes (``upstream``), plus what is read from a node's answer (``usage``)."""
