"""A subscription to one vLLM's KV-cache events (ZMQ PUB/SUB), turned into cache changes in our
keys (``wire/kv_events.py``) for the replica's block index.

vLLM sends each batch as three frames: topic, an 8-byte big-endian sequence number, the msgpack
batch. The sequence tells two things the events do not: a number lower than the last means the
engine started again (its cache is empty: the index is cleared), a jump means batches were lost
(counted; blocks whose parent was lost are skipped until the engine stores them again).

The socket reconnects by itself (ZMQ) to an engine that went away and came back; ZMTP heartbeats
bound how long a dead peer goes unnoticed, and anything that breaks the socket has it made anew
after ``retry_s``. pyzmq is needed only where a replica is configured with ``kv_events``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from qosgate.wire.kv_events import CacheChange, EngineBlocks, decode_batch

log = logging.getLogger("qosgate.kv_events")

HEARTBEAT_MS = 2_000  # a ZMTP ping this often ...
HEARTBEAT_TIMEOUT_MS = 6_000  # ... and the connection dropped (and redialled) without an answer
RECONNECT_MS = 100
RECONNECT_MAX_MS = 5_000


def _zmq() -> Any:
    try:
        import zmq
        import zmq.asyncio
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "upstreams[].kv_events needs pyzmq: pip install 'qosgate[kv-events]'"
        ) from exc
    return zmq


class KVEventFeed:
    """One engine's event stream; ``on_change`` gets each change in the order published."""

    def __init__(
        self,
        replica: str,
        endpoint: str,
        on_change: Callable[[CacheChange], None],
        topic: str = "",
        retry_s: float = 1.0,
    ) -> None:
        self.replica = replica
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.on_change = on_change
        self.retry_s = retry_s
        self.blocks = EngineBlocks()
        self.last_seq: int | None = None
        self.batches = 0
        self.lost = 0  # batches missed (sequence jumps)
        self.restarts = 0  # the engine's sequence began again
        self.skipped = 0  # blocks that could not be keyed
        self.garbled = 0  # batches that did not decode
        self._task: asyncio.Task[None] | None = None
        self._zmq = _zmq()  # fails at start-up, not at the first event, if pyzmq is missing

    @property
    def block_size(self) -> int | None:
        """The engine's block size, once it stored a block."""
        return self.blocks.block_size

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        zmq = self._zmq
        ctx = zmq.asyncio.Context()
        try:
            while True:
                sock = ctx.socket(zmq.SUB)
                try:
                    for opt, value in ((zmq.LINGER, 0), (zmq.RECONNECT_IVL, RECONNECT_MS),
                                       (zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS),
                                       (zmq.HEARTBEAT_IVL, HEARTBEAT_MS),
                                       (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)):
                        sock.setsockopt(opt, value)
                    sock.setsockopt(zmq.SUBSCRIBE, self.topic)
                    sock.connect(self.endpoint)
                    log.info("replica %s: subscribed to KV events at %s", self.replica,
                             self.endpoint)
                    while True:
                        self.receive(await sock.recv_multipart())
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("replica %s: KV events from %s failed; subscribing again",
                                  self.replica, self.endpoint)
                finally:
                    sock.close(linger=0)
                await asyncio.sleep(self.retry_s)
        finally:
            ctx.term()

    def receive(self, frames: list[bytes]) -> None:
        """One published message: ``[topic, seq, payload]``."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.garbled += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last = self.last_seq
        if last is not None and seq <= last:
            # numbered from 0 again: a new engine process, whose cache starts empty
            self.restarts += 1
            self.blocks.reset()
            log.warning("replica %s: KV event sequence restarted (%d after %d): its index is "
                        "cleared", self.replica, seq, last)
            self.on_change(CacheChange(cleared=True))
        elif last is not None and seq > last + 1:
            self.lost += seq - last - 1
            log.warning("replica %s: %d KV event batch(es) lost", self.replica, seq - last - 1)
        self.last_seq = seq
        try:
            events = decode_batch(frames[2])
        except msgspec.DecodeError:
            self.garbled += 1
            return
        self.batches += 1
        for change in self.blocks.apply(events):
            self.skipped += change.skipped
            if not change.empty:
                self.on_change(change)
