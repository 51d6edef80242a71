"""gorgo's KV-event relay: binds the endpoint a connect-out vLLM sends its events to, and re-publishes
them on a PUB socket every gateway subscribes to.

vLLM binds its KV-events endpoint only when it contains ``*``, ``::`` or ``ipc://``/``inproc://``
(``tcp://*:5557``); for any other address (``tcp://10.0.0.9:5557``) it connects out, and the
consumer must bind. Only one socket can bind that address, yet every gateway needs every event: so
one relay per such node binds it (``--listen``, a SUB socket vLLM's PUB connects to) and binds a
PUB socket of its own (``--publish``) which the node's ``kv_events_endpoint`` names for the
gateways. Frames pass unchanged (topic, sequence, payload). When vLLM's connection drops (it
stopped or is restarting) the relay sends ``PUBLISHER_GONE_SEQ`` so the gateways forget the node's
blocks at once, and when one connects ``PUBLISHER_JOINED_SEQ``, so they replay what it holds at once;
a restart it missed still shows as the sequence going back to 0 (``subscriber``). Replay is not
relayed: vLLM always binds its replay endpoint, gateways reach it directly.

    python -m routing.cache.kv_relay --listen tcp://*:5557 --publish tcp://*:5567

Run it next to the gateways (one per connect-out node, a few MB each); it keeps no state, so a
restart loses only what was in flight (the gateways see a gap and replay it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass

import zmq
import zmq.asyncio

logger = logging.getLogger("routing.kv_relay")

HWM_MESSAGES = 100_000  # as the gateways' SUB sockets: a burst of batches is queued, not dropped
# Sent to the gateways when a vLLM publisher disconnects (it stopped, or is restarting): topic b"",
# this sequence number, empty payload. vLLM never sends a negative sequence on its PUB socket.
PUBLISHER_GONE_SEQ = -2
# Sent when a vLLM publisher connects (a new process, or the same one back): the gateways replay
# what it holds at once, instead of waiting for its next batch, which may be a while, and which
# ZMQ may drop anyway: vLLM's PUB drops what it sends before the relay's subscription reaches it.
PUBLISHER_JOINED_SEQ = -3


@dataclass(slots=True)
class RelayStats:
    """What the relay passed on (for its log line and tests)."""

    messages: int = 0
    publishers_connected: int = 0  # vLLM processes that connected since the start


class KVRelay:
    """One connect-out node's events, from the address it connects to, to every gateway."""

    def __init__(self, listen: str, publish: str, context: zmq.asyncio.Context | None = None) -> None:
        self.listen = listen
        self.publish = publish
        self.stats = RelayStats()
        self._own_context = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._pub = self._ctx.socket(zmq.PUB)
        for socket in (self._sub, self._pub):
            socket.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, HWM_MESSAGES)
        self._pub.setsockopt(zmq.SNDHWM, HWM_MESSAGES)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: the gateways filter their own
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._sub.bind(listen)
        self._pub.bind(publish)
        self._task: asyncio.Task[None] | None = None

    @property
    def listen_endpoint(self) -> str:
        """The bound listen address (the real port when ``listen`` asked for port 0)."""
        return self._sub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def publish_endpoint(self) -> str:
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="gorgo-kv-relay")

    async def _run(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            if self._monitor in ready:
                frames = await self._monitor.recv_multipart()
                event = int.from_bytes(frames[0][:2], "little")
                if event == zmq.EVENT_ACCEPTED:
                    self.stats.publishers_connected += 1
                    logger.info("a vLLM publisher connected to %s", self.listen)
                    marker = PUBLISHER_JOINED_SEQ
                else:
                    # The gateways' own connection (to us) stays up: tell them, so they forget
                    # the node's blocks now rather than at the new process's first batch.
                    logger.info("a vLLM publisher disconnected from %s", self.listen)
                    marker = PUBLISHER_GONE_SEQ
                with contextlib.suppress(zmq.Again):
                    await self._pub.send_multipart(
                        (b"", marker.to_bytes(8, "big", signed=True), b""), flags=zmq.NOBLOCK
                    )
            if self._sub in ready:
                frames = await self._sub.recv_multipart()
                with contextlib.suppress(zmq.Again):  # no gateway keeps up: drop, they see a gap
                    await self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
                self.stats.messages += 1

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)
        self._pub.close(linger=0)
        if self._own_context:
            self._ctx.term()


async def _main(listen: str, publish: str) -> None:
    relay = KVRelay(listen, publish)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    relay.start()
    logger.info(
        "relaying KV events from %s (vLLM connects here) to %s", relay.listen_endpoint, relay.publish_endpoint
    )
    await stop.wait()
    await relay.close()
    logger.info("stopped after %d messages", relay.stats.messages)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m routing.cache.kv_relay",
        description="Bind the KV-events endpoint a connect-out vLLM sends to; re-publish for every gateway.",
    )
    parser.add_argument(
        "--listen", required=True, help="the address vLLM connects to, bound here (tcp://*:5557)"
    )
    parser.add_argument("--publish", required=True, help="where gateways subscribe (tcp://*:5567)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_main(args.listen, args.publish))


if __name__ == "__main__":
    main()
