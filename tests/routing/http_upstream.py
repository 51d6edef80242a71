"""A node for the HTTP/1.1 tests, run as its own process: ``python -m tests.routing.http_upstream``.

Prints ``READY <port>``. ``POST /v1/*`` records what arrived (headers, body size and bytes'
sha256) and answers by the body's ``stub`` object:
- ``{}``: a JSON completion with a Content-Length, echoing the body's size and hash;
- ``{"chunked": true}``: the same answer sent with ``Transfer-Encoding: chunked`` in pieces;
- ``"stream": true``: an SSE stream of ``events`` events (``chunk_delay_s`` apart), chunked.
``GET /_seen`` returns the records and how many answers the client (the gateway) hung up on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

from aiohttp import web

SEEN: list[dict] = []
ABORTED = {"count": 0}


def _completion(body: bytes) -> dict:
    return {
        "id": "cmpl-h1",
        "object": "chat.completion",
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1},
        "received_bytes": len(body),
        "received_sha256": hashlib.sha256(body).hexdigest(),
    }


async def handle(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    SEEN.append(
        {
            "path": request.path,
            "headers": [[name, value] for name, value in request.headers.items()],
            "bytes": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
        }
    )
    parsed = json.loads(body)
    stub = parsed.get("stub", {})
    if parsed.get("stream"):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for index in range(stub.get("events", 5)):
                event = {"id": "cmpl-h1", "choices": [{"index": 0, "delta": {"content": f"w{index}"}}]}
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                if stub.get("chunk_delay_s"):
                    await asyncio.sleep(stub["chunk_delay_s"])
                    if request.transport is None or request.transport.is_closing():
                        raise ConnectionResetError
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionError, asyncio.CancelledError):  # aiohttp's drain: ConnectionError
            ABORTED["count"] += 1
            raise
        return response
    answer = json.dumps(_completion(body)).encode()
    if stub.get("chunked"):
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(answer), 7):
            await response.write(answer[start : start + 7])
        await response.write_eof()
        return response
    return web.Response(body=answer, content_type="application/json")


async def seen(_request: web.Request) -> web.Response:
    return web.json_response({"seen": SEEN, "aborted": ABORTED["count"]})


async def main() -> None:
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/{tail:.*}", handle)
    app.router.add_get("/_seen", seen)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"READY {runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
