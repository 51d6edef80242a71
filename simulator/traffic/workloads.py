"""Seeded, open-loop workloads: the same seed gives the same arrivals, so every policy sees them.

A ``WorkloadPlan`` is a list of ``Arrival``s (Poisson arrivals at ``rate_rps``, bounded by
``duration_s`` and ``max_requests``) plus the shared system prompts. Workloads:

- ``geo-chat``: multi-turn conversations over six long system prompts (2k-8k tokens). Each client
  region prefers two of them (80 % of its new conversations), so a region's traffic shares
  prefixes mostly with itself; conversations grow turn by turn (1-6 turns, >= 2 s apart).
- ``no-share``: single requests with unique 1k-3k-token prompts (nothing to reuse).
- ``hot-prefix``: one 4k-token system prompt shared by 95 % of single-turn requests.
- ``diurnal``: unique 1k-3k-token prompts (as ``no-share``) whose peak moves from region to
  region: the run is cut into one phase per region, and in phase *k* region *k* sends
  ``DIURNAL_PEAK_SHARE`` of the requests while the others share the rest (sized by the caller so
  the peak region runs at 2-3x its capacity while the others idle).
- ``mixed-length``: single requests whose unique prompts run from 100 to 8k tokens (log-uniform,
  so most are short and a few are long: chat next to document questions) with long answers
  (``MIXED_OUTPUT_TOKENS``, forced with vLLM's ``min_tokens``): long prefills queue short ones, and
  long decodes keep the KV cache and the batch full.
- ``region-outage``: ``geo-chat`` traffic, with ``WorkloadPlan.outages``: the first region's nodes
  die at ``OUTAGE_START_SHARE`` of the run and come back at ``OUTAGE_END_SHARE``; whoever runs the
  plan applies them (the benchmark through the simulator's fault API).

Client regions are drawn evenly unless ``client_shares`` weighs them (region -> share; the shares
are normalised, regions left out send nothing).

Prompts are sized with the simulator's tokenizer (``simulator.text`` pieces are one token each).
The assistant turns of a conversation are not in the plan: the runner sends the answers it got.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from simulator.text import text_of_tokens
from simulator.tokenizer import count_tokens

Workload = Literal["geo-chat", "no-share", "hot-prefix", "diurnal", "region-outage", "mixed-length"]
WORKLOADS: tuple[Workload, ...] = (
    "geo-chat",
    "no-share",
    "hot-prefix",
    "diurnal",
    "region-outage",
    "mixed-length",
)

GEO_CHAT_SYSTEM_PROMPT_TOKENS = (2048, 3072, 4096, 5120, 6144, 8000)
GEO_CHAT_PREFERRED_SHARE = 0.8
GEO_CHAT_CONTINUE_PROBABILITY = 0.65
GEO_CHAT_MAX_TURNS = 6
GEO_CHAT_THINK_MIN_S = 2.0
GEO_CHAT_IDLE_CLOSE_S = 300.0  # a conversation silent this long is over
HOT_PREFIX_SYSTEM_PROMPT_TOKENS = 4096
HOT_PREFIX_SHARE = 0.95
DIURNAL_PEAK_SHARE = 0.8
OUTAGE_START_SHARE = 0.3
OUTAGE_END_SHARE = 0.6
MIXED_PROMPT_TOKENS = (100, 8000)  # log-uniform between these
MIXED_OUTPUT_TOKENS = (256, 1024)  # uniform; each answer is exactly this long (min_tokens)
_TOPICS = (
    "travel booking",
    "cloud billing",
    "retail returns",
    "medical scheduling",
    "insurance claims",
    "software licensing",
    "bank cards",
    "airline loyalty",
)


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the plan. ``at_s`` is its offset from the start of the run."""

    index: int
    at_s: float
    client_region: str
    conversation_id: str
    turn: int  # 0 for the first message of a conversation
    user: str
    user_text: str
    system_prompt: int | None  # index into WorkloadPlan.system_prompts
    max_tokens: int
    min_tokens: int = 0  # vLLM's min_tokens (0: not sent): the answer is at least this long


@dataclass(frozen=True, slots=True)
class Outage:
    """Every node of ``region`` is down from ``start_s`` to ``end_s`` (offsets from the start)."""

    region: str
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class WorkloadPlan:
    """A complete, deterministic workload."""

    workload: Workload
    seed: int
    rate_rps: float
    duration_s: float
    regions: tuple[str, ...]
    system_prompts: tuple[str, ...]
    arrivals: tuple[Arrival, ...]
    outages: tuple[Outage, ...] = ()


class _RegionPicker:
    """Draws client regions: evenly, by fixed shares, or (diurnal) by phase."""

    def __init__(
        self, regions: tuple[str, ...], shares: dict[str, float] | None, phases_until_s: float | None
    ) -> None:
        self.regions = regions
        self.weights = [shares.get(r, 0.0) for r in regions] if shares else None
        self.phase_s = phases_until_s / len(regions) if phases_until_s else None

    def pick(self, rng: random.Random, at_s: float) -> int:
        count = len(self.regions)
        if self.phase_s is not None:
            peak = min(count - 1, int(at_s / self.phase_s))
            if count == 1 or rng.random() < DIURNAL_PEAK_SHARE:
                return peak
            return (peak + 1 + rng.randrange(count - 1)) % count
        if self.weights is None:
            return rng.randrange(count)
        return rng.choices(range(count), weights=self.weights)[0]


def check_client_shares(regions: tuple[str, ...], shares: dict[str, float]) -> dict[str, float]:
    """Normalised shares; a ``ValueError`` naming the problem otherwise."""
    unknown = sorted(set(shares) - set(regions))
    if unknown:
        raise ValueError(f"client shares for unknown region(s) {unknown}; regions: {', '.join(regions)}")
    if any(value < 0 for value in shares.values()) or sum(shares.values()) <= 0:
        raise ValueError("client shares must be non-negative and add up to more than 0")
    total = sum(shares.values())
    return {region: shares.get(region, 0.0) / total for region in regions}


@dataclass(slots=True)
class _Conversation:
    conversation_id: str
    user: str
    system_prompt: int | None
    turns_total: int
    turns_sent: int
    last_at_s: float


def build_plan(
    workload: Workload,
    regions: list[str] | tuple[str, ...],
    *,
    rate_rps: float,
    duration_s: float,
    max_requests: int,
    seed: int,
    max_tokens: int = 128,
    client_shares: dict[str, float] | None = None,
) -> WorkloadPlan:
    """Poisson arrivals at ``rate_rps`` from clients spread over ``regions`` (evenly by default)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    if not regions:
        raise ValueError("at least one client region is needed")
    if rate_rps <= 0 or duration_s <= 0 or max_requests < 0 or max_tokens < 1:
        raise ValueError("rate, duration and max_tokens must be positive, max_requests non-negative")
    regions = tuple(regions)
    shares = check_client_shares(regions, client_shares) if client_shares else None
    rng = random.Random(f"arrivals:{workload}:{seed}")
    times: list[float] = []
    at_s = rng.expovariate(rate_rps)
    while at_s < duration_s and len(times) < max_requests:
        times.append(at_s)
        at_s += rng.expovariate(rate_rps)

    # diurnal: the phases span the arrivals actually planned (a count may end the plan early)
    span_s = (times[-1] + 1e-9) if times else duration_s
    picker = _RegionPicker(regions, shares, span_s if workload == "diurnal" else None)
    outages: tuple[Outage, ...] = ()
    if workload in ("geo-chat", "region-outage"):
        system_prompts = tuple(
            _system_prompt(i, tokens, seed) for i, tokens in enumerate(GEO_CHAT_SYSTEM_PROMPT_TOKENS)
        )
        arrivals = _geo_chat(times, regions, rng, len(system_prompts), max_tokens, picker)
        if workload == "region-outage":
            outages = (Outage(regions[0], span_s * OUTAGE_START_SHARE, span_s * OUTAGE_END_SHARE),)
    elif workload == "mixed-length":
        system_prompts = ()
        arrivals = _mixed_length(times, regions, rng, picker)
    elif workload == "hot-prefix":
        system_prompts = (_system_prompt(0, HOT_PREFIX_SYSTEM_PROMPT_TOKENS, seed),)
        arrivals = _single_turn(times, regions, rng, max_tokens, picker, hot=True)
    else:
        system_prompts = ()
        arrivals = _single_turn(times, regions, rng, max_tokens, picker, hot=False)
    return WorkloadPlan(
        workload=workload,
        seed=seed,
        rate_rps=rate_rps,
        duration_s=duration_s,
        regions=regions,
        system_prompts=system_prompts,
        arrivals=tuple(arrivals),
        outages=outages,
    )


def _system_prompt(index: int, num_tokens: int, seed: int) -> str:
    """A long system prompt of ``num_tokens`` tokens (within a few), the same for a seed."""
    rng = random.Random(f"system:{seed}:{index}")
    header = (
        f"You are support assistant number {index} for {_TOPICS[index % len(_TOPICS)]}. "
        "Follow the policy manual below exactly and answer briefly.\n\n"
    )
    return header + text_of_tokens(rng, max(1, num_tokens - count_tokens(header)))


def _geo_chat(
    times: list[float],
    regions: tuple[str, ...],
    rng: random.Random,
    num_prompts: int,
    max_tokens: int,
    picker: _RegionPicker,
) -> list[Arrival]:
    open_conversations: dict[str, list[_Conversation]] = {region: [] for region in regions}
    arrivals: list[Arrival] = []
    started = 0
    for index, at_s in enumerate(times):
        region_index = picker.pick(rng, at_s)
        region = regions[region_index]
        pool = open_conversations[region]
        pool[:] = [c for c in pool if at_s - c.last_at_s < GEO_CHAT_IDLE_CLOSE_S]
        ready = [c for c in pool if at_s - c.last_at_s >= GEO_CHAT_THINK_MIN_S]
        if ready and rng.random() < GEO_CHAT_CONTINUE_PROBABILITY:
            conversation = ready[rng.randrange(len(ready))]
        else:
            if rng.random() < GEO_CHAT_PREFERRED_SHARE:
                # Region i prefers prompts 2i and 2i+1 (mod the number of prompts).
                system_prompt = (2 * region_index + rng.randrange(2)) % num_prompts
            else:
                system_prompt = rng.randrange(num_prompts)
            conversation = _Conversation(
                conversation_id=f"{region}-c{started}",
                user=f"{region}-user{rng.randrange(1000)}",
                system_prompt=system_prompt,
                turns_total=rng.randint(1, GEO_CHAT_MAX_TURNS),
                turns_sent=0,
                last_at_s=at_s,
            )
            started += 1
            pool.append(conversation)
        arrivals.append(
            Arrival(
                index=index,
                at_s=at_s,
                client_region=region,
                conversation_id=conversation.conversation_id,
                turn=conversation.turns_sent,
                user=conversation.user,
                user_text=text_of_tokens(rng, rng.randint(20, 200)),
                system_prompt=conversation.system_prompt,
                max_tokens=max_tokens,
            )
        )
        conversation.turns_sent += 1
        conversation.last_at_s = at_s
        if conversation.turns_sent >= conversation.turns_total:
            pool.remove(conversation)
    return arrivals


def _single_turn(
    times: list[float],
    regions: tuple[str, ...],
    rng: random.Random,
    max_tokens: int,
    picker: _RegionPicker,
    *,
    hot: bool,
) -> list[Arrival]:
    arrivals: list[Arrival] = []
    for index, at_s in enumerate(times):
        region = regions[picker.pick(rng, at_s)]
        if hot:
            shared = rng.random() < HOT_PREFIX_SHARE
            # The index up front makes even the first KV block of an unshared prompt unique.
            text = f"Question {index}: " + text_of_tokens(rng, rng.randint(30, 200))
            system_prompt = 0 if shared else None
        else:
            text = f"Request {index}: " + text_of_tokens(rng, rng.randint(1000, 3000))
            system_prompt = None
        arrivals.append(
            Arrival(
                index=index,
                at_s=at_s,
                client_region=region,
                conversation_id=f"{region}-r{index}",
                turn=0,
                user=f"{region}-user{rng.randrange(1000)}",
                user_text=text,
                system_prompt=system_prompt,
                max_tokens=max_tokens,
            )
        )
    return arrivals


def _mixed_length(
    times: list[float], regions: tuple[str, ...], rng: random.Random, picker: _RegionPicker
) -> list[Arrival]:
    low, high = MIXED_PROMPT_TOKENS
    arrivals: list[Arrival] = []
    for index, at_s in enumerate(times):
        region = regions[picker.pick(rng, at_s)]
        prompt_tokens = round(low * (high / low) ** rng.random())
        output_tokens = rng.randint(*MIXED_OUTPUT_TOKENS)
        # The index up front makes even the first KV block unique: lengths, not reuse, are the point.
        text = f"Request {index}: " + text_of_tokens(rng, prompt_tokens)
        arrivals.append(
            Arrival(
                index=index,
                at_s=at_s,
                client_region=region,
                conversation_id=f"{region}-m{index}",
                turn=0,
                user=f"{region}-user{rng.randrange(1000)}",
                user_text=text,
                system_prompt=None,
                max_tokens=output_tokens,
                min_tokens=output_tokens,
            )
        )
    return arrivals
