"""The emulated vLLM engine: continuous batching with chunked prefill over a prefix-caching KV cache.

One asyncio task per node runs the step loop, modelled on vLLM V1's scheduler:

- Each step has a token budget (``max_num_batched_tokens``). Running requests are scheduled
  first: a decoding request takes one token, a request still in prefill takes the next chunk of
  its prompt. Waiting requests are then admitted in arrival order while the budget lasts and
  fewer than ``max_num_seqs`` run. On admission a request looks up its longest cached prefix
  (whole blocks, at most all tokens but the last) and only computes the rest.
- If a running request needs a KV block and none is free, the most recently admitted running
  request is preempted: its blocks are freed (cached ones stay findable) and it goes back to the
  front of the queue, to be recomputed later ("recompute" preemption, as vLLM V1 does).
- A step lasts ``decode_step_base_ms + prefill tokens / prefill_tokens_per_s + decode_per_seq_ms
  * decoding requests`` (times ``time_scale``). The loop sleeps that long, then every request
  whose scheduled tokens completed its sequence samples one token, delivered to its handler
  through the request's ``TokenChannel``.

Times are ``loop.time()`` seconds. The loop keeps its own step clock so the Python work between
steps does not slow emulated throughput, unless the process falls far behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from array import array
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from hashlib import blake2b

from simulator.kv_cache import BlockEntry, KVBlockPool, extend_block_hashes
from simulator.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Event, Publisher
from simulator.metrics import NodeMetrics
from simulator.text import answer_pieces
from simulator.tokenizer import token_id
from simulator.topology import EngineParams

logger = logging.getLogger(__name__)

# How far (s) the step clock may trail the real clock before the engine gives up catching up.
MAX_STEP_LAG_S = 0.02


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One sampled token (``finish_reason`` set on the last one), or an abort notice."""

    text: str
    at_s: float
    finish_reason: str | None = None


# Pushed instead of a token when the engine dies (a crash emulated by ``Engine.stop``).
ENGINE_DEAD = TokenEvent(text="", at_s=0.0, finish_reason="engine_dead")


class TokenChannel:
    """A single-consumer queue of token events: a deque plus one waiter future.

    Cheaper than ``asyncio.Queue`` and lets the consumer take everything that is ready at once.
    """

    __slots__ = ("_events", "_waiter")

    def __init__(self) -> None:
        self._events: deque[TokenEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def push(self, event: TokenEvent) -> None:
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> TokenEvent:
        while not self._events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._events.popleft()

    def peek(self) -> TokenEvent | None:
        return self._events[0] if self._events else None

    def get_nowait(self) -> TokenEvent:
        return self._events.popleft()


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request inside the engine."""

    request_id: str
    token_ids: list[int]  # prompt, then every sampled token
    num_prompt_tokens: int
    max_tokens: int
    stop_after_tokens: int  # where the answer ends: max_tokens, or earlier at its natural end
    arrival_s: float
    pieces: Iterator[str]
    channel: TokenChannel = field(default_factory=TokenChannel)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    blocks: list[BlockEntry] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks so far
    cache_salt: str | None = None  # vLLM's cache_salt: part of the first block's hash
    num_published_blocks: int = 0  # leading blocks already registered in the cache
    num_cached_tokens: int | None = None  # prefix hit at first admission (usage.cached_tokens)
    num_output_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    # How late its node's process wrote the first token out, past when it was due (the emulator's
    # own event-loop lag on a busy machine: a harness cost; the streaming path sets it)
    first_write_late_s: float | None = None
    last_token_s: float | None = None
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(slots=True)
class _Scheduled:
    request: SimRequest
    num_new_tokens: int
    is_decode: bool


class EngineDead(RuntimeError):
    """The engine was stopped (the node crashed or shut down)."""


class Engine:
    """One node's scheduler, KV cache and step loop."""

    def __init__(
        self,
        params: EngineParams,
        metrics: NodeMetrics,
        *,
        time_scale: float = 1.0,
        publisher: Publisher | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.params = params
        self.metrics = metrics
        self.time_scale = time_scale
        self.pool = KVBlockPool(params.kv_capacity_blocks, params.block_size)
        # The parent of every first block, random per engine start like vLLM's NONE_HASH: block
        # hashes mean nothing outside this engine, so routers key blocks by their token ids.
        self.hash_root = int.from_bytes(os.urandom(8), "little")
        self.publisher = publisher
        self._kv_events: list[Event] = []
        if publisher is not None:
            self.pool.evicted = []
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.steps = 0
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.num_preemptions = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._dead = False
        metrics.bind_gauges(
            running=lambda: len(self.running),
            waiting=lambda: len(self.waiting),
            kv_usage=lambda: self.pool.usage,
        )

    # ------------------------------------------------------------------ lifecycle

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._dead

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="simulator-engine")

    async def stop(self) -> None:
        """Stop stepping and fail every request in flight (what a crashed vLLM does to its clients)."""
        self._dead = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for request in [*self.running, *self.waiting]:
            request.status = RequestStatus.FINISHED
            request.finish_reason = "engine_dead"
            request.channel.push(ENGINE_DEAD)
        self.running.clear()
        self.waiting.clear()

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        cache_salt: str | None = None,
    ) -> SimRequest:
        """Queue a request; its tokens arrive on ``request.channel``. The caller validated lengths."""
        if self._dead:
            raise EngineDead("the engine is not running")
        digest = int.from_bytes(
            blake2b(array("I", prompt_token_ids).tobytes(), digest_size=8).digest(), "little"
        )
        params = self.params
        natural = params.natural_output_min_tokens + digest % (
            params.natural_output_max_tokens - params.natural_output_min_tokens + 1
        )
        stop_after = max_tokens if ignore_eos else min(max_tokens, max(natural, min_tokens))
        request = SimRequest(
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            max_tokens=max_tokens,
            stop_after_tokens=max(1, stop_after),
            arrival_s=asyncio.get_running_loop().time(),
            pieces=answer_pieces(digest),
            cache_salt=cache_salt or None,
        )
        self.metrics.request_params_max_tokens.observe(max_tokens)
        self.waiting.append(request)
        self._wakeup.set()
        return request

    def abort(self, request: SimRequest) -> None:
        """Drop a request whose client went away; frees its KV blocks at once."""
        if request.finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        self._finish(request, "abort", asyncio.get_running_loop().time())

    # ------------------------------------------------------------------ the step loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        step_start = loop.time()
        try:
            while True:
                if not self.running and not self.waiting:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    step_start = loop.time()
                batch = self._schedule()
                if not batch:
                    # Nothing fits (only possible while blocks are held by finished-but-unfreed
                    # work, which cannot happen); wait for the next arrival instead of spinning.
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    step_start = loop.time()
                    continue
                step_end = step_start + self._step_duration_s(batch)
                # Always yield, even for a zero-length step, so handlers can run.
                await asyncio.sleep(max(0.0, step_end - loop.time()))
                now = loop.time()
                self._complete_step(batch, now)
                self._publish_kv_events()
                self.steps += 1
                step_start = step_end if now - step_end < MAX_STEP_LAG_S else now
        except asyncio.CancelledError:
            raise
        except Exception:  # pragma: no cover - a bug; fail loudly and stop serving like a dead engine
            logger.exception("simulated engine crashed")
            self._dead = True
            for request in [*self.running, *self.waiting]:
                request.status = RequestStatus.FINISHED
                request.channel.push(ENGINE_DEAD)
            self.running.clear()
            self.waiting.clear()

    def _step_duration_s(self, batch: list[_Scheduled]) -> float:
        params = self.params
        prefill_tokens = 0
        decoding = 0
        for item in batch:
            if item.is_decode:
                decoding += 1
            else:
                prefill_tokens += item.num_new_tokens
        duration_ms = (
            params.decode_step_base_ms
            + prefill_tokens * 1000.0 / params.prefill_tokens_per_s
            + decoding * params.decode_per_seq_ms
        )
        return duration_ms * self.time_scale / 1000.0

    def _schedule(self) -> list[_Scheduled]:
        params = self.params
        budget = params.max_num_batched_tokens
        batch: list[_Scheduled] = []
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(len(request.token_ids) - request.num_computed_tokens, budget)
            while not self._allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break  # it preempted itself: it was the last running request
            is_decode = (
                num_new == 1
                and request.num_output_tokens > 0
                and (request.num_computed_tokens == len(request.token_ids) - 1)
            )
            batch.append(_Scheduled(request, num_new, is_decode))
            self._publish_full_blocks(request, num_new)
            budget -= num_new
            index += 1

        # vLLM admits nothing new in a step that had to preempt.
        if not preempted:
            loop_time = None
            while self.waiting and budget > 0 and len(self.running) < params.max_num_seqs:
                request = self.waiting[0]
                if not self._admit(request, budget):
                    break
                self.waiting.popleft()
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                if request.first_scheduled_s is None:
                    if loop_time is None:
                        loop_time = asyncio.get_running_loop().time()
                    request.first_scheduled_s = loop_time
                num_new = min(len(request.token_ids) - request.num_computed_tokens, budget)
                batch.append(_Scheduled(request, num_new, is_decode=False))
                self._publish_full_blocks(request, num_new)
                budget -= num_new
        return batch

    def _admit(self, request: SimRequest, budget: int) -> bool:
        """Look up the request's cached prefix and allocate blocks for its first chunk."""
        params = self.params
        block_size = params.block_size
        num_tokens = len(request.token_ids)
        # At least the last token is always computed, so at most num_tokens - 1 can be hits.
        max_hit_blocks = (num_tokens - 1) // block_size
        extend_block_hashes(
            request.block_hashes, request.token_ids, block_size, max_hit_blocks, self._hash_root(request)
        )
        matched_blocks = self.pool.match_prefix(request.block_hashes, max_hit_blocks)
        matched = request.block_hashes[:matched_blocks]
        hit_tokens = matched_blocks * block_size
        num_new = min(num_tokens - hit_tokens, budget)
        needed = math.ceil((hit_tokens + num_new) / block_size) - matched_blocks
        if not self.pool.can_allocate(needed, matched):
            return False
        request.blocks = self.pool.acquire_cached(matched)
        fresh = self.pool.allocate(needed)
        assert fresh is not None  # can_allocate said so
        request.blocks.extend(fresh)
        request.num_computed_tokens = hit_tokens
        request.num_published_blocks = matched_blocks
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit_tokens
        if request.num_preemptions == 0:
            # As vLLM: a preempted request's second lookup is kept apart (PrefixCacheStats'
            # preempted_queries/_hits), not in the exported counters, so a hit on its own blocks
            # does not pass for prefix reuse.
            self.prefix_queries_tokens += num_tokens
            self.prefix_hits_tokens += hit_tokens
            self.metrics.prefix_cache_queries.inc(num_tokens)
            self.metrics.prefix_cache_hits.inc(hit_tokens)
        return True

    def _allocate_slots(self, request: SimRequest, num_new: int) -> bool:
        needed = math.ceil((request.num_computed_tokens + num_new) / self.params.block_size) - len(
            request.blocks
        )
        if needed <= 0:
            return True
        fresh = self.pool.allocate(needed)
        if fresh is None:
            return False
        request.blocks.extend(fresh)
        return True

    def _preempt(self, request: SimRequest) -> None:
        self.pool.release(request.blocks)
        request.blocks = []
        request.num_computed_tokens = 0
        request.num_published_blocks = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        self.metrics.num_preemptions.inc()

    def _publish_full_blocks(self, request: SimRequest, num_new: int) -> None:
        """Cache the blocks this step's ``num_new`` tokens will fill, when the step is scheduled, as
        vLLM's ``allocate_slots`` does (``cache_blocks`` up to the computed plus the new tokens): a
        request scheduled after it in the same step hits them (its attention reads what the batch
        writes in the same layer). The emulator cached them when the step ended, so two requests
        arriving in one step both computed a prefix that vLLM lets the second one hit."""
        block_size = self.params.block_size
        num_full = min(request.num_computed_tokens + num_new, len(request.token_ids)) // block_size
        if num_full <= request.num_published_blocks:
            return
        extend_block_hashes(
            request.block_hashes, request.token_ids, block_size, num_full, self._hash_root(request)
        )
        run_start = -1  # first block of the current run of newly cached blocks (one BlockStored each)
        for index in range(request.num_published_blocks, num_full):
            published = False
            if request.blocks[index] is None:
                # Cached even when another request computed the same block meanwhile: vLLM keeps
                # both copies (no de-duplication) and announces each.
                request.blocks[index] = self.pool.publish(request.block_hashes[index])
                published = True
            if published and run_start < 0:
                run_start = index
            elif not published and run_start >= 0:
                self._note_stored(request, run_start, index)
                run_start = -1
        if run_start >= 0:
            self._note_stored(request, run_start, num_full)
        request.num_published_blocks = num_full

    def _hash_root(self, request: SimRequest) -> int:
        """The parent of the request's first block: the engine's root, salted as vLLM salts the
        first block's hash with ``cache_salt`` (so every later block differs too)."""
        if request.cache_salt is None:
            return self.hash_root
        payload = self.hash_root.to_bytes(8, "little") + request.cache_salt.encode("utf-8")
        return int.from_bytes(blake2b(payload, digest_size=8).digest(), "little")

    def _note_stored(self, request: SimRequest, start: int, end: int) -> None:
        """Record a BlockStored for blocks [start, end) of a request (when events are published)."""
        if self.publisher is None:
            return
        block_size = self.params.block_size
        self._kv_events.append(
            BlockStored(
                block_hashes=tuple(request.block_hashes[start:end]),
                parent_block_hash=request.block_hashes[start - 1] if start > 0 else None,
                token_ids=tuple(request.token_ids[start * block_size : end * block_size]),
                block_size=block_size,
                # vLLM: one entry per block, the salt on the first block only (it is hashed there).
                extra_keys=tuple(
                    (request.cache_salt,) if index == 0 and request.cache_salt is not None else None
                    for index in range(start, end)
                ),
            )
        )

    def _publish_kv_events(self) -> None:
        """One batch per engine step, as vLLM: evictions made while scheduling, then new blocks."""
        publisher = self.publisher
        if publisher is None:
            return
        events: list[Event] = []
        evicted = self.pool.evicted
        if evicted:
            events.append(BlockRemoved(tuple(evicted)))
            evicted.clear()
        if self._kv_events:
            events.extend(self._kv_events)
            self._kv_events.clear()
        if events:
            publisher.publish(events)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``/reset_prefix_cache``); False while requests run."""
        if not self.pool.reset():
            return False
        if self.publisher is not None:
            self._publish_kv_events()
            self.publisher.publish([AllBlocksCleared()])
        return True

    def _complete_step(self, batch: list[_Scheduled], now: float) -> None:
        metrics = self.metrics
        iteration_tokens = 0
        generated = 0
        prompt_tokens = 0
        for item in batch:
            request = item.request
            if request.finished:  # aborted while the step ran
                continue
            iteration_tokens += item.num_new_tokens
            request.num_computed_tokens += item.num_new_tokens
            if request.num_computed_tokens < len(request.token_ids):
                continue  # a prefill chunk; the prompt is not done yet
            text = next(request.pieces)
            request.token_ids.append(token_id(text))
            request.num_output_tokens += 1
            generated += 1
            if request.first_token_s is None:
                request.first_token_s = now
                prompt_tokens += request.num_prompt_tokens
                metrics.time_to_first_token.observe(now - request.arrival_s)
            elif request.last_token_s is not None:
                metrics.inter_token_latency.observe(now - request.last_token_s)
            request.last_token_s = now
            if request.num_output_tokens >= request.stop_after_tokens:
                reason = "length" if request.num_output_tokens >= request.max_tokens else "stop"
                request.channel.push(TokenEvent(text, now, reason))
                self.running.remove(request)
                self._finish(request, reason, now)
            else:
                request.channel.push(TokenEvent(text, now))
        if prompt_tokens:
            metrics.prompt_tokens.inc(prompt_tokens)
        if generated:
            metrics.generation_tokens.inc(generated)
        metrics.iteration_tokens.observe(iteration_tokens)

    def _finish(self, request: SimRequest, reason: str, now: float) -> None:
        """Free the request's blocks and record its metrics (the caller already told its handler)."""
        self.pool.release(request.blocks)
        request.blocks = []
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        metrics = self.metrics
        metrics.request_success[reason].inc()
        metrics.e2e_request_latency.observe(now - request.arrival_s)
        metrics.request_prompt_tokens.observe(request.num_prompt_tokens)
        metrics.request_generation_tokens.observe(request.num_output_tokens)
        if request.first_scheduled_s is not None:
            metrics.request_queue_time.observe(request.first_scheduled_s - request.arrival_s)
            first_token_s = request.first_token_s if request.first_token_s is not None else now
            last_token_s = request.last_token_s if request.last_token_s is not None else now
            metrics.request_prefill_time.observe(first_token_s - request.first_scheduled_s)
            metrics.request_decode_time.observe(last_token_s - first_token_s)
            metrics.request_inference_time.observe(last_token_s - request.first_scheduled_s)
