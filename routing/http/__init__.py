"""HTTP on both sides of the gateway: the client side (``client_side``: the HTTP/1.1 protocol that
faces clients; ``server``: the listening socket, workers and graceful stop; ``headers``: which
headers cross, and the request-side errors) and the upstream client that talks to the nodes
(``upstream``), plus what is read from a node's answer (``usage``)."""
