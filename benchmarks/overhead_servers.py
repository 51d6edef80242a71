"""The servers the gateway-overhead benchmark measures against (each run as its own process).

    python benchmarks/overhead_servers.py mock                        # prints "READY <port>"
    python benchmarks/overhead_servers.py proxy aiohttp --upstream URL [--upstream URL ...]  # uvicorn logs its port

- ``mock``: a no-delay OpenAI backend on raw asyncio + httptools with canned vLLM-shaped answers
  (chat completion with usage; a stream of nine SSE events written one per loop turn, usage
  event and ``[DONE]`` last). Fast enough that it is never the bottleneck.
- ``proxy aiohttp|httpx``: the smallest possible raw-ASGI proxy on uvicorn (uvloop, httptools)
  with each upstream client, round robin over the upstreams: the floor a Python proxy on that
  stack sets.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from typing import Any

MODEL = "mock-model"

# ---- the mock backend: raw asyncio + httptools, canned vLLM-shaped answers ---------------------

_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-mock",
        "object": "chat.completion",
        "created": 1767225600,
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 16, "total_tokens": 18, "completion_tokens": 2},
    }
).encode()
_STREAM_EVENTS = [
    b'data: {"id":"chatcmpl-mock","object":"chat.completion.chunk","model":"mock-model","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    *(
        b'data: {"id":"chatcmpl-mock","object":"chat.completion.chunk","model":"mock-model","choices":[{"index":0,"delta":{"content":"'
        + word
        + b'"}}]}\n\n'
        for word in (b"Hel", b"lo", b"!", b" How", b" are", b" you")
    ),
    b'data: {"id":"chatcmpl-mock","choices":[],"usage":{"prompt_tokens":16,"total_tokens":22,"completion_tokens":6}}\n\n',
    b"data: [DONE]\n\n",
]
_MODELS = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "mock"}]}
).encode()


def _fixed(status: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _MockProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive; answers every request at once (streams: one write per SSE event)."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.url = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        transport = self.transport
        assert transport is not None
        body, self.body = b"".join(self.body), []
        if self.parser.get_method() == b"GET":
            transport.write(_fixed(b"200 OK", _MODELS if self.url.startswith(b"/v1/models") else b"{}"))
        elif b'"stream":true' in body or b'"stream": true' in body:
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            transport.write(head + _chunk(_STREAM_EVENTS[0]))
            # The other events in later loop turns, one write each, like a server yielding tokens.
            asyncio.get_running_loop().call_soon(self._write_events, 1)
        else:
            transport.write(_fixed(b"200 OK", _COMPLETION))

    def _write_events(self, index: int) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if index == len(_STREAM_EVENTS):
            transport.write(b"0\r\n\r\n")
            return
        transport.write(_chunk(_STREAM_EVENTS[index]))
        asyncio.get_running_loop().call_soon(self._write_events, index + 1)


async def _serve_mock() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_MockProtocol, "127.0.0.1", 0, backlog=1024)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


# ---- minimal raw-ASGI proxies: the upstream-client comparison ----------------------------------


def _proxy_app(client_kind: str, upstreams: list[str]) -> Any:
    """The least a proxy can do: forward the body, pass the answer back (streams chunk by chunk)."""
    state: dict[str, Any] = {}
    turn = itertools.cycle(upstreams)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    if client_kind == "aiohttp":
                        import aiohttp

                        state["client"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
                    else:
                        import httpx

                        state["client"] = httpx.AsyncClient(limits=httpx.Limits(max_connections=None))
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        url = next(turn) + scope["path"]
        client = state["client"]
        headers = {"content-type": "application/json"}
        if client_kind == "aiohttp":
            async with client.post(url, data=body, headers=headers) as response:
                out = [
                    (k.lower(), v)
                    for k, v in response.raw_headers
                    if k.lower() not in (b"transfer-encoding",)
                ]
                await send({"type": "http.response.start", "status": response.status, "headers": out})
                async for chunk in response.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        else:
            request = client.build_request("POST", url, content=body, headers=headers)
            response = await client.send(request, stream=True)
            try:
                out = [(k, v) for k, v in response.headers.raw if k.lower() != b"transfer-encoding"]
                await send({"type": "http.response.start", "status": response.status_code, "headers": out})
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finally:
                await response.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def run_uvicorn(app: Any, **options: Any) -> None:
    """Serve a raw ASGI app on uvicorn as the benchmarks measure it: a free port on 127.0.0.1,
    uvloop + httptools, no access log (it prints ``Uvicorn running on http://127.0.0.1:<port>``)."""
    import uvicorn

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=0,
        loop="uvloop",
        http="httptools",
        log_level="info",
        access_log=False,
        **options,
    )


def _serve_proxy(client_kind: str, upstreams: list[str]) -> None:
    run_uvicorn(_proxy_app(client_kind, upstreams))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("server", choices=("mock", "proxy"))
    parser.add_argument("client", nargs="?", choices=("aiohttp", "httpx"), help="upstream client of a proxy")
    parser.add_argument("--upstream", action="append", help="a mock's URL, for a proxy (repeatable)")
    args = parser.parse_args()
    if args.server == "mock":
        import uvloop

        uvloop.run(_serve_mock())
    else:
        if not (args.client and args.upstream):
            parser.error("proxy needs a client (aiohttp or httpx) and --upstream")
        _serve_proxy(args.client, args.upstream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
