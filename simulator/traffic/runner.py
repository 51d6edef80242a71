"""Send a ``WorkloadPlan`` to regional targets (gateways or nodes) and measure every request.

Open loop: each arrival is sent at its planned time whatever happened to earlier ones, except
that a conversation's next turn waits for the previous answer (a user reads before replying);
``sent_s`` records when it actually left. One pooled ``aiohttp`` session carries all the load.
TTFT is measured from the moment the request is sent to the first non-empty content token of a
streamed answer. Every request sends ``X-Session-Id`` (the conversation) and the OpenAI ``user``
field, and, unless disabled, ``X-Gorgo-Region: <client region>`` so that a node reached directly
emulates the WAN (a gateway in that region sends the same region anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from simulator.topology import DEFAULT_MODEL
from simulator.traffic.workloads import Arrival, WorkloadPlan

GATEWAY_NODE_HEADER = "x-gorgo-node"
SIM_NODE_HEADER = "x-gorgo-sim-node"
SESSION_HEADER = "X-Session-Id"
REGION_HEADER = "X-Gorgo-Region"
_FALLBACK_ANSWER = "(no answer)"


class RequestResult(msgspec.Struct, kw_only=True):
    """How one request of the plan went. Times in ms unless named otherwise."""

    index: int
    client_region: str
    conversation_id: str
    turn: int
    target: str
    scheduled_s: float  # planned offset from the start of the run
    sent_s: float | None = None  # actual offset when it left (later if it waited for a turn)
    status: int = 0  # HTTP status; 0 when no response arrived
    ttft_ms: float | None = None
    total_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    node: str | None = None
    stream: bool = True
    error: str | None = None
    # The run stopped reading this answer after its first token (``run_plan(until_first_tokens=
    # True)``): its TTFT is complete, its length and usage are not. Not an error.
    cut_after_first_token: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


# Typed views of the response, decoded with msgspec (faster than dicts, once per chunk).
class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Delta(msgspec.Struct):
    content: str | None = None


class _Message(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    message: _Message | None = None
    text: str | None = None


class _Body(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None


_decode_body = msgspec.json.Decoder(_Body).decode


@dataclass(slots=True)
class _ConversationState:
    history: list[dict[str, str]] = field(default_factory=list)
    last_turn_done: asyncio.Event | None = None


def normalize_target(url: str) -> str:
    """Base URL without a trailing slash or ``/v1``; requests go to ``<base>/v1/chat/completions``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def run_plan(
    plan: WorkloadPlan,
    targets: Mapping[str, str],
    *,
    model: str = DEFAULT_MODEL,
    stream: bool = True,
    region_header: bool = True,
    request_timeout_s: float = 120.0,
    drain_timeout_s: float = 30.0,
    on_result: Callable[[RequestResult], None] | None = None,
    stop: asyncio.Event | None = None,
    session: aiohttp.ClientSession | None = None,
    api_key: str | None = None,
    until_first_tokens: bool = False,
) -> list[RequestResult]:
    """Send every arrival of ``plan`` to ``targets[arrival.client_region]`` and return the results.

    ``targets`` is read at each send: changing it while the plan runs repoints a region's clients.

    Bounded in time: arrivals stop at the plan's duration (or when ``stop`` is set); requests
    still running ``drain_timeout_s`` later are cancelled and reported with an error.

    ``until_first_tokens``: once every arrival has been sent and has its first token (or has
    ended), stop reading the answers still streaming (``cut_after_first_token``, not an error)
    instead of waiting for their last token: a TTFT benchmark has nothing left to measure then.
    """
    missing = sorted({a.client_region for a in plan.arrivals} - set(targets))
    if missing:
        raise ValueError(f"no target URL for client region(s) {missing}")
    # Read at each send, so a caller may repoint a region while the plan runs (DNS failover).
    bases = targets
    results: list[RequestResult] = []

    def record(result: RequestResult) -> None:
        results.append(result)
        if on_result is not None:
            on_result(result)

    own_session = session is None
    if session is None:
        # limit=0: an open-loop generator must not queue requests behind a connection limit.
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))
    sender = _Sender(
        session=session,
        plan=plan,
        bases=bases,
        model=model,
        stream=stream,
        region_header=region_header,
        timeout=aiohttp.ClientTimeout(total=request_timeout_s),
        record=record,
        api_key=api_key,
        awaiting_first=len(plan.arrivals),
    )
    loop = asyncio.get_running_loop()
    sender.start_s = loop.time()
    tasks: set[asyncio.Task[None]] = set()
    try:
        for arrival in plan.arrivals:
            delay_s = sender.start_s + arrival.at_s - loop.time()
            if stop is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=max(0.0, delay_s))
                if stop.is_set():
                    break
            elif delay_s > 0:
                await asyncio.sleep(delay_s)
            task = loop.create_task(sender.send(arrival))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            if until_first_tokens and (stop is None or not stop.is_set()):
                pending = await _until_first_tokens(sender, set(tasks), drain_timeout_s)
            else:
                _done, pending = await asyncio.wait(set(tasks), timeout=drain_timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
    finally:
        for task in tasks:
            task.cancel()
        if own_session:
            await session.close()
    return results


async def _until_first_tokens(
    sender: _Sender, running: set[asyncio.Task[None]], timeout_s: float
) -> set[asyncio.Task[None]]:
    """Wait until every request has ended or has its first token (then mark the rest to be cut),
    or ``timeout_s``; return the requests still running."""
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + timeout_s
    first_tokens = loop.create_task(sender.all_first_tokens.wait())
    try:
        while running and not first_tokens.done():
            done, _ = await asyncio.wait(
                {*running, first_tokens},
                timeout=max(0.0, deadline_s - loop.time()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not done:
                break  # the drain timeout: what still runs is cancelled as an error
            running -= done
        if running and first_tokens.done():
            sender.cutting = True
    finally:
        first_tokens.cancel()
    return running


@dataclass(slots=True)
class _Sender:
    session: aiohttp.ClientSession
    plan: WorkloadPlan
    bases: Mapping[str, str]
    model: str
    stream: bool
    region_header: bool
    timeout: aiohttp.ClientTimeout
    record: Callable[[RequestResult], None]
    api_key: str | None = None  # a gorgo client key, sent as Authorization: Bearer
    start_s: float = 0.0
    conversations: dict[str, _ConversationState] = field(default_factory=dict)
    # Arrivals still waiting for their first token (or their end); the event fires at zero.
    awaiting_first: int = 0
    all_first_tokens: asyncio.Event = field(default_factory=asyncio.Event)
    cutting: bool = False  # set once the run stops reading answers that have their first token

    def _first_token_or_end(self, result: RequestResult, counted: list[bool]) -> None:
        if counted[0]:
            return
        counted[0] = True
        self.awaiting_first -= 1
        if self.awaiting_first <= 0:
            self.all_first_tokens.set()

    async def send(self, arrival: Arrival) -> None:
        loop = asyncio.get_running_loop()
        state = self.conversations.setdefault(arrival.conversation_id, _ConversationState())
        previous = state.last_turn_done
        done = state.last_turn_done = asyncio.Event()
        base = normalize_target(self.bases[arrival.client_region])
        result = RequestResult(
            index=arrival.index,
            client_region=arrival.client_region,
            conversation_id=arrival.conversation_id,
            turn=arrival.turn,
            target=base,
            scheduled_s=round(arrival.at_s, 4),
            stream=self.stream,
        )
        answer = _FALLBACK_ANSWER
        counted = [False]
        try:
            if previous is not None:
                await previous.wait()
            messages = self._messages(arrival, state)
            result.sent_s = round(loop.time() - self.start_s, 4)
            answer = (
                await self._post(
                    base, arrival, messages, result, lambda: self._first_token_or_end(result, counted)
                )
                or _FALLBACK_ANSWER
            )
        except asyncio.CancelledError:
            if self.cutting and result.ttft_ms is not None and result.error is None:
                result.cut_after_first_token = True
            else:
                result.error = result.error or "cancelled: the run ended before the answer did"
            self.record(result)
            raise
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            state.history.append({"role": "user", "content": arrival.user_text})
            state.history.append({"role": "assistant", "content": answer})
            done.set()
            self._first_token_or_end(result, counted)
        self.record(result)

    def _messages(self, arrival: Arrival, state: _ConversationState) -> list[dict[str, str]]:
        messages: list[dict[str, str]] = []
        if arrival.system_prompt is not None:
            messages.append({"role": "system", "content": self.plan.system_prompts[arrival.system_prompt]})
        messages.extend(state.history)
        messages.append({"role": "user", "content": arrival.user_text})
        return messages

    async def _post(
        self,
        base: str,
        arrival: Arrival,
        messages: list[dict[str, str]],
        result: RequestResult,
        on_first_token: Callable[[], None],
    ) -> str | None:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": arrival.max_tokens,
            "stream": self.stream,
            "user": arrival.user,
        }
        if arrival.min_tokens:
            body["min_tokens"] = arrival.min_tokens
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"Content-Type": "application/json", SESSION_HEADER: arrival.conversation_id}
        if self.region_header:
            headers[REGION_HEADER] = arrival.client_region
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        payload = msgspec.json.encode(body)
        sent = time.perf_counter()
        async with self.session.post(
            f"{base}/v1/chat/completions", data=payload, headers=headers, timeout=self.timeout
        ) as response:
            result.status = response.status
            result.node = response.headers.get(GATEWAY_NODE_HEADER) or response.headers.get(SIM_NODE_HEADER)
            if response.status != 200:
                text = await response.text()
                result.error = _error_message(text)
                result.total_ms = (time.perf_counter() - sent) * 1000.0
                return None
            if not self.stream:
                parsed = _decode_body(await response.read())
                result.total_ms = (time.perf_counter() - sent) * 1000.0
                _take_usage(result, parsed.usage)
                message = parsed.choices[0].message if parsed.choices else None
                return message.content if message is not None else None
            pieces: list[str] = []
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = _decode_body(data)
                if chunk.error is not None:
                    result.error = _error_message(msgspec.json.encode({"error": chunk.error}).decode())
                    break
                for choice in chunk.choices:
                    text = choice.delta.content if choice.delta is not None else choice.text
                    if text:
                        if result.ttft_ms is None:
                            result.ttft_ms = (time.perf_counter() - sent) * 1000.0
                            on_first_token()
                        pieces.append(text)
                if chunk.usage is not None:
                    _take_usage(result, chunk.usage)
            else:
                result.error = result.error or "stream ended without [DONE]"
            result.total_ms = (time.perf_counter() - sent) * 1000.0
            return "".join(pieces)


def _take_usage(result: RequestResult, usage: _Usage | None) -> None:
    if usage is None:
        return
    result.prompt_tokens = usage.prompt_tokens
    result.completion_tokens = usage.completion_tokens
    details = usage.prompt_tokens_details
    result.cached_tokens = (details.cached_tokens if details is not None else None) or 0


def _error_message(text: str) -> str:
    try:
        error = msgspec.json.decode(text)["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
    except (msgspec.DecodeError, KeyError, TypeError):
        message = text
    return str(message)[:300]
