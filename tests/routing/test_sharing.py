"""Sharing prefix insertions and load between gateways through the real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, generate_latest

from routing.algorithms import gorgo
from routing.algorithms.base import NodeLoad, RoutingRequest, RoutingView
from routing.cache.approx_index import CHUNK_BYTES, ApproxPrefixIndex
from routing.contract import SCHEMA_VERSION, GatewayLoad, GorgoParams, PrefixUpdate, RedisKeys, encode
from routing.observability.exporter import StateCollector
from routing.state import sharing as sharing_module
from routing.state.inflight import InFlight
from routing.state.sharing import (
    MAX_HASHES_PER_UPDATE,
    PRUNE_AFTER_S,
    GatewaySharing,
    PeerLoad,
    apply_peer_update,
)
from simulator.harness import free_port
from simulator.snapshots import MODEL, make_node

FAST = dict(prefix_flush_interval_s=0.02, load_interval_s=0.05, read_block_ms=100)


def text(seed: str, chunks: int) -> str:
    return "".join(f"{seed}-{index:06d}-".ljust(CHUNK_BYTES, "x") for index in range(chunks))


def no_load() -> tuple[dict[int, int], dict[int, int], dict[int, int], dict[int, int]]:
    return {}, {}, {}, {}


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> float:
    """Wait until ``condition()`` holds; return how long it took (fail after ``timeout_s``)."""
    start = time.perf_counter()
    while not condition():
        assert time.perf_counter() - start < timeout_s, "condition not reached"
        await asyncio.sleep(0.01)
    return time.perf_counter() - start


@contextlib.asynccontextmanager
async def running(sharing: GatewaySharing) -> AsyncIterator[GatewaySharing]:
    await sharing.start()
    try:
        yield sharing
    finally:
        await sharing.stop()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    connection = aioredis.Redis.from_url(redis_url)
    yield connection
    await connection.aclose()


def gateway(
    client: aioredis.Redis,
    keys: RedisKeys,
    name: str,
    index: ApproxPrefixIndex | None = None,
    load_source: Callable[
        [], tuple[Mapping[int, int], Mapping[int, int], Mapping[int, int], Mapping[int, int]]
    ] = no_load,
    **options: object,
) -> GatewaySharing:
    return GatewaySharing(
        client,
        keys,
        gateway_id=name,
        region="us-east",
        index=index or ApproxPrefixIndex(),
        load_source=load_source,
        **{**FAST, **options},  # type: ignore[arg-type]
    )


async def test_it_shares_prefix_insertions_between_gateways(
    client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    east, west = ApproxPrefixIndex(), ApproxPrefixIndex()
    prompt_east, prompt_west = text("east", 6), text("west", 4)
    async with (
        running(gateway(client, redis_keys, "east", east)) as a,
        running(gateway(client, redis_keys, "west", west)),
    ):
        east.insert(1, prompt_east)
        west.insert(2, prompt_west)
        await eventually(lambda: west.match([1], prompt_east) == {1: 6 * CHUNK_BYTES // 4})
        await eventually(lambda: east.match([2], prompt_west) == {2: 4 * CHUNK_BYTES // 4})
        assert a.updates_applied == 1  # west's update only: its own are not applied twice


async def test_it_warm_starts_a_new_gateway_from_the_stream(
    client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    east = ApproxPrefixIndex()
    prompt = text("history", 5)
    async with running(gateway(client, redis_keys, "east", east)) as a:
        east.insert(3, prompt)
        await eventually(lambda: a.updates_sent == 1)
    late = ApproxPrefixIndex()
    async with running(gateway(client, redis_keys, "late", late)):
        await eventually(lambda: late.match([3], prompt) == {3: 5 * CHUNK_BYTES // 4})


async def test_it_shares_load_and_ignores_stale_and_own_entries(
    client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    now_s = time.time()
    ghost = GatewayLoad(SCHEMA_VERSION, "ghost", "eu-central", now_s - 10, {1: 100}, {1: 100})
    dead = GatewayLoad(SCHEMA_VERSION, "dead", "eu-central", now_s - PRUNE_AFTER_S - 5, {1: 100}, {1: 100})
    await client.hset(redis_keys.gateway_load, mapping={"ghost": encode(ghost), "dead": encode(dead)})
    pushed: list[Mapping[int, NodeLoad]] = []

    def east_load() -> tuple[dict[int, int], dict[int, int], dict[int, int], dict[int, int]]:
        # 2 of the 3 on node 1 are east's home requests; their prompts hold 5,000 tokens of KV
        return {1: 3, 2: 0}, {1: 1_200, 2: 0}, {1: 2}, {1: 5_000}

    async with (
        running(gateway(client, redis_keys, "east", load_source=east_load)) as east,
        running(
            gateway(
                client,
                redis_keys,
                "west",
                load_source=lambda: ({1: 2}, {1: 10}, {}, {}),
                on_peer_load=pushed.append,
            )
        ) as west,
    ):
        await eventually(
            lambda: (
                west.peer_load.get(1) == NodeLoad(3, 1_200, home_requests=2, outstanding_context_tokens=5_000)
            )
        )
        await eventually(lambda: east.peer_load.get(1) == NodeLoad(2, 10))
        assert set(west.peer_load) == {1}  # ghost's stale load and east's zero counts are not there
        await eventually(lambda: bool(pushed))
        assert pushed[-1] is west.peer_load
        with pytest.raises(TypeError):
            west.peer_load[2] = NodeLoad()  # type: ignore[index]
        assert not await client.hexists(redis_keys.gateway_load, "dead")
    assert not await client.hexists(redis_keys.gateway_load, "east")  # withdrawn on stop


async def test_it_keeps_working_without_redis() -> None:
    unreachable = aioredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.2)
    index = ApproxPrefixIndex()
    sharing = gateway(
        unreachable,
        RedisKeys(prefix="gorgotest-unreachable"),
        "alone",
        index,
        lambda: ({1: 1}, {1: 1}, {}, {}),
    )
    try:
        async with running(sharing):
            index.insert(1, text("local", 3))
            await eventually(lambda: sharing.redis_errors >= 3)
            assert not sharing.connected
            assert index.match([1], text("local", 3)) == {1: 3 * CHUNK_BYTES // 4}
            assert sharing.peer_load == {}
    finally:
        await unreachable.aclose()


async def test_it_reconnects_when_redis_comes_back(redis_url: str, redis_keys: RedisKeys) -> None:
    async with _switchable_proxy(redis_url) as (port, switch_on):
        db = int(urlsplit(redis_url).path.strip("/") or 0)
        flaky = aioredis.Redis(host="127.0.0.1", port=port, db=db, socket_connect_timeout=0.5)
        direct = aioredis.Redis.from_url(redis_url)
        index = ApproxPrefixIndex()
        try:
            async with running(
                gateway(flaky, redis_keys, "flaky", index, lambda: ({7: 5}, {7: 50}, {}, {}))
            ) as sharing:
                await eventually(lambda: sharing.redis_errors >= 2)
                switch_on()
                async with running(gateway(direct, redis_keys, "peer")) as peer:
                    await eventually(lambda: peer.peer_load.get(7) == NodeLoad(5, 50), timeout_s=15.0)
                    await eventually(lambda: sharing.connected)
        finally:
            await flaky.aclose()
            await direct.aclose()


def test_it_orders_split_updates_so_a_reader_keeps_the_prefix() -> None:
    sharing = GatewaySharing(
        None,  # type: ignore[arg-type]  # building updates needs no Redis
        RedisKeys(prefix="unused"),
        gateway_id="east",
        region="us-east",
        index=ApproxPrefixIndex(),
        load_source=no_load,
    )
    chain = tuple(range(1, 3_001))
    updates = sharing.build_updates([(1, chain[:10], 5.0), (1, chain, 6.0), (2, chain[:3], 4.0)])
    assert [(u.node_id, len(u.chunk_hashes)) for u in updates] == [
        (1, 3_000 - MAX_HASHES_PER_UPDATE),
        (1, MAX_HASHES_PER_UPDATE),
        (2, 3),
    ]
    assert updates[0].ts == 6.0

    reader = ApproxPrefixIndex(chars_per_token=4.0)
    reader.set_capacity(1, 100 * CHUNK_BYTES // 4)
    for update in updates:
        reader.apply_remote(update)
    assert reader.match_hashes(chain, [1], 6.0) == {1: 100 * CHUNK_BYTES // 4}


@contextlib.asynccontextmanager
async def _switchable_proxy(redis_url: str) -> AsyncIterator[tuple[int, Callable[[], None]]]:
    """A loopback TCP proxy to Redis that drops every connection until switched on."""
    target = urlsplit(redis_url)
    enabled = asyncio.Event()
    pumps: set[asyncio.Task[None]] = set()

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not enabled.is_set():
            writer.close()
            return
        upstream_reader, upstream_writer = await asyncio.open_connection(target.hostname, target.port or 6379)
        for task in (pump(reader, upstream_writer), pump(upstream_reader, writer)):
            pumps.add(asyncio.ensure_future(task))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port, enabled.set
    finally:
        server.close()
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await server.wait_closed()


async def test_it_stops_its_loops_without_cancelling_them(
    client: aioredis.Redis, redis_keys: RedisKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # redis-py can hang when a command is cancelled midway: the loops must end on their own,
    # even the reader parked in a blocking XREAD.
    in_xread = asyncio.Event()
    real_xread = client.xread

    async def xread(*args, **kwargs):  # type: ignore[no-untyped-def]
        in_xread.set()
        try:
            return await real_xread(*args, **kwargs)
        finally:
            in_xread.clear()

    monkeypatch.setattr(client, "xread", xread)
    sharing = gateway(client, redis_keys, "east", read_block_ms=200)
    await sharing.start()
    tasks = list(sharing._tasks)
    await eventually(lambda: sharing.connected and sharing._peer_load_at_s > 0)
    await asyncio.wait_for(in_xread.wait(), timeout=5)  # the reader is inside XREAD (5 s: a bound only)
    await sharing.stop()
    assert all(task.done() for task in tasks)
    assert [task.get_name() for task in tasks if task.cancelled()] == []
    assert await client.ping()  # the shared connection pool is still usable


async def test_it_skips_its_own_stream_entries_without_decoding_them(
    client: aioredis.Redis, redis_keys: RedisKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[bytes | str] = []
    real_decode = sharing_module.decode

    def counting_decode(data, type_):  # type: ignore[no-untyped-def]
        if type_ is PrefixUpdate:
            decoded.append(data)
        return real_decode(data, type_)

    monkeypatch.setattr(sharing_module, "decode", counting_decode)
    east = ApproxPrefixIndex()
    async with running(gateway(client, redis_keys, "east", east)) as sharing:
        for number in range(5):
            east.insert(number + 1, text(f"own{number}", 2))
            await eventually(lambda number=number: sharing.updates_sent == number + 1)
        await eventually(lambda: sharing.own_updates_skipped == 5)
    assert decoded == []
    assert sharing.updates_applied == 0


async def test_it_counts_a_peers_fresh_insertion_as_its_work_until_the_peers_report_does(
    client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    """Issue 24's herding: a peer's prefix update reaches this gateway within milliseconds, its
    load report up to two load periods later. Meanwhile the node must not look warm and idle: the
    update counts as one request whose prefill is what the index did not place there yet."""
    east, west = ApproxPrefixIndex(), ApproxPrefixIndex()
    prompt = text("shared-system-prompt", 6)  # 6 chunks of 64 tokens at 4 characters per token
    async with (
        running(gateway(client, redis_keys, "east", east)),
        running(gateway(client, redis_keys, "west", west, load_interval_s=3600.0)) as reader,
    ):
        east.insert(2, text("first", 2))  # once it reached west (warm start or stream), west reads on
        await eventually(lambda: reader.updates_applied == 1)
        east.insert(1, prompt)
        await eventually(lambda: reader.peer_load.get(1) == NodeLoad(1, 384, 0, 384))
        assert west.match([1], prompt) == {1: 384}
        await asyncio.sleep(FAST["load_interval_s"] * 3)  # east writes its (empty) load again
        await reader._exchange_load_once()  # this gateway's next exchange reads that report
        assert 1 not in reader.peer_load  # the report covers the claim: east has nothing there


def test_a_claim_counts_only_what_the_index_did_not_place_yet() -> None:
    index = ApproxPrefixIndex(chars_per_token=4.0)
    peers = PeerLoad()
    hashes = index.chunk_hashes(text("conversation", 10))
    index.insert_hashes(2, hashes[:8], 100.0)  # the first 8 chunks' earlier turn went there
    apply_peer_update(index, peers, PrefixUpdate(SCHEMA_VERSION, "east", 2, tuple(hashes), 101.0))
    assert peers.load() == {2: NodeLoad(1, 2 * 64, 0, 2 * 64)}
    report = GatewayLoad(SCHEMA_VERSION, "east", "us-east", 101.5, {2: 1}, {2: 128}, {}, {2: 128})
    peers.read_reports([report])
    assert peers.load() == {2: NodeLoad(1, 128, 0, 128)}  # the report, not the report and the claim
    apply_peer_update(index, peers, PrefixUpdate(SCHEMA_VERSION, "east", 3, tuple(hashes), 101.2))
    assert peers.load() == {2: NodeLoad(1, 128, 0, 128)}  # older than the report: already in it


async def test_it_shows_how_late_each_peers_updates_and_reports_arrive(
    client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    """Over a WAN a far gateway's view of its peers trails by a round trip and more (docs/deployment.md):
    the reader keeps, per peer, how late its prefix updates arrive and how old its load report was when
    read, and /metrics shows both. Here the reader's clock runs 0.3 s ahead of the writer's: to it every
    update and report of the writer is at least 0.3 s old."""
    east, west = ApproxPrefixIndex(), ApproxPrefixIndex()
    async with (
        running(gateway(client, redis_keys, "east", east)),
        running(gateway(client, redis_keys, "west", west, clock=lambda: time.time() + 0.3)) as reader,
    ):
        east.insert(2, text("first", 2))  # once it reached west (warm start or stream), west reads on
        await eventually(lambda: reader.updates_applied == 1)
        east.insert(1, text("second", 3))  # read live from the stream: its delay is taken
        await eventually(lambda: "east" in reader.peer_update_delay_s and "east" in reader.peer_report_age_s)
        delay_s = reader.peer_update_delay_s["east"]
        age_s = reader.peer_report_age_s["east"]
        registry = CollectorRegistry()
        registry.register(
            StateCollector(
                InFlight(),
                node_names=dict,
                policy_version=lambda: None,
                redis_connected=lambda: True,
                policy_events=dict,
                request_log=lambda: (0, 0, 0),
                peer_staleness=lambda: (dict(reader.peer_update_delay_s), dict(reader.peer_report_age_s)),
            )
        )
        metrics = generate_latest(registry).decode()
    assert 0.3 <= delay_s < 0.3 + 1.0  # the offset, plus the flush period and a loopback hop
    assert 0.3 <= age_s < 0.3 + 1.0  # the offset, plus at most a load period and the exchange
    assert f'gorgo_gateway_peer_update_delay_seconds{{peer="east"}} {delay_s!r}' in metrics
    assert 'gorgo_gateway_peer_load_age_seconds{peer="east"}' in metrics
    assert "west" not in reader.peer_update_delay_s  # its own updates are no peer's


def test_a_peers_staleness_is_unknown_once_nothing_was_read_for_too_long() -> None:
    """With Redis away the last figures would claim fresh peers: past ``peer_stale_after_s`` without
    a read they are dropped with the peers' load, not shown as they were."""
    now = [1_000.0]
    sharing = GatewaySharing(
        None,  # type: ignore[arg-type]  # no Redis call is made here
        RedisKeys(prefix="unused"),
        gateway_id="west",
        region="us-east",
        index=ApproxPrefixIndex(),
        load_source=no_load,
        peer_stale_after_s=3.0,
        clock=lambda: now[0],
    )
    sharing._set_peer_load({}, now[0])  # the last read: every peer's load was zero
    sharing.peer_update_delay_s["east"] = 0.04
    sharing.peer_report_age_s["east"] = 0.09
    now[0] += 2.0
    sharing._failed("load-exchange", ConnectionError("down"))
    assert sharing.peer_report_age_s == {"east": 0.09}  # within the stale time: still the last read
    now[0] += 2.0
    sharing._failed("load-exchange", ConnectionError("down"))
    assert sharing.peer_update_delay_s == {} and sharing.peer_report_age_s == {}


def test_the_claims_of_a_peer_that_stopped_reporting_expire_as_its_report_would() -> None:
    """A peer that stops (its stop() deletes its load entry; a restart is a new gateway id) or dies
    leaves the claims it made after its last report: no later report of it ever covers them, and
    they counted as load on their nodes until 10,000 newer claims pushed them out."""
    index = ApproxPrefixIndex(chars_per_token=4.0)
    peers = PeerLoad()
    peers.read_reports([GatewayLoad(SCHEMA_VERSION, "east-123", "us-east", 100.0, {}, {})], 100.0, 3.0)
    hashes = tuple(index.chunk_hashes("x" * CHUNK_BYTES * 10))
    apply_peer_update(index, peers, PrefixUpdate(SCHEMA_VERSION, "east-123", 1, hashes, 100.05))
    assert peers.load() == {1: NodeLoad(1, 640, 0, 640)}  # sent after its report: claimed
    peers.read_reports([], 102.0, 3.0)  # east's entry gone; its claim is 1.95 s old
    assert peers.load() == {1: NodeLoad(1, 640, 0, 640)}  # a peer between reports, or just late
    peers.read_reports([], 103.1, 3.0)  # past the stale time
    assert peers.load() == {}


def test_the_claims_of_a_peer_whose_clock_runs_ahead_expire_when_it_stops() -> None:
    """A peer an hour ahead stamps its updates an hour in this reader's future: by their stamps
    its claims stayed fresh for that hour after it stopped, each counted as load on its node.
    They now also age from when they arrived here."""
    index = ApproxPrefixIndex(chars_per_token=4.0)
    peers = PeerLoad()
    hashes = tuple(index.chunk_hashes("x" * CHUNK_BYTES * 10))
    apply_peer_update(index, peers, PrefixUpdate(SCHEMA_VERSION, "ahead", 1, hashes, 100.0 + 3600), 100.0)
    assert peers.load() == {1: NodeLoad(1, 640, 0, 640)}
    peers.read_reports([], 102.0, 3.0)  # no report of it; its claim arrived 2 s ago
    assert peers.load() == {1: NodeLoad(1, 640, 0, 640)}
    peers.read_reports([], 103.5, 3.0)  # 3.5 s since it arrived: as stale as a report would be
    assert peers.load() == {}


async def test_a_peer_whose_clock_runs_ahead_stops_counting_once_it_stops_reporting(
    client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    """A peer report stamped an hour in the future (the peer's clock is ahead) never aged: when
    that gateway died, its last load counted on every other gateway for the hour. A report now
    also ages from when this gateway first read that stamp."""
    now = [time.time()]
    ahead = GatewayLoad(SCHEMA_VERSION, "ahead", "eu-central", now[0] + 3600, {1: 2}, {1: 500})
    await client.hset(redis_keys.gateway_load, "ahead", encode(ahead))
    west = gateway(client, redis_keys, "west", clock=lambda: now[0], peer_stale_after_s=3.0)
    await west._exchange_load_once()
    assert dict(west.peer_load) == {1: NodeLoad(2, 500)}
    now[0] += 2.0
    await west._exchange_load_once()
    assert 1 in west.peer_load  # not stale yet
    now[0] += 2.0  # 4 s since its last report changed: it stopped
    await west._exchange_load_once()
    assert dict(west.peer_load) == {}
    assert "ahead" not in west.peer_report_age_s
    fresh = GatewayLoad(SCHEMA_VERSION, "ahead", "eu-central", now[0] + 3601, {1: 1}, {1: 100})
    await client.hset(redis_keys.gateway_load, "ahead", encode(fresh))  # it reports again
    await west._exchange_load_once()
    assert dict(west.peer_load) == {1: NodeLoad(1, 100)}


async def test_a_stopped_peers_claims_leave_the_peer_load(
    client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    """The same through Redis: east's last claim, then its stop() (HDEL of its load entry)."""
    index = ApproxPrefixIndex()
    async with running(gateway(client, redis_keys, "west", index, peer_stale_after_s=0.3)) as reader:
        now = time.time()
        report = GatewayLoad(SCHEMA_VERSION, "east-123", "us-east", now, {}, {})
        await client.hset(redis_keys.gateway_load, "east-123", encode(report))
        update = PrefixUpdate(
            SCHEMA_VERSION, "east-123", 1, tuple(index.chunk_hashes(text("y", 4))), now + 0.01
        )
        await client.xadd(
            redis_keys.prefix_stream,
            {
                sharing_module.PREFIX_STREAM_GATEWAY_FIELD: b"east-123",
                sharing_module.PREFIX_STREAM_FIELD: encode(update),
            },
        )
        await eventually(lambda: 1 in reader.peer_load)  # claimed
        await client.hdel(redis_keys.gateway_load, "east-123")  # what east's stop() does
        await eventually(lambda: 1 not in reader.peer_load, timeout_s=3.0)


async def test_a_peers_report_age_counts_this_gateways_round_trip_to_redis() -> None:
    """The age is taken when the reports arrive, not before the call: a Redis a WAN away (here
    0.2 s there and back) makes every report at least half of it old, which the gauge shows."""
    written_at: list[float] = []

    class SlowPipeline:
        def hset(self, *args: object) -> None: ...

        def hgetall(self, *args: object) -> None: ...

        async def execute(self) -> list[object]:
            await asyncio.sleep(0.1)  # the call on its way
            written_at.append(time.time())  # at Redis: the peer's report, written just now
            entries = {
                b"east": encode(GatewayLoad(SCHEMA_VERSION, "east", "us-east", written_at[-1], {1: 1}, {}))
            }
            await asyncio.sleep(0.1)  # the answer on its way back
            return [1, entries]

    class SlowRedis:
        def pipeline(self, transaction: bool = False) -> SlowPipeline:
            return SlowPipeline()

    sharing = GatewaySharing(
        SlowRedis(),  # type: ignore[arg-type]
        RedisKeys(prefix="unused"),
        gateway_id="west",
        region="us-east",
        index=ApproxPrefixIndex(),
        load_source=no_load,
    )
    await sharing._exchange_load_once()
    assert sharing.peer_report_age_s["east"] >= 0.09  # 0.0 before: the age was taken before the call


async def test_a_peers_report_with_impossible_counts_is_not_counted(
    client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    """A report whose counts no gateway can have (a broken or hostile peer, a corrupted entry) is
    left out like one that does not decode. Before, it was summed in: a count past what a float
    holds (10**400 prefill tokens) raised OverflowError in every gorgo decision over that model on
    every gateway reading it, and a negative count (-1000 requests) cancelled the real load on its
    node, which then looked empty to the capacity guard and the queue term."""
    now_s = time.time()
    fine = GatewayLoad(SCHEMA_VERSION, "fine", "eu-central", now_s, {3: 2}, {3: 100})
    huge = GatewayLoad(SCHEMA_VERSION, "huge", "eu-central", now_s, {1: 1}, {1: 10**400})
    negative = GatewayLoad(SCHEMA_VERSION, "negative", "eu-central", now_s, {2: -1000}, {2: -(10**9)})
    await client.hset(
        redis_keys.gateway_load,
        mapping={"fine": encode(fine), "huge": encode(huge), "negative": encode(negative)},
    )
    west = gateway(client, redis_keys, "west")
    await west._exchange_load_once()
    assert dict(west.peer_load) == {3: NodeLoad(2, 100)}

    nodes = tuple(make_node(node_id) for node_id in (1, 2, 3))
    view = RoutingView("us-east", nodes, GorgoParams(), dict(west.peer_load))
    gorgo.choose(view, RoutingRequest(MODEL, 4_000, 1_000))  # OverflowError before


def test_a_peer_whose_clock_is_ahead_does_not_empty_this_gateways_index() -> None:
    """A peer's update is applied at its own time stamp, and the index expires a node's entries
    older than the newest time less the TTL. A peer whose clock ran 20 minutes ahead (no NTP on
    its host; the TTL is 10) thus made every gateway reading it forget everything else it knew of
    that node: a warm node priced as a miss, the hot-prefix and miss-snowball guards working on
    nothing. Its entries also outlived the TTL by its skew. An update stamped after this
    gateway's now is applied as arriving now."""
    now_s = 1_700_000_000.0
    index = ApproxPrefixIndex(chars_per_token=4.0, clock=lambda: now_s)
    sharing = GatewaySharing(
        None,  # type: ignore[arg-type]  # applying a stream entry needs no Redis
        RedisKeys(prefix="unused"),
        gateway_id="west",
        region="us-east",
        index=index,
        load_source=no_load,
        clock=lambda: now_s,
    )
    ours, theirs = text("ours", 4), text("theirs", 3)
    index.insert(1, ours)  # sent by this gateway a moment ago
    ahead = PrefixUpdate(SCHEMA_VERSION, "east", 1, tuple(index.chunk_hashes(theirs)), now_s + 1_200)
    sharing._apply_entry({b"g": b"east", b"u": encode(ahead)})
    assert sharing.updates_applied == 1
    assert index.match([1], ours) == {1: 4 * CHUNK_BYTES // 4}  # {} before: evicted
    assert index.match([1], theirs) == {1: 3 * CHUNK_BYTES // 4}
    later = index.match_hashes(index.chunk_hashes(theirs), [1], now_s + index.ttl_s + 1)
    assert later == {}  # expires a TTL after it arrived, not after the peer's clock says
