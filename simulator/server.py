"""One emulated vLLM server: an aiohttp application in front of an ``Engine``.

Routes (as vLLM's OpenAI-compatible server): ``POST /v1/chat/completions``, ``POST
/v1/completions`` (both streaming and not), ``GET /v1/models``, ``GET /health`` (200 with an
empty body, 503 once the engine is dead), ``GET /metrics``, and the tokenizer endpoints routers
call before routing: ``POST /tokenize``, ``POST /v1/chat/completions/render`` and ``POST
/v1/completions/render`` (token ids of a request, as the engine would see them; no generation). Every response carries
``x-gorgo-sim-node: <node name>`` so tests and the traffic generator can tell which node
answered; that is the only addition to vLLM's interface.

Region ports (``start(..., region_ports=True)``): besides its own port the node listens on one
extra port per region of the topology, and a request that arrives on region R's port pays R's
round trip as if it carried ``X-Gorgo-Region: R`` (whatever header it has). A client that cannot
set the header, such as another router, reaches the node "from" R through ``url_for(R)``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from hashlib import blake2b
from typing import Any

from aiohttp import web

from simulator.engine import ENGINE_DEAD, Engine, EngineDead, SimRequest
from simulator.kv_events import Publisher
from simulator.metrics import NodeMetrics
from simulator.protocol import (
    ChatCompletionRequest,
    ChunkRenderer,
    CompletionRequest,
    RequestError,
    TokenizeRequest,
    chat_completion_body,
    completion_body,
    decode_request,
    error_response,
    json_response,
    usage,
)
from simulator.tokenizer import VOCAB_SIZE, render_chat, tokenize, tokenize_completion_prompt
from simulator.topology import NodeSpec, Topology
from simulator.wan import REGION_HEADER, WANEmulator

# Like a traced vLLM, a node sees the W3C trace context its caller sends; it logs it (DEBUG) so a
# test or an operator can follow a trace from gateway to node.
trace_log = logging.getLogger("simulator.trace")

NODE_HEADER = "x-gorgo-sim-node"
_OUT_DELAY_KEY = web.RequestKey("gorgo_out_delay_s", float)
_STARTED_KEY = web.RequestKey("gorgo_started_s", float)
_CLIENT_REGION_KEY = web.RequestKey("gorgo_client_region", str)
# Called with (this node, prompt token ids, client region or "", request key) as each chat
# request arrives: the fleet's lower-bound bookkeeping (``Fleet.oracle``), for benchmarks.
OracleHook = Callable[["SimNode", list[int], str, str], None]
# ... and, once a request's first token is out, how long it queued and prefilled (``Fleet.served``).
ServedHook = Callable[["SimNode", str, SimRequest, float], None]
# Headroom over vLLM's prompt limits; aiohttp's default (1 MiB) is too small for long chats.
CLIENT_MAX_SIZE_BYTES = 64 * 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SimNode:
    """An emulated vLLM node: engine, metrics, WAN emulation and its HTTP listener."""

    def __init__(self, spec: NodeSpec, topology: Topology, *, time_scale: float = 1.0) -> None:
        self.spec = spec
        self.name = spec.name
        self.region = spec.region
        self.model = spec.model
        self.params = spec.engine
        self.time_scale = time_scale
        self.host = spec.host
        self.port = spec.port
        self.bound_port: int | None = None  # the port of the first successful start
        self.region_urls: dict[str, str] = {}  # client region -> URL of its region port
        self._topology = topology
        self._port_regions: dict[int, str] = {}  # local port -> the client region it stands for
        self._bound_region_ports: dict[str, int] = {}  # kept across restarts, like bound_port
        self.wan = WANEmulator(topology, spec.name, spec.region, time_scale=time_scale)
        self.oracle: OracleHook | None = None
        self.served: ServedHook | None = None
        self.engine: Engine | None = None
        self.metrics: NodeMetrics | None = None
        # vLLM's KV-event publisher, when the node's kv_events_config enables it; kept across
        # restarts so a restarted node publishes on the same ports (from sequence 0, new hashes).
        self.publisher: Publisher | None = (
            Publisher(spec.kv_events, spec.host)
            if spec.kv_events is not None and spec.kv_events.enabled
            else None
        )
        self.started_at = int(time.time())
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    def url_for(self, region: str) -> str:
        """The URL that reaches this node as a client in ``region`` (needs ``region_ports``)."""
        try:
            return self.region_urls[region]
        except KeyError:
            raise KeyError(
                f"node {self.name} has no port for region {region!r}; start it with region_ports=True"
                f" (regions: {sorted(self.region_urls) or 'none'})"
            ) from None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, host: str, port: int, *, region_ports: bool = False) -> None:
        """Boot a fresh engine (empty KV cache, zeroed counters, like a restarted vLLM) and listen.

        With ``region_ports``, also listen on one port per topology region (free ports the first
        time, the same ones on a restart); see ``url_for``.
        """
        if self._runner is not None:
            raise RuntimeError(f"node {self.name} is already running")
        params = self.params
        self.metrics = NodeMetrics(
            self.model,
            max_model_len=params.max_model_len,
            block_size=params.block_size,
            num_gpu_blocks=params.kv_capacity_blocks,
        )
        if self.publisher is not None:
            self.publisher.start(host)
        self.engine = Engine(params, self.metrics, time_scale=self.time_scale, publisher=self.publisher)
        self.engine.start()
        self.started_at = int(time.time())
        app = web.Application(middlewares=[self._wan_middleware], client_max_size=CLIENT_MAX_SIZE_BYTES)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/chat/completions/render", self._render_chat)
        app.router.add_post("/v1/completions/render", self._render_completion)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        # handler_cancellation: a client that hangs up cancels its handler, which aborts the
        # request in the engine and frees its KV blocks, as vLLM does.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            main_port = runner.addresses[-1][1]
            region_port_of: dict[str, int] = {}
            if region_ports:
                for region in self._topology.regions:
                    site = web.TCPSite(runner, host, self._bound_region_ports.get(region.slug, 0))
                    await site.start()
                    region_port_of[region.slug] = runner.addresses[-1][1]  # the site just started
        except BaseException:
            await runner.cleanup()
            await self.engine.stop()
            if self.publisher is not None:
                await self.publisher.stop()
            raise
        self._runner = runner
        self.host = host
        self.port = self.bound_port = main_port
        self._bound_region_ports.update(region_port_of)
        self._port_regions = {region_port: region for region, region_port in region_port_of.items()}
        self.region_urls = {
            region: f"http://{host}:{region_port}" for region, region_port in region_port_of.items()
        }

    async def stop(self) -> None:
        """Stop abruptly: requests in flight lose their connection, as when vLLM dies."""
        if self.engine is not None:
            await self.engine.stop()
        if self.publisher is not None:
            await self.publisher.stop()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def reset_network(self) -> None:
        """Draw the WAN jitter from the start of its seeded sequence again, as a new process would
        (``Fleet.reset``; a crash and restart of the node alone keeps the network as it was)."""
        self.wan = WANEmulator(self._topology, self.name, self.region, time_scale=self.time_scale)

    # ------------------------------------------------------------------ middleware

    @web.middleware
    async def _wan_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        region = request.headers.get(REGION_HEADER)
        if self._port_regions:
            # A region port stands for its region, whatever the header says.
            sockname = request.transport.get_extra_info("sockname") if request.transport else None
            if sockname is not None:
                region = self._port_regions.get(sockname[1], region)
        inbound_s, outbound_s = self.wan.one_way_delays_s(region)
        request[_OUT_DELAY_KEY] = outbound_s
        request[_CLIENT_REGION_KEY] = region or ""
        if inbound_s > 0:
            await asyncio.sleep(inbound_s)
        request[_STARTED_KEY] = asyncio.get_running_loop().time()
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            exc.headers[NODE_HEADER] = self.name
            if outbound_s > 0:
                await asyncio.sleep(outbound_s)
            raise
        if not response.prepared:
            response.headers[NODE_HEADER] = self.name
            if outbound_s > 0:
                await asyncio.sleep(outbound_s)
        return response

    # ------------------------------------------------------------------ simple routes

    async def _health(self, request: web.Request) -> web.Response:
        if self.engine is None or not self.engine.alive:
            return web.Response(status=503)
        return web.Response(status=200)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /reset_prefix_cache``: drop every cached block (AllBlocksCleared event)."""
        if self.engine is None or not self.engine.alive:
            return error_response(
                RequestError("The engine is not running.", status=503, err_type="ServiceUnavailableError")
            )
        if not self.engine.reset_prefix_cache():
            return error_response(
                RequestError(
                    "Cannot reset the prefix cache while requests are running.",
                    status=409,
                    err_type="ConflictError",
                )
            )
        return web.Response(status=200)

    @property
    def kv_events_endpoint(self) -> str | None:
        """The bound ZMQ PUB endpoint of the node's KV events (None without events)."""
        return self.publisher.endpoint if self.publisher is not None else None

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint if self.publisher is not None else None

    async def _metrics(self, request: web.Request) -> web.Response:
        assert self.metrics is not None
        body, content_type = self.metrics.render(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model,
            "object": "model",
            "created": self.started_at,
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.params.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": self.started_at,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return json_response({"object": "list", "data": [card]})

    # ------------------------------------------------------------------ tokenizer endpoints

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}``."""
        try:
            parsed = decode_request(await request.read(), TokenizeRequest)
            self._check_model(parsed.model)
            if parsed.messages is not None:
                messages = _chat_messages(ChatCompletionRequest(messages=parsed.messages))
                ids = tokenize(render_chat(messages, add_generation_prompt=parsed.add_generation_prompt))
            elif parsed.prompt is not None:
                ids = (
                    tokenize_completion_prompt(parsed.prompt)
                    if parsed.add_special_tokens
                    else tokenize(parsed.prompt)
                )
            else:
                raise RequestError("Either prompt or messages must be provided.", param="prompt")
        except RequestError as exc:
            return error_response(exc)
        return json_response(
            {"count": len(ids), "max_model_len": self.params.max_model_len, "tokens": ids, "token_strs": None}
        )

    async def _render_chat(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/chat/completions/render``: the request as token ids (a ``GenerateRequest``)."""
        try:
            parsed = decode_request(await request.read(), ChatCompletionRequest)
            self._check_model(parsed.model)
            ids = tokenize(render_chat(_chat_messages(parsed)))
            max_tokens = parsed.max_completion_tokens or parsed.max_tokens
        except RequestError as exc:
            return error_response(exc)
        return json_response(self._generate_request(ids, max_tokens, parsed.stream))

    async def _render_completion(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/completions/render``: a list of one ``GenerateRequest``."""
        try:
            parsed = decode_request(await request.read(), CompletionRequest)
            self._check_model(parsed.model)
            ids = _completion_prompt_ids(parsed)
        except RequestError as exc:
            return error_response(exc)
        return json_response([self._generate_request(ids, parsed.max_tokens, parsed.stream)])

    def _generate_request(self, ids: list[int], max_tokens: int | None, stream: bool) -> dict[str, Any]:
        return {
            "request_id": uuid.uuid4().hex,
            "token_ids": ids,
            "sampling_params": {"max_tokens": max_tokens},
            "model": self.model,
            "stream": stream,
        }

    # ------------------------------------------------------------------ generation

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        received_s = asyncio.get_running_loop().time()  # before the body is read, parsed, tokenized
        engine = self.engine
        traceparent = request.headers.get("traceparent")
        if traceparent is not None:
            trace_log.debug("%s traceparent=%s", self.name, traceparent)
        try:
            body = await request.read()
            parsed: ChatCompletionRequest | CompletionRequest
            if chat:
                parsed = decode_request(body, ChatCompletionRequest)
                self._check_model(parsed.model)
                prompt_ids = tokenize(render_chat(_chat_messages(parsed)))
                requested = parsed.max_completion_tokens or parsed.max_tokens
            else:
                parsed = decode_request(body, CompletionRequest)
                self._check_model(parsed.model)
                prompt_ids = _completion_prompt_ids(parsed)
                requested = parsed.max_tokens
            if parsed.n != 1:
                raise RequestError("The simulator supports n=1 only.", param="n")
            if parsed.cache_salt is not None and not parsed.cache_salt:
                raise RequestError(
                    "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)",
                    param="cache_salt",
                )
            max_tokens = self._check_length(len(prompt_ids), requested)
            if engine is None or not engine.alive:
                raise EngineDead
            logged_as = oracle_key(_chat_messages(parsed)) if self.oracle is not None and chat else None
            if logged_as is not None:
                assert self.oracle is not None
                self.oracle(self, prompt_ids, request[_CLIENT_REGION_KEY], logged_as)
            sim_request = engine.add_request(
                f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                prompt_ids,
                max_tokens,
                ignore_eos=parsed.ignore_eos,
                min_tokens=parsed.min_tokens,
                cache_salt=parsed.cache_salt,
            )
        except RequestError as exc:
            return error_response(exc)
        except EngineDead:
            return error_response(RequestError("The engine is dead.", status=500, err_type="EngineDeadError"))

        try:
            if parsed.stream:
                include_usage = parsed.stream_options is not None and parsed.stream_options.include_usage
                return await self._stream(request, sim_request, chat=chat, include_usage=include_usage)
            return await self._respond(request, sim_request, chat=chat)
        finally:
            if logged_as is not None and self.served is not None and sim_request.first_token_s is not None:
                self.served(self, logged_as, sim_request, received_s)
            if not sim_request.finished:
                engine.abort(sim_request)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise RequestError(
                f"The model `{model}` does not exist.", status=404, err_type="NotFoundError", param="model"
            )

    def _check_length(self, prompt_tokens: int, requested: int | None) -> int:
        """vLLM's context checks and messages; returns the effective max_tokens."""
        limit = self.params.max_model_len
        if prompt_tokens >= limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_tokens} input tokens. Please reduce the length of the input messages."
            )
        if requested is None:
            return limit - prompt_tokens
        if requested > limit:  # vLLM 0.32's message and param, as observed (docs/vllm.md)
            raise RequestError(
                f"max_tokens={requested} cannot be greater than max_model_len={limit}. Please request "
                f"fewer output tokens. (parameter=max_tokens, value={requested})",
                param="max_tokens",
            )
        if prompt_tokens + requested > limit:
            raise RequestError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's "
                f"maximum context length is {limit} tokens and your request has {prompt_tokens} input "
                f"tokens ({requested} > {limit} - {prompt_tokens})."
            )
        return requested

    async def _respond(self, request: web.Request, sim_request: SimRequest, *, chat: bool) -> web.Response:
        texts: list[str] = []
        channel = sim_request.channel
        while True:
            event = await channel.get()
            if event is ENGINE_DEAD:
                _drop_connection(request)
                return web.Response(status=500)
            texts.append(event.text)
            if event.finish_reason is not None:
                break
        usage_ = usage(
            sim_request.num_prompt_tokens,
            sim_request.num_output_tokens,
            sim_request.num_cached_tokens or 0,
            prompt_tokens_details=self.spec.enable_prompt_tokens_details,
        )
        build = chat_completion_body if chat else completion_body
        body = build(
            sim_request.request_id, int(time.time()), self.model, "".join(texts), event.finish_reason, usage_
        )
        return json_response(body)

    async def _stream(
        self, request: web.Request, sim_request: SimRequest, *, chat: bool, include_usage: bool
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        out_delay_s: float = request[_OUT_DELAY_KEY]
        renderer = ChunkRenderer(
            chat=chat, request_id=sim_request.request_id, created=int(time.time()), model=self.model
        )
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                NODE_HEADER: self.name,
            }
        )
        # The headers leave at once but reach the client one way later.
        if out_delay_s > 0:
            await asyncio.sleep(max(0.0, request[_STARTED_KEY] + out_delay_s - loop.time()))
        await response.prepare(request)

        channel = sim_request.channel
        parts: list[bytes] = [renderer.role()] if chat else []
        due_s: float | None = None  # when the first token was due at the client's end of the link
        while True:
            event = await channel.get()
            if due_s is None and event is not ENGINE_DEAD:
                due_s = event.at_s + out_delay_s
            finish_reason = None
            while True:
                if event is ENGINE_DEAD:
                    _drop_connection(request)
                    return response
                if out_delay_s > 0:
                    # Each byte reaches the client one way after the node produced it.
                    wait_s = event.at_s + out_delay_s - loop.time()
                    if wait_s > 0:
                        await asyncio.sleep(wait_s)
                parts.append(renderer.token(event.text))
                finish_reason = event.finish_reason
                if finish_reason is not None:
                    break
                # Tokens that are already due go out in the same write.
                upcoming = channel.peek()
                if upcoming is None or upcoming.at_s + out_delay_s > loop.time():
                    break
                event = channel.get_nowait()
            if finish_reason is not None:
                parts.append(renderer.finish(finish_reason))
                if include_usage:
                    parts.append(
                        renderer.usage(
                            usage(
                                sim_request.num_prompt_tokens,
                                sim_request.num_output_tokens,
                                sim_request.num_cached_tokens or 0,
                                prompt_tokens_details=self.spec.enable_prompt_tokens_details,
                            )
                        )
                    )
                parts.append(renderer.done())
                self._note_first_write(sim_request, due_s, loop)
                await response.write(b"".join(parts))
                await response.write_eof()
                return response
            self._note_first_write(sim_request, due_s, loop)
            await response.write(b"".join(parts))
            parts = []

    @staticmethod
    def _note_first_write(
        sim_request: SimRequest, due_s: float | None, loop: asyncio.AbstractEventLoop
    ) -> None:
        if sim_request.first_write_late_s is None and due_s is not None:
            sim_request.first_write_late_s = max(0.0, loop.time() - due_s)


def oracle_key(messages: list[dict[str, str]]) -> str:
    """Names a chat request without a header any router would have to pass on: the hash of its
    first user message and the number of user messages (a conversation's turn)."""
    users = [m.get("content", "") for m in messages if m.get("role") == "user"]
    return oracle_key_of(users[0] if users else "", len(users))


def oracle_key_of(first_user_text: str, user_messages: int) -> str:
    return f"{blake2b(first_user_text.encode(), digest_size=8).hexdigest()}:{user_messages}"


def _chat_messages(parsed: ChatCompletionRequest) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    for index, message in enumerate(parsed.messages):
        content = message.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            texts: list[str] = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise RequestError(
                        f"The simulator supports text content only; messages[{index}] has a "
                        f"{part.type!r} part.",
                        param="messages",
                    )
                texts.append(part.text)
            text = "\n".join(texts)
        messages.append({"role": message.role, "content": text})
    if not messages:
        raise RequestError("messages must not be empty.", param="messages")
    return messages


def _completion_prompt_ids(parsed: CompletionRequest) -> list[int]:
    prompt: Any = parsed.prompt
    if prompt is None:
        raise RequestError("Either prompt or prompt_embeds must be provided.", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenize_completion_prompt(prompt)
    if all(isinstance(token, int) and not isinstance(token, bool) for token in prompt):
        if not prompt:
            raise RequestError("The prompt cannot be empty.", param="prompt")
        for token in prompt:
            if not 0 <= token < VOCAB_SIZE:
                raise RequestError(f"Token id {token} is out of vocabulary", param="prompt")
        return list(prompt)
    raise RequestError(
        "prompt must be a string, a list of token ids, or a list of one of those "
        "(the simulator does not batch prompts).",
        param="prompt",
    )


def _drop_connection(request: web.Request) -> None:
    """Cut the client's connection without a proper ending, like a crashed server."""
    transport = request.transport
    if transport is not None:
        transport.abort()
