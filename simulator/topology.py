"""The emulated fleet's topology: regions, round trips between them, and the nodes with their engines.

A topology is a TOML file (format in docs/simulator.md; the demo's is ``topologies/default.toml``).
``load_topology`` reads and validates it into frozen dataclasses. Importing this module has no side
effects, so the control plane's ``seed_demo`` command can read the demo fleet through it.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from simulator.kv_events import KVEventsConfig, KVEventsConfigError, parse_kv_events_config

DEFAULT_TOPOLOGY_PATH = Path(__file__).resolve().parent / "topologies" / "default.toml"
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


class TopologyError(ValueError):
    """A topology file (or an override) is invalid; the message says where and why."""


@dataclass(frozen=True, slots=True)
class EngineParams:
    """How one emulated vLLM engine performs.

    Defaults approximate one H100 80GB serving Llama-3.1-8B-Instruct in bf16 with vLLM V1's defaults
    for that GPU (``max_num_seqs`` 1024, ``max_num_batched_tokens`` 8192, block size 16). A step takes
    ``decode_step_base_ms + prefill tokens / prefill_tokens_per_s + decode_per_seq_ms * decoding
    sequences``. Llama-3.1-8B's KV cache is 128 KiB per token, so ~54 GiB left after weights holds
    about 28k blocks of 16 tokens.
    """

    max_model_len: int = 32768
    block_size: int = 16
    kv_capacity_blocks: int = 28_000
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    prefill_tokens_per_s: float = 20_000.0
    decode_step_base_ms: float = 6.5
    decode_per_seq_ms: float = 0.06
    # An emulated answer ends by itself ("stop") after a length drawn from this range (seeded by the
    # prompt) unless max_tokens cuts it first ("length") or the request sets ignore_eos.
    natural_output_min_tokens: int = 32
    natural_output_max_tokens: int = 384

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise TopologyError(f"engine.{f.name} must be a number, got {value!r}")
            if value < 0 or (value == 0 and f.name not in {"decode_step_base_ms", "decode_per_seq_ms"}):
                raise TopologyError(f"engine.{f.name} must be positive, got {value!r}")
            if f.type == "int" and not isinstance(value, int):
                raise TopologyError(f"engine.{f.name} must be an integer, got {value!r}")
        if self.natural_output_min_tokens > self.natural_output_max_tokens:
            raise TopologyError("engine.natural_output_min_tokens is above natural_output_max_tokens")
        if self.kv_capacity_tokens < self.max_model_len:
            # vLLM refuses to start in this case too: one request of max_model_len must fit.
            raise TopologyError(
                f"engine.kv_capacity_blocks holds {self.kv_capacity_tokens} tokens, fewer than "
                f"max_model_len ({self.max_model_len}); vLLM would refuse to start. Increase "
                "kv_capacity_blocks or decrease max_model_len."
            )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_capacity_blocks * self.block_size

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> EngineParams:
        """A copy with some parameters replaced; unknown names raise ``TopologyError``."""
        if not overrides:
            return self
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TopologyError(f"unknown engine parameter(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(self, **overrides)


@dataclass(frozen=True, slots=True)
class Region:
    """A geographic region where clients, gateways and nodes live."""

    slug: str
    name: str
    latitude: float
    longitude: float


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One emulated vLLM server: where it is, where it listens and how its engine performs."""

    name: str
    region: str
    host: str
    port: int
    model: str
    engine: EngineParams
    gpu_type: str = "H100-80GB"
    gpu_count: int = 1
    # vLLM's --kv-events-config for this node (None: no events, as vLLM's default)
    kv_events: KVEventsConfig | None = None
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens is only
    # reported with it (vLLM's default is off; the shipped topologies turn it on in [fleet])
    enable_prompt_tokens_details: bool = False
    # The entries of the node's own ``[nodes.engine]`` table (name, value), sorted: what it sets
    # over the fleet's ``[engine]`` defaults (a faster or slower GPU, a smaller KV cache)
    engine_own: tuple[tuple[str, Any], ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def engine_under(self, defaults: Mapping[str, Any] | None) -> EngineParams:
        """This node's engine with the fleet's ``[engine]`` defaults replaced by ``defaults``: its
        own entries still win (a benchmark sets the fleet's engine without flattening a fleet of
        mixed GPUs)."""
        if not defaults:
            return self.engine
        return self.engine.with_overrides(defaults).with_overrides(dict(self.engine_own))


@dataclass(frozen=True, slots=True)
class Link:
    """The round trip between two regions (symmetric) and its jitter, in milliseconds."""

    a: str
    b: str
    rtt_ms: float
    jitter_ms: float


@dataclass(frozen=True, slots=True)
class Topology:
    """A whole emulated fleet: regions, the RTT matrix and nodes."""

    name: str
    seed: int
    regions: tuple[Region, ...]
    nodes: tuple[NodeSpec, ...]
    links: tuple[Link, ...]
    intra_region_rtt_ms: float
    intra_region_jitter_ms: float
    _links_by_pair: Mapping[frozenset[str], Link] = field(
        default_factory=lambda: MappingProxyType({}), repr=False, compare=False
    )

    def region(self, slug: str) -> Region:
        for region in self.regions:
            if region.slug == slug:
                return region
        raise KeyError(slug)

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def has_region(self, slug: str) -> bool:
        return any(region.slug == slug for region in self.regions)

    def rtt_ms(self, a: str, b: str) -> float:
        """Base round trip between two regions, without jitter. ``KeyError`` for an unknown region."""
        return self._link(a, b)[0]

    def jitter_ms(self, a: str, b: str) -> float:
        """Upper bound of the extra, random delay a round trip between ``a`` and ``b`` may add."""
        return self._link(a, b)[1]

    def _link(self, a: str, b: str) -> tuple[float, float]:
        if not (self.has_region(a) and self.has_region(b)):
            raise KeyError(a if not self.has_region(a) else b)
        if a == b:
            return self.intra_region_rtt_ms, self.intra_region_jitter_ms
        link = self._links_by_pair[frozenset((a, b))]
        return link.rtt_ms, link.jitter_ms


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

_TOP_KEYS = {"fleet", "network", "engine", "regions", "nodes"}
_FLEET_KEYS = {"name", "seed", "model", "host", "gpu_type", "enable_prompt_tokens_details"}
_NETWORK_KEYS = {"intra_region_rtt_ms", "intra_region_jitter_ms", "jitter_ms", "links"}
_LINK_KEYS = {"a", "b", "rtt_ms", "jitter_ms"}
_REGION_KEYS = {"slug", "name", "latitude", "longitude"}
_NODE_KEYS = {
    "name",
    "region",
    "host",
    "port",
    "model",
    "engine",
    "gpu_type",
    "gpu_count",
    "kv_events_config",
    "enable_prompt_tokens_details",
}


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology TOML file. Raises ``TopologyError`` with the offending key."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise TopologyError(f"cannot read topology {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"{path} is not valid TOML: {exc}") from exc
    try:
        return parse_topology(data)
    except TopologyError as exc:
        raise TopologyError(f"{path}: {exc}") from exc


def parse_topology(data: Mapping[str, Any]) -> Topology:
    """Build a ``Topology`` from already-parsed TOML (a dict)."""
    _check_keys(data, _TOP_KEYS, "top level")
    fleet = _table(data, "fleet")
    _check_keys(fleet, _FLEET_KEYS, "[fleet]")
    network = _table(data, "network")
    _check_keys(network, _NETWORK_KEYS, "[network]")
    default_engine = _engine(_table(data, "engine"), EngineParams(), "[engine]")

    regions = tuple(_region(raw, i) for i, raw in enumerate(_array(data, "regions")))
    if not regions:
        raise TopologyError("at least one [[regions]] entry is required")
    slugs = [r.slug for r in regions]
    if len(set(slugs)) != len(slugs):
        raise TopologyError(f"duplicate region slugs in {slugs}")

    default_jitter_ms = _number(network.get("jitter_ms", 1.0), "network.jitter_ms")
    links: dict[frozenset[str], Link] = {}
    for i, raw in enumerate(_array(network, "links")):
        where = f"network.links[{i}]"
        _check_keys(raw, _LINK_KEYS, where)
        a, b = _str(raw.get("a"), f"{where}.a"), _str(raw.get("b"), f"{where}.b")
        for slug in (a, b):
            if slug not in slugs:
                raise TopologyError(f"{where} names unknown region {slug!r}")
        if a == b:
            raise TopologyError(f"{where} links {a!r} to itself; use network.intra_region_rtt_ms")
        pair = frozenset((a, b))
        if pair in links:
            raise TopologyError(f"{where} repeats the link {a} <-> {b}")
        links[pair] = Link(
            a=a,
            b=b,
            rtt_ms=_number(raw.get("rtt_ms"), f"{where}.rtt_ms"),
            jitter_ms=_number(raw.get("jitter_ms", default_jitter_ms), f"{where}.jitter_ms"),
        )
    missing = [
        f"{a} <-> {b}" for i, a in enumerate(slugs) for b in slugs[i + 1 :] if frozenset((a, b)) not in links
    ]
    if missing:
        raise TopologyError(f"network.links has no RTT for {', '.join(missing)}")

    default_model = _str(fleet.get("model", DEFAULT_MODEL), "fleet.model")
    default_host = _str(fleet.get("host", "127.0.0.1"), "fleet.host")
    default_gpu = _str(fleet.get("gpu_type", "H100-80GB"), "fleet.gpu_type")
    default_details = _bool(
        fleet.get("enable_prompt_tokens_details", False), "fleet.enable_prompt_tokens_details"
    )
    nodes = tuple(
        _node(raw, i, slugs, default_engine, default_model, default_host, default_gpu, default_details)
        for i, raw in enumerate(_array(data, "nodes"))
    )
    if not nodes:
        raise TopologyError("at least one [[nodes]] entry is required")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise TopologyError(f"duplicate node names in {names}")
    endpoints = [(n.host, n.port) for n in nodes if n.port]
    if len(set(endpoints)) != len(endpoints):
        raise TopologyError("two nodes listen on the same host and port")

    seed = fleet.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TopologyError(f"fleet.seed must be an integer, got {seed!r}")
    return Topology(
        name=_str(fleet.get("name", "fleet"), "fleet.name"),
        seed=seed,
        regions=regions,
        nodes=nodes,
        links=tuple(links.values()),
        intra_region_rtt_ms=_number(network.get("intra_region_rtt_ms", 1.5), "network.intra_region_rtt_ms"),
        intra_region_jitter_ms=_number(
            network.get("intra_region_jitter_ms", min(default_jitter_ms, 0.5)),
            "network.intra_region_jitter_ms",
        ),
        _links_by_pair=MappingProxyType(links),
    )


def _region(raw: Any, index: int) -> Region:
    where = f"regions[{index}]"
    if not isinstance(raw, Mapping):
        raise TopologyError(f"{where} must be a table")
    _check_keys(raw, _REGION_KEYS, where)
    latitude = _number(raw.get("latitude"), f"{where}.latitude", allow_negative=True)
    longitude = _number(raw.get("longitude"), f"{where}.longitude", allow_negative=True)
    if not (-90 <= latitude <= 90 and -180 <= longitude <= 180):
        raise TopologyError(f"{where} has coordinates out of range ({latitude}, {longitude})")
    slug = _str(raw.get("slug"), f"{where}.slug")
    return Region(
        slug=slug, name=_str(raw.get("name", slug), f"{where}.name"), latitude=latitude, longitude=longitude
    )


def _node(
    raw: Any,
    index: int,
    regions: list[str],
    default_engine: EngineParams,
    default_model: str,
    default_host: str,
    default_gpu: str,
    default_details: bool = False,
) -> NodeSpec:
    where = f"nodes[{index}]"
    if not isinstance(raw, Mapping):
        raise TopologyError(f"{where} must be a table")
    _check_keys(raw, _NODE_KEYS, where)
    region = _str(raw.get("region"), f"{where}.region")
    if region not in regions:
        raise TopologyError(f"{where}.region {region!r} is not one of {regions}")
    port = raw.get("port", 0)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise TopologyError(f"{where}.port must be an integer in 0..65535, got {port!r}")
    gpu_count = raw.get("gpu_count", 1)
    if not isinstance(gpu_count, int) or gpu_count < 1:
        raise TopologyError(f"{where}.gpu_count must be a positive integer")
    kv_events = None
    if "kv_events_config" in raw:
        try:
            kv_events = parse_kv_events_config(raw["kv_events_config"])
        except KVEventsConfigError as exc:
            raise TopologyError(f"{where}.{exc}") from None
    engine_raw = raw.get("engine", {})
    if not isinstance(engine_raw, Mapping):
        raise TopologyError(f"{where}.engine must be a table")
    return NodeSpec(
        name=_str(raw.get("name"), f"{where}.name"),
        region=region,
        host=_str(raw.get("host", default_host), f"{where}.host"),
        port=port,
        model=_str(raw.get("model", default_model), f"{where}.model"),
        engine=_engine(engine_raw, default_engine, f"{where}.engine"),
        engine_own=tuple(sorted(engine_raw.items())),
        gpu_type=_str(raw.get("gpu_type", default_gpu), f"{where}.gpu_type"),
        gpu_count=gpu_count,
        kv_events=kv_events,
        enable_prompt_tokens_details=_bool(
            raw.get("enable_prompt_tokens_details", default_details), f"{where}.enable_prompt_tokens_details"
        ),
    )


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise TopologyError(f"{where} must be true or false, got {value!r}")
    return value


def _engine(raw: Mapping[str, Any], base: EngineParams, where: str) -> EngineParams:
    try:
        return base.with_overrides(dict(raw))
    except TopologyError as exc:
        raise TopologyError(f"{where}: {exc}") from exc
    except TypeError as exc:  # pragma: no cover - dataclass replace on odd input
        raise TopologyError(f"{where}: {exc}") from exc


def _table(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise TopologyError(f"[{key}] must be a table")
    return value


def _array(data: Mapping[str, Any], key: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise TopologyError(f"{key} must be an array of tables ([[{key}]])")
    return value


def _check_keys(raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise TopologyError(f"{where} has unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise TopologyError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _number(value: Any, where: str, *, allow_negative: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TopologyError(f"{where} must be a number, got {value!r}")
    if value < 0 and not allow_negative:
        raise TopologyError(f"{where} must not be negative, got {value!r}")
    return float(value)
