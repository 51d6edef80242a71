"""The algorithm interface: pure functions over an immutable view.

An algorithm gets a ``RoutingView`` (eligible candidates, their load, RTT from this gateway's
region, live state, the prefix matches the index found) and a ``RoutingRequest``, and returns a
``Decision``. It does no I/O and reads no clock: everything time- or state-dependent is in the
view, so every algorithm is testable with plain values and replayable in benchmarks.

Eligibility (model served, node active, healthy, data residency, maximum RTT) is decided before an
algorithm runs; an algorithm is never called with an empty candidate list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from routing.contract import AlgorithmParams, CostTerms, NodeLiveState, NodeSpec, algorithm_name

# The four classes built per request (the load per node, the request, the view, the decision) are
# plain classes with ``Final`` attributes, not frozen dataclasses: compiled (routing/native.py) a
# frozen dataclass still runs the ``__init__`` that ``dataclasses`` generates, assigning each field
# through ``object.__setattr__`` (~0.7 µs for four fields, ~11 % of the gateway's instructions per
# request for these four), where a compiled ``__init__`` stores them directly (~0.1 µs). ``Final``
# keeps them immutable where it is checked: mypy, and so mypyc's build of every algorithm.
# Equality, hashing and repr are the dataclasses' (fields in order).


class NodeLoad:
    """Outstanding work on a node as this gateway (plus its peers) knows it."""

    __slots__ = (
        "home_requests",
        "outstanding_context_tokens",
        "outstanding_prefill_tokens",
        "outstanding_requests",
    )

    def __init__(
        self,
        outstanding_requests: int = 0,
        # prompt tokens sent but not yet at first token (prefill still to do)
        outstanding_prefill_tokens: int = 0,
        # of outstanding_requests, those sent by gateways in the node's own region (its own
        # clients'): the arrivals a forward from another region would make wait (gorgo's displacement)
        home_requests: int = 0,
        # prompt tokens the outstanding requests computed (or will compute) there, until they
        # finish: the KV cache they hold while they decode (gorgo's queue waits when a prompt does
        # not fit)
        outstanding_context_tokens: int = 0,
    ) -> None:
        self.outstanding_requests: Final = outstanding_requests
        self.outstanding_prefill_tokens: Final = outstanding_prefill_tokens
        self.home_requests: Final = home_requests
        self.outstanding_context_tokens: Final = outstanding_context_tokens

    def _fields(self) -> tuple[int, int, int, int]:
        return (
            self.outstanding_requests,
            self.outstanding_prefill_tokens,
            self.home_requests,
            self.outstanding_context_tokens,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NodeLoad) or other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return (
            f"NodeLoad(outstanding_requests={self.outstanding_requests!r}, "
            f"outstanding_prefill_tokens={self.outstanding_prefill_tokens!r}, "
            f"home_requests={self.home_requests!r}, "
            f"outstanding_context_tokens={self.outstanding_context_tokens!r})"
        )


class RoutingRequest:
    """What an algorithm may know of the request."""

    __slots__ = ("model", "prompt_chars", "prompt_tokens_est", "session_key")

    def __init__(
        self, model: str, prompt_chars: int, prompt_tokens_est: int, session_key: str | None = None
    ) -> None:
        self.model: Final = model
        self.prompt_chars: Final = prompt_chars
        self.prompt_tokens_est: Final = prompt_tokens_est
        self.session_key: Final = session_key

    def _fields(self) -> tuple[str, int, int, str | None]:
        return (self.model, self.prompt_chars, self.prompt_tokens_est, self.session_key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingRequest) or other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return (
            f"RoutingRequest(model={self.model!r}, prompt_chars={self.prompt_chars!r}, "
            f"prompt_tokens_est={self.prompt_tokens_est!r}, session_key={self.session_key!r})"
        )


class RoutingView:
    """An immutable picture of the fleet at the moment of one decision."""

    __slots__ = (
        "candidates",
        "gateway_id",
        "live",
        "load",
        "matched_tokens",
        "ms_per_token",
        "params",
        "prefix",
        "region",
        "rtt_ms",
        "sequence",
    )

    def __init__(
        self,
        region: str,  # the gateway's region
        candidates: tuple[NodeSpec, ...],  # eligible, in stable (id) order; never empty
        params: AlgorithmParams,
        load: Mapping[int, NodeLoad] | None = None,  # node id -> load
        rtt_ms: Mapping[int, float] | None = None,  # node id -> RTT from `region`
        live: Mapping[int, NodeLiveState] | None = None,
        matched_tokens: Mapping[int, int] | None = None,  # node id -> cached prefix est.
        sequence: int = 0,  # a per-gateway request counter (round robin)
        gateway_id: str = "",  # this gateway; lets cost ties spread differently on each gateway (gorgo)
        prefix: PrefixRent | None = None,  # the prompt's prefix and its rent (gorgo's homing)
        # node id -> milliseconds per prefill token this gateway measured (routing.state.measured),
        # in place of the node's configured speed where present
        ms_per_token: Mapping[int, float] | None = None,
    ) -> None:
        self.region: Final = region
        self.candidates: Final = candidates
        self.params: Final = params
        self.load: Final[Mapping[int, NodeLoad]] = load if load is not None else {}
        self.rtt_ms: Final[Mapping[int, float]] = rtt_ms if rtt_ms is not None else {}
        self.live: Final[Mapping[int, NodeLiveState]] = live if live is not None else {}
        self.matched_tokens: Final[Mapping[int, int]] = matched_tokens if matched_tokens is not None else {}
        self.sequence: Final = sequence
        self.gateway_id: Final = gateway_id
        self.prefix: Final = prefix
        self.ms_per_token: Final = ms_per_token

    def load_of(self, node_id: int) -> NodeLoad:
        return self.load.get(node_id, _NO_LOAD)

    def with_candidates(self, candidates: tuple[NodeSpec, ...]) -> RoutingView:
        """The same view over other candidates (``dataclasses.replace`` as it was)."""
        return RoutingView(
            self.region,
            candidates,
            self.params,
            self.load,
            self.rtt_ms,
            self.live,
            self.matched_tokens,
            self.sequence,
            self.gateway_id,
            self.prefix,
            self.ms_per_token,
        )

    def _fields(self) -> tuple[object, ...]:
        return (
            self.region,
            self.candidates,
            self.params,
            self.load,
            self.rtt_ms,
            self.live,
            self.matched_tokens,
            self.sequence,
            self.gateway_id,
            self.prefix,
            self.ms_per_token,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingView) or other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())  # as the dataclass's: a TypeError while a mapping is a dict

    def __repr__(self) -> str:
        return (
            f"RoutingView(region={self.region!r}, candidates={self.candidates!r}, params={self.params!r}, "
            f"load={self.load!r}, rtt_ms={self.rtt_ms!r}, live={self.live!r}, "
            f"matched_tokens={self.matched_tokens!r}, sequence={self.sequence!r}, "
            f"gateway_id={self.gateway_id!r}, prefix={self.prefix!r}, ms_per_token={self.ms_per_token!r})"
        )


_NO_LOAD: Final = NodeLoad()


# Family keys of a prefix (``PrefixRent.keys``) start at this many chunks (4 KiB of prompt text,
# ~1k tokens).
HOMING_MIN_CHUNKS: Final = 16


class PrefixRent:
    """The prompt's prefix as the prefix index matched it, and what this gateway's region has paid
    for prefixes cached only abroad (``routing.state.homing``): what gorgo needs to bring a prompt
    family home (docs/routing.md, "Bringing a prefix home").

    ``hashes``: the prompt's chained chunk hashes (``routing.cache.approx_index.chunk_hashes``);
    ``chunk_tokens``: estimated tokens per chunk, which turns a node's matched tokens into a chunk
    count; ``owed``: the ledger's prefix key (a chunk hash) -> rent paid, in ms.
    """

    __slots__ = ("chunk_tokens", "hashes", "owed")

    def __init__(self, hashes: Sequence[int], chunk_tokens: float, owed: Mapping[int, float]) -> None:
        self.hashes: Final = hashes
        self.chunk_tokens: Final = chunk_tokens
        self.owed: Final = owed

    def keys(self, matched_tokens: int) -> tuple[int, ...]:
        """The prefix a node holding ``matched_tokens`` of the prompt holds, as rent keys: the hash of
        the last chunk it covers, and of the chunk at every power of two (from
        ``HOMING_MIN_CHUNKS``) below it. A family's requests share the shallower keys (their system
        prompt) whatever their conversations add, which each conversation's own deepest key does
        not; shorter than ``HOMING_MIN_CHUNKS`` only the deepest one (a short shared start, a chat
        template's header, is no family). Empty: less than a chunk."""
        if self.chunk_tokens <= 0:
            return ()
        # The index reported int(chunks * chunk_tokens): a token short of the chunks it matched
        # whenever a chunk is not a whole number of tokens (a learned chars/token); add it back.
        chunks = int((matched_tokens + 1) / self.chunk_tokens)
        hashes = self.hashes
        if chunks > len(hashes):
            chunks = len(hashes)
        if chunks <= 0:
            return ()
        found = [hashes[chunks - 1]]
        depth = HOMING_MIN_CHUNKS
        while depth < chunks:
            found.append(hashes[depth - 1])
            depth *= 2
        return tuple(found)

    def __repr__(self) -> str:
        return f"PrefixRent(hashes={len(self.hashes)} chunks, chunk_tokens={self.chunk_tokens!r})"


class Decision:
    """The chosen node and, where the algorithm models them, the cost terms.

    ``prediction`` (node, index mode, predicted cached tokens) is set by the gateway, only when the
    decision consulted the prefix index for this very request: the request record and the
    predicted-vs-actual metrics compare it with what the node reports.

    ``rent_keys`` (gorgo's homing, ``routing.state.homing``): the prefix this decision paid rent for
    (``rent_ms``: it went abroad for a prefix its region does not hold) or brought home
    (``homed``: it stays home to cache the prefix there), keyed at several depths
    (``PrefixRent.keys``); empty when neither.
    """

    __slots__ = ("cost", "homed", "node", "prediction", "rent_keys", "rent_ms", "runner_up")

    def __init__(
        self,
        node: NodeSpec,
        cost: CostTerms | None = None,
        runner_up: CostTerms | None = None,
        prediction: tuple[int, str, int] | None = None,
        rent_keys: tuple[int, ...] = (),
        rent_ms: float = 0.0,
        homed: bool = False,
    ) -> None:
        self.node: Final = node
        self.cost: Final = cost
        self.runner_up: Final = runner_up
        self.prediction: Final = prediction
        self.rent_keys: Final = rent_keys
        self.rent_ms: Final = rent_ms
        self.homed: Final = homed

    def _fields(self) -> tuple[object, ...]:
        return (
            self.node,
            self.cost,
            self.runner_up,
            self.prediction,
            self.rent_keys,
            self.rent_ms,
            self.homed,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Decision) or other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return (
            f"Decision(node={self.node!r}, cost={self.cost!r}, runner_up={self.runner_up!r}, "
            f"prediction={self.prediction!r}, rent_keys={self.rent_keys!r}, rent_ms={self.rent_ms!r}, "
            f"homed={self.homed!r})"
        )


AlgorithmFn = Callable[[RoutingView, RoutingRequest], Decision]


@dataclass(frozen=True, slots=True)
class AlgorithmInfo:
    """A registered algorithm: its params struct (whose tag names it), its function, its label.

    ``label`` is what operators see (the control plane's choices); ``needs_prefix_matches`` tells
    the gateway to look the prompt up in the prefix index before calling ``choose``.
    """

    params: type[msgspec.Struct]
    choose: AlgorithmFn
    needs_prefix_matches: bool = False

    @property
    def label(self) -> str:
        return str(self.params.label)  # type: ignore[attr-defined]  # every params struct declares one

    @property
    def name(self) -> str:
        return algorithm_name(self.params)
