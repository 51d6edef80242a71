"""The contract between the control plane and the gateways.

Everything the two sides share lives here: Redis key and channel names, and the typed wire structs
(msgspec) for the compiled policy snapshot, the live node state, the RTT table and the per-request
record. The control plane imports this module to write; the gateway imports it to read. It must
never import Django.

Every top-level struct carries ``schema_version``. A reader that meets a version it does not know
refuses the document (``UnknownSchemaVersion``) and keeps what it had, so a rolling upgrade never
serves a half-understood policy.

All wire documents are JSON (msgspec), so an operator can read them with ``redis-cli``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args, get_type_hints

import msgspec

SCHEMA_VERSION = 1

NodeState = Literal["active", "draining", "disabled"]


T = TypeVar("T", bound=msgspec.Struct)


class UnknownSchemaVersion(ValueError):
    """A document was written by a newer (or older) schema than this reader understands."""


# --------------------------------------------------------------------------------------------
# Redis names
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Names of every Redis key, stream and channel gorgo uses, under one prefix.

    The prefix lets several fleets (staging, production) share one Redis, and lets concurrent test
    runs stay out of each other's way.
    """

    prefix: str = "gorgo"

    @property
    def policy_current(self) -> str:
        """STRING: the live ``PolicySnapshot`` (JSON)."""
        return f"{self.prefix}:policy:current"

    @property
    def policy_channel(self) -> str:
        """PUB/SUB: a ``PolicyAnnouncement`` each time a new snapshot goes live."""
        return f"{self.prefix}:policy:announce"

    @property
    def live_nodes(self) -> str:
        """HASH: node id -> ``NodeLiveState`` (JSON), written by telemetry workers."""
        return f"{self.prefix}:live:nodes"

    @property
    def live_rtt(self) -> str:
        """STRING: the ``RTTTable`` (JSON), written by the RTT probe aggregation."""
        return f"{self.prefix}:live:rtt"

    @property
    def live_channel(self) -> str:
        """PUB/SUB: notified (payload: the key that changed) after live state is written."""
        return f"{self.prefix}:live:announce"

    @property
    def request_stream(self) -> str:
        """STREAM: one ``RequestRecord`` per finished request (field ``r``), capped."""
        return f"{self.prefix}:requests"

    @property
    def request_group(self) -> str:
        """Consumer group name on the request stream used by the aggregation workers."""
        return f"{self.prefix}-aggregators"

    @property
    def gateway_load(self) -> str:
        """HASH: gateway id -> ``GatewayLoad`` (JSON), each gateway's outstanding work per node."""
        return f"{self.prefix}:gateway:load"

    @property
    def prefix_stream(self) -> str:
        """STREAM: ``PrefixUpdate`` batches (field ``u``) so gateways share their prefix indexes."""
        return f"{self.prefix}:prefix:updates"

    @property
    def fleet_changes(self) -> str:
        """LIST: fleet changes waiting for the next coalesced republish (control plane only)."""
        return f"{self.prefix}:policy:fleet-changes"

    def probe_consumer(self, region: str) -> str:
        """STRING (expiring): a worker consumes ``probe.<region>`` (value: its hostname)."""
        return f"{self.prefix}:probe-consumer:{region}"

    def auth_failures(self, client: str) -> str:
        """STRING (counter, expiring): failed sign-ins and API tokens from one client address."""
        return f"{self.prefix}:auth-failures:{client}"

    @property
    def kv_state(self) -> str:
        """HASH: gateway id -> ``GatewayKVState`` (JSON): each node's prefix-index mode and event lag."""
        return f"{self.prefix}:kv:state"

    @property
    def key_set(self) -> str:
        """STRING: the ``ClientKeySet`` (JSON): every client key's hash, limits and state."""
        return f"{self.prefix}:keys:current"

    @property
    def key_channel(self) -> str:
        """PUB/SUB: a ``KeySetAnnouncement`` each time a new key set is written."""
        return f"{self.prefix}:keys:announce"

    @property
    def key_last_used(self) -> str:
        """HASH: key id -> unix seconds it was last used, written by gateways (coarsely)."""
        return f"{self.prefix}:keys:last-used"

    def rate_limit(self, key_id: str) -> str:
        """HASH: a client key's shared token buckets (requests and tokens), kept by gateways."""
        return f"{self.prefix}:ratelimit:{key_id}"

    def concurrency(self, key_id: str) -> str:
        """HASH: gateway id -> ``slots:expires_ms``, the slots of a client key's ``max_concurrent``
        each gateway leases (a new name: the old per-request ``count:ms`` hash was
        ``<prefix>:concurrency:<key id>``, and its script deleted fields it could not parse)."""
        return f"{self.prefix}:concurrency-lease:{key_id}"

    @property
    def limits_epoch(self) -> str:
        """STRING (no expiry): ``<token>:<ms>``, written by the first lease call that finds it missing;
        ``<ms>`` (Redis's clock) ends a recovery window when the gateway that wrote it had seen an
        earlier epoch (Redis lost the leases: restarted empty, flushed, failed over), else 0."""
        return f"{self.prefix}:limits:epoch"

    def lock(self, name: str) -> str:
        """STRING: a short-lived mutual-exclusion lock for a periodic task."""
        return f"{self.prefix}:lock:{name}"


REQUEST_STREAM_FIELD = "r"
PREFIX_STREAM_FIELD = "u"
# The writer's gateway id, beside the update: a reader skips its own entries without decoding them.
PREFIX_STREAM_GATEWAY_FIELD = "g"

# --------------------------------------------------------------------------------------------
# Policy snapshot (control plane -> gateway)
# --------------------------------------------------------------------------------------------


class RoundRobinParams(msgspec.Struct, frozen=True, tag="round_robin", forbid_unknown_fields=True):
    """Rotate over eligible nodes in a stable order."""

    label: ClassVar[str] = "Round robin"  # what operators see


class LeastLoadParams(msgspec.Struct, frozen=True, tag="least_load", forbid_unknown_fields=True):
    """Pick the node with the fewest outstanding requests (ties: fewer outstanding tokens)."""

    label: ClassVar[str] = "Least load"  # what operators see


class SessionAffinityParams(msgspec.Struct, frozen=True, tag="session_affinity", forbid_unknown_fields=True):
    """Consistent hashing on a session key (header, else the OpenAI ``user`` field)."""

    label: ClassVar[str] = "Session affinity"  # what operators see

    session_header: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=100,
            pattern=r"^[A-Za-z0-9-]+$",
            extra={"invalid": "Use letters, digits and hyphens only."},
        ),
    ] = "x-session-id"
    virtual_nodes: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 160


class PrefixAffinityParams(msgspec.Struct, frozen=True, tag="prefix_affinity", forbid_unknown_fields=True):
    """SGLang-router-style cache-aware routing. Defaults are SGLang's.

    ``scope``: ``global`` routes over every eligible node; ``local`` over the gateway's own
    region's nodes only, abroad only when none of them is eligible (the regional deployment
    operators run today: geo-DNS to the nearest region, a cache-aware router per region).
    """

    label: ClassVar[str] = "Prefix affinity (cache-aware)"  # what operators see

    cache_threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.3
    balance_abs_threshold: Annotated[int, msgspec.Meta(ge=0)] = 64
    balance_rel_threshold: Annotated[float, msgspec.Meta(ge=1.0)] = 1.5
    scope: Literal["global", "local"] = "global"


class GorgoParams(msgspec.Struct, frozen=True, tag="gorgo", forbid_unknown_fields=True):
    """The GORGO cost model: w_rtt*RTT + w_queue*queue_wait + prefill(uncached tokens).

    ``default_rtt_ms`` is used for a (region, node) pair with no measurement yet.
    ``chars_per_token`` converts prompt characters to estimated tokens.
    ``w_displacement`` prices what a request sent to another region's node costs that region's
    own clients (docs/routing.md, "Coordinated overflow"); 0 is greedy (each request for itself).
    """

    label: ClassVar[str] = "GORGO (network + queue + cache)"  # what operators see

    w_rtt: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 1.0
    w_queue: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 1.0
    default_rtt_ms: Annotated[float, msgspec.Meta(ge=0.0, le=10_000.0)] = 100.0
    chars_per_token: Annotated[float, msgspec.Meta(ge=0.5, le=20.0)] = 4.0
    w_displacement: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 1.0
    # Bring a prompt family cached only abroad home once its region's requests have paid this many
    # times the price of caching it at home in round trips (docs/routing.md, "Bringing a prefix
    # home"); 0: never (every request goes where it is cheapest for itself).
    homing_rent_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 5.0
    # Route on what each gateway measures of a node from its own answers (its round trip, its
    # prefill speed) in place of the probed RTT and the configured prefill speed, once measured
    # (routing/state/measured.py); false: on the told values only.
    measured_inputs: bool = True


# The one list of routing algorithms: each params struct's ``tag`` is its algorithm's name and its
# ``label`` what operators see, and everything else (the names, the ``Algorithm`` type, the
# gateway's registry in ``routing/algorithms``, the control plane's choices, the benchmarks) is
# derived from it.
AlgorithmParams = (
    RoundRobinParams | LeastLoadParams | SessionAffinityParams | PrefixAffinityParams | GorgoParams
)


def algorithm_name(params_type: type[msgspec.Struct]) -> str:
    """The algorithm a params struct configures (its union tag)."""
    return str(params_type.__struct_config__.tag)


PARAMS_BY_ALGORITHM: dict[str, type[msgspec.Struct]] = {
    algorithm_name(params_type): params_type for params_type in get_args(AlgorithmParams)
}
ALGORITHMS: tuple[str, ...] = tuple(PARAMS_BY_ALGORITHM)
Algorithm = Literal[ALGORITHMS]  # type: ignore[valid-type]  # Literal["round_robin", ...], checked by msgspec


# Why parameters are invalid, per parameter, in plain words: the control plane's model, API and
# form all report these (validity itself is msgspec's decision over the params struct).
WHOLE_PARAMS = ""  # the key of an error about the parameters as a whole, not one of them


def params_errors(algorithm: str, raw: object) -> dict[str, str]:
    """Why ``raw`` is not valid parameters for ``algorithm``: parameter name -> message; {} if valid."""
    params_type = PARAMS_BY_ALGORITHM.get(algorithm)
    if params_type is None:
        return {WHOLE_PARAMS: f"Unknown algorithm {algorithm!r}."}
    if not isinstance(raw, dict):
        return {WHOLE_PARAMS: "Parameters must be a JSON object."}
    try:
        msgspec.convert(raw, params_type)
    except msgspec.ValidationError as exc:
        whole = str(exc)
    else:
        return {}
    fields = {field.name: field for field in msgspec.inspect.type_info(params_type).fields}
    hints = get_type_hints(params_type, include_extras=True)
    errors: dict[str, str] = {}
    for name, value in raw.items():
        field = fields.get(name)
        if field is None:
            known = ", ".join(fields) or "none"
            errors[str(name)] = f"Not a parameter of {algorithm} (its parameters: {known})."
            continue
        try:
            msgspec.convert(value, hints[name])
        except msgspec.ValidationError:
            errors[name] = _value_problem(field.type, value)
    return errors or {WHOLE_PARAMS: whole}


def _value_problem(info: Any, value: object) -> str:
    """Plain words for a value its field's type (``msgspec.inspect`` info) refused."""
    extra = getattr(info, "extra", None) or {}
    if isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if isinstance(info, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        whole = isinstance(info, msgspec.inspect.IntType)
        if isinstance(value, bool) or not isinstance(value, int if whole else int | float):
            return "Must be a whole number." if whole else "Must be a number."
        for bound, words, outside in (
            (info.ge, "at least", lambda b: value < b),
            (info.gt, "more than", lambda b: value <= b),
            (info.le, "at most", lambda b: value > b),
            (info.lt, "less than", lambda b: value >= b),
        ):
            if bound is not None and outside(bound):
                return f"Must be {words} {float(bound):g}."
    if isinstance(info, msgspec.inspect.StrType):
        if not isinstance(value, str):
            return "Must be text."
        low, high = info.min_length or 0, info.max_length
        if len(value) < low or (high is not None and len(value) > high):
            return (
                f"Must be {low} to {high} characters long."
                if high
                else f"Must be at least {low} characters long."
            )
        if info.pattern is not None:
            return str(extra.get("invalid", f"Must match {info.pattern}."))
    return str(extra.get("invalid", "Invalid value."))


class RegionSpec(msgspec.Struct, frozen=True):
    """A geographic region (where gateways and nodes live)."""

    slug: str
    name: str
    latitude: float
    longitude: float


class TokenizerSpec(msgspec.Struct, frozen=True):
    """Where a gateway finds a model's tokenizer: paths on the gateway's host (routing.cache.tokenization)."""

    tokenizer_path: str  # a Hugging Face tokenizer.json
    chat_template_path: str | None = None  # a Jinja chat template (Hugging Face format)


class ModelSpec(msgspec.Struct, frozen=True):
    """A served model, by the name clients put in ``model``."""

    name: str
    kv_block_size: int
    max_context_tokens: int
    tokenizer: TokenizerSpec | None = None  # None: the model is routed on the approximate index
    # The name is a LoRA adapter's (vLLM --lora-modules): vLLM hashes it into every block, so its
    # blocks are its own (routing.cache.precise_index.Tenant).
    lora_adapter: bool = False
    # The model's folder on the gateway hosts (tokenizer.json, tokenizer_config.json with its chat
    # template, config.json): the tokenizer and template come from it (routing.cache.model_folder).
    model_folder: str | None = None


class KVEventsSpec(msgspec.Struct, frozen=True):
    """Where a node publishes vLLM's KV-cache events (its ``--kv-events-config``), as gateways reach it."""

    endpoint: str  # tcp://host:port of the ZMQ PUB socket (data-parallel rank 0)
    replay_endpoint: str | None = None  # tcp://host:port of the ROUTER replay socket
    topic: str = ""


class NodeSpec(msgspec.Struct, frozen=True):
    """One vLLM endpoint on a GPU server, as the control plane knows it."""

    id: int
    name: str
    region: str
    base_url: str
    models: tuple[str, ...]
    gpu_type: str
    gpu_count: int
    max_num_seqs: int
    prefill_tokens_per_s: float
    kv_capacity_tokens: int
    state: NodeState
    labels: dict[str, str] = {}
    kv_events: KVEventsSpec | None = None  # None: no events; the approximate index serves the node


class ResidencyRule(msgspec.Struct, frozen=True):
    """Clients served by a gateway in ``client_region`` may only reach nodes in ``node_regions``.

    A client region with no rule may reach every region.
    """

    client_region: str
    node_regions: tuple[str, ...]


class PolicySpec(msgspec.Struct, frozen=True):
    """A routing policy as compiled: the algorithm, its parameters and its guards."""

    id: int
    name: str
    algorithm: Algorithm
    params: AlgorithmParams
    model_scope: tuple[str, ...] = ()  # empty: every model of the fleet
    residency: tuple[ResidencyRule, ...] = ()
    max_rtt_ms: float | None = None


TrialKind = Literal["shadow", "canary"]
NO_TRIAL = msgspec.Raw()  # the snapshot's shadow / canary when there is none
MAX_CANARY_SHARE = 0.5  # a canary never serves more than half of the sessions


class TrialSpec(msgspec.Struct, frozen=True):
    """A policy run beside the live one (issue 23), compiled against the same fleet.

    ``shadow``: every gateway also computes its decision for every request and logs it; it serves
    nothing. ``canary``: it serves the sessions whose hash (with ``salt``) falls under ``share``.
    ``id`` is the control plane's experiment id: request records name it, so workers can tell
    which experiment a record belongs to.
    """

    id: int
    kind: TrialKind
    policy: PolicySpec
    source_version: int | None = None  # the stored version it came from; None: a draft
    share: float = 0.0  # canary: fraction of sessions, (0, MAX_CANARY_SHARE]
    salt: str = ""  # canary: mixed into the session hash, so each canary picks its own sessions


class PolicySnapshot(msgspec.Struct, frozen=True, omit_defaults=True):
    """The immutable, versioned document a gateway routes by: one policy plus the fleet.

    ``shadow`` and ``canary`` (issue 23) are optional ``TrialSpec`` documents kept as raw JSON and
    decoded apart (``decode_trial``): a gateway that cannot read one (an algorithm it does not
    have) keeps serving the live policy. Absent, they are empty and left out of the document, so
    a snapshot without them is byte for byte what it was before them. They were added without a
    schema bump: snapshots do not forbid unknown fields, so gateways built before them ignore both.
    """

    schema_version: int
    version: int
    checksum: str
    published_at: float  # unix seconds
    policy: PolicySpec
    regions: tuple[RegionSpec, ...]
    models: tuple[ModelSpec, ...]
    nodes: tuple[NodeSpec, ...]
    # A TrialSpec each; absent: NO_TRIAL. Leave them out rather than pass an empty Raw: msgspec omits
    # a default only when it is the very default object, and an empty Raw of another identity
    # would be written as nothing at all (invalid JSON).
    shadow: msgspec.Raw = NO_TRIAL
    canary: msgspec.Raw = NO_TRIAL


def encode_trial(trial: TrialSpec) -> msgspec.Raw:
    """A trial as the raw JSON a snapshot carries."""
    return msgspec.Raw(_encoder.encode(trial))


def decode_trial(raw: msgspec.Raw) -> TrialSpec | None:
    """The trial a snapshot carries (None: none); ``msgspec.ValidationError``/``DecodeError`` when unreadable."""
    if not raw:
        return None
    return msgspec.json.decode(raw, type=TrialSpec)


class PolicyAnnouncement(msgspec.Struct, frozen=True):
    """Published on ``policy_channel`` after ``policy_current`` is written."""

    schema_version: int
    version: int
    checksum: str


# --------------------------------------------------------------------------------------------
# Client keys (control plane -> gateways)
# --------------------------------------------------------------------------------------------

Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "batch")


class ClientKeySpec(msgspec.Struct, frozen=True):
    """One client API key as gateways know it: the secret's hash only, never the secret.

    ``models`` and ``regions`` empty: every model, every gateway region. A limit of ``None``:
    unlimited. Revoked and expired keys stay in the set, so gateways can say why they refuse.
    """

    id: str  # the public id, also inside the secret (gorgo-sk-<id>-...)
    secret_sha256: str  # hex digest of the whole secret
    owner: str
    team: str = ""
    models: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()
    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    max_concurrent: int | None = None
    priority: Priority = "interactive"
    expires_at: float | None = None  # unix seconds
    revoked: bool = False


class ClientKeySet(msgspec.Struct, frozen=True):
    """Every client key, written whole on each change (a key change needs no policy publish)."""

    schema_version: int
    version: int  # larger is newer; a writer never replaces a newer set
    written_at: float
    keys: tuple[ClientKeySpec, ...]


class KeySetAnnouncement(msgspec.Struct, frozen=True):
    """Published on ``key_channel`` after ``key_set`` is written."""

    schema_version: int
    version: int


# --------------------------------------------------------------------------------------------
# Live state (telemetry workers -> gateways, dashboard)
# --------------------------------------------------------------------------------------------


class NodeLiveState(msgspec.Struct, frozen=True):
    """What the workers last saw of a node. Absent fields mean "not measured yet"."""

    schema_version: int
    node_id: int
    healthy: bool
    updated_at: float  # unix seconds
    num_running: float | None = None
    num_waiting: float | None = None
    kv_cache_usage: float | None = None  # 0..1
    prefix_hit_rate: float | None = None  # 0..1 over the last scrape interval, in tokens
    last_scrape_at: float | None = None
    last_probe_at: float | None = None


class RTTEntry(msgspec.Struct, frozen=True):
    """Application-level round trip from a region to a node (EWMA), in milliseconds."""

    region: str
    node_id: int
    rtt_ms: float
    jitter_ms: float
    samples: int
    updated_at: float


class RTTTable(msgspec.Struct, frozen=True):
    """Every measured (region, node) round trip."""

    schema_version: int
    updated_at: float
    entries: tuple[RTTEntry, ...]


# --------------------------------------------------------------------------------------------
# Gateway -> workers, gateway <-> gateway
# --------------------------------------------------------------------------------------------


class CostTerms(msgspec.Struct, frozen=True, omit_defaults=True):
    """How an algorithm valued one candidate node (ms unless named otherwise).

    Algorithms that do not model a term leave it at 0 (not written in a record: ``omit_defaults``).
    """

    node_id: int
    total_ms: float = 0.0
    rtt_ms: float = 0.0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    matched_tokens: int = 0
    uncached_tokens: int = 0
    # gorgo: the wait a forward to another region's node adds for that region's own clients
    displacement_ms: float = 0.0


# A 128k-character prompt is 512 chunks (~10 KB of JSON in its record); longer prompts keep their
# first 512, which still name the shared prefixes (system prompts, conversation heads).
PREFIX_HASHES_MAX = 512


class RequestRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """One finished request, as the gateway saw it. Appended to ``request_stream``.

    ``omit_defaults``: a field at its default is not written (a reader's decode restores it), so
    the usual record, with no canary, shadow, key or error, is a third shorter and cheaper to
    encode and decode (the gateway encodes one per request)."""

    schema_version: int
    request_id: str
    ts: float  # unix seconds when the request arrived
    gateway_region: str
    gateway_id: str
    model: str
    status: int
    stream: bool
    node_id: int | None = None
    node_region: str | None = None
    algorithm: str | None = None
    policy_version: int | None = None
    prompt_chars: int = 0
    prompt_tokens_est: int = 0
    prompt_tokens: int | None = None  # from the node's usage, when it reported one
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    routing_us: float = 0.0  # time spent choosing the node
    gateway_ms: float = 0.0  # time inside the gateway before the request left for the node
    ttft_ms: float | None = None  # arrival at gateway -> first byte back to the client
    total_ms: float = 0.0
    bytes_out: int = 0
    error: str | None = None
    cost: CostTerms | None = None
    runner_up: CostTerms | None = None
    # The prefix index's prediction for the chosen node (what it says the node holds, before the
    # trust discount that cost.matched_tokens carries), and whether it came from the node's KV
    # events ("precise") or the approximate index; compare with cached_tokens.
    prefix_index_mode: str | None = None
    predicted_cached_tokens: int | None = None
    key_id: str | None = None  # the client key's public id (never its secret)
    priority: str | None = None  # the key's priority class
    # The prompt's chained prefix-chunk hashes (routing.cache.approx_index.chunk_hashes: xxh3-64 of each
    # 256-byte chunk seeded with the previous hash), at most PREFIX_HASHES_MAX, first chunk first.
    # Never the text: a hash names a whole prefix, so the what-if replay (simulator/replay.py) can
    # tell which requests shared a cached prefix without ever seeing a prompt. Empty: not recorded.
    prefix_hashes: tuple[int, ...] = ()
    # Issue 23. A canary running: which experiment, and which arm served this request.
    canary_id: int | None = None
    arm: Literal["live", "canary"] | None = None
    # A shadow running: its experiment, the node it would have chosen, and its cost terms (priced
    # by the GORGO cost model when its algorithm prices nothing); ``cost`` is the live side's,
    # priced the same way while a shadow runs. ``shadow_cost`` is left out when the shadow chose
    # the live node and priced it exactly as ``cost`` (read ``shadow_terms``).
    shadow_id: int | None = None
    shadow_node_id: int | None = None
    shadow_node_region: str | None = None
    shadow_cost: CostTerms | None = None
    # gorgo's homing (docs/routing.md, "Bringing a prefix home"): the rent this request paid, in
    # estimated ms of TTFT, by going abroad for a prefix its region does not hold; ``homed``: it
    # stayed home to cache that prefix there instead (its ``runner_up`` is the forward it skipped)
    rent_ms: float = 0.0
    homed: bool = False
    # when the request left for the node -> when the node's response head came back (ms): for a
    # stream, the round trip and the node's intake (vLLM sends a stream's head before its first
    # token); for a whole answer, its whole time. None: no response (an error before one).
    head_ms: float | None = None

    @property
    def shadow_terms(self) -> CostTerms | None:
        """The shadow's cost terms: ``shadow_cost``, else ``cost`` when the shadow chose the live
        node (the gateway logs terms both sides share once)."""
        if self.shadow_cost is not None:
            return self.shadow_cost
        if self.shadow_node_id is not None and self.shadow_node_id == self.node_id:
            return self.cost
        return None


# A count of outstanding work in a peer's report: never negative (a negative count would cancel
# other gateways' real load on its node, which then looks empty to the capacity guard and the queue
# term), and at most what a float holds exactly (routing costs are floats: an integer past ~1.8e308
# raised OverflowError in every gorgo decision). A report with any other count is refused whole at
# decode, like one that does not decode, so a broken peer cannot make the request path pay to check.
LoadCount = Annotated[int, msgspec.Meta(ge=0, le=2**53)]


class GatewayLoad(msgspec.Struct, frozen=True):
    """One gateway's outstanding work per node, shared so gateways do not herd."""

    schema_version: int
    gateway_id: str
    region: str
    updated_at: float
    outstanding_requests: dict[int, LoadCount]
    outstanding_prefill_tokens: dict[int, LoadCount]
    # of outstanding_requests, those on nodes in this gateway's own region (gorgo's displacement
    # counts a region's own arrivals); absent from older gateways: read as none
    home_requests: dict[int, LoadCount] = {}
    # prompt tokens of the outstanding requests (the KV cache they hold until done); absent: none
    outstanding_context_tokens: dict[int, LoadCount] = {}


class NodeKVState(msgspec.Struct, frozen=True):
    """How one gateway indexes one node that publishes KV events."""

    mode: Literal["precise", "approximate"]
    lag_s: float | None = None  # age of the node's last event batch on arrival
    blocks: int = 0
    gaps: int = 0
    received: int = 0
    silent: bool = False  # answered requests through the gateway and sent no event for a while


class GatewayKVState(msgspec.Struct, frozen=True):
    """One gateway's view of the nodes with KV events (for the dashboard), refreshed every 2 s."""

    schema_version: int
    gateway_id: str
    region: str
    updated_at: float
    nodes: dict[int, NodeKVState]


class PrefixUpdate(msgspec.Struct, frozen=True):
    """Chunk hashes one gateway inserted into its prefix index for a node."""

    schema_version: int
    gateway_id: str
    node_id: int
    chunk_hashes: tuple[int, ...]
    ts: float


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder] = {}


def encode(doc: msgspec.Struct) -> bytes:
    """Serialise any contract struct to JSON bytes."""
    return _encoder.encode(doc)


def decode(data: bytes | str, type_: type[T]) -> T:
    """Decode and check ``schema_version``; raise ``UnknownSchemaVersion`` or ``msgspec.ValidationError``."""
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.json.Decoder(type_)
    if isinstance(data, str):
        data = data.encode()
    if type_ in _VERSIONED:
        probe = msgspec.json.decode(data, type=_VersionProbe)
        if probe.schema_version != SCHEMA_VERSION:
            raise UnknownSchemaVersion(
                f"{type_.__name__} has schema_version {probe.schema_version}; "
                f"this build understands {SCHEMA_VERSION}"
            )
    return decoder.decode(data)


class _VersionProbe(msgspec.Struct):
    schema_version: int


_VERSIONED = frozenset(
    {
        PolicySnapshot,
        PolicyAnnouncement,
        NodeLiveState,
        RTTTable,
        RequestRecord,
        GatewayLoad,
        GatewayKVState,
        PrefixUpdate,
        ClientKeySet,
        KeySetAnnouncement,
    }
)
