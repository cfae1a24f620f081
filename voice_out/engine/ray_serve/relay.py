"""The text relay: how an utterance's later text deltas reach the replica serving it.

Ray Serve routes every handle call on its own (power of two choices over queue lengths), so a
second call carrying a delta could land on another replica. The utterance's one streaming call
therefore *pulls* its later text: the front owns one relay actor (an async Ray actor on the
front's node, no CPU reserved) holding a queue per utterance; ``RayStream.push_text`` posts to
it without waiting, and the replica's feeder long-polls ``take`` for its utterance. Ray Serve's
own bidirectional gRPC streaming does the same between its proxy actor and a replica.

Cost: a delta pushed after the call left takes one local actor call and one long-poll reply
(the replica's host to the front's) to reach the engine, instead of one; the first delta rides
the call itself. One relay serves every utterance of its front; it dies with the front.

:class:`TextChannels` is the relay's logic (no Ray: tested alone); :func:`relay_actor` wraps it
as the actor.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from voice_out.engine.ray_serve.messages import TextEvent

#: A long poll returns empty after this long, so a replica that died mid-poll costs nothing.
TAKE_TIMEOUT_S = 10.0
#: A closed utterance's id is remembered this long, so that a late post does not revive it.
CLOSED_MEMORY_S = 120.0
#: A channel nobody touched this long is dropped (its front or replica went away unannounced).
IDLE_DROP_S = 600.0


@dataclass
class _Channel:
    next_seq: int = 0
    ready: list[TextEvent] = field(default_factory=list)
    #: batches that arrived before an earlier one (actor calls may run out of order)
    early: dict[int, list[TextEvent]] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    touched: float = 0.0


class TextChannels:
    """One ordered queue of :class:`TextEvent` s per utterance id.

    The front posts numbered batches (``seq`` 0, 1, ...), the replica takes everything ready.
    Runs on one event loop (the relay actor's); not thread-safe.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._channels: dict[str, _Channel] = {}
        self._closed: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._channels)

    def _channel(self, stream_id: str) -> _Channel | None:
        now = self._clock()
        self._prune(now)
        if stream_id in self._closed:
            return None
        ch = self._channels.get(stream_id)
        if ch is None:
            ch = self._channels[stream_id] = _Channel()
        ch.touched = now
        return ch

    def _prune(self, now: float) -> None:
        for sid in [s for s, t in self._closed.items() if now - t > CLOSED_MEMORY_S]:
            del self._closed[sid]
        for sid in [s for s, ch in self._channels.items() if now - ch.touched > IDLE_DROP_S]:
            self.close(sid)

    def post(self, stream_id: str, seq: int, events: list[TextEvent]) -> None:
        """Batch ``seq`` of ``stream_id``'s events (front). Dropped once the id is closed."""
        ch = self._channel(stream_id)
        if ch is None or seq < ch.next_seq:
            return
        ch.early[seq] = list(events)
        while ch.next_seq in ch.early:
            ch.ready.extend(ch.early.pop(ch.next_seq))
            ch.next_seq += 1
        if ch.ready:
            ch.wake.set()

    async def take(self, stream_id: str, timeout_s: float = TAKE_TIMEOUT_S) -> list[TextEvent] | None:
        """Every event ready for ``stream_id``, in order, waiting up to ``timeout_s`` for one
        (replica). ``[]``: none yet, ask again; None: the utterance is closed, stop asking."""
        ch = self._channel(stream_id)
        if ch is None:
            return None
        if not ch.ready:
            ch.wake.clear()
            try:
                await asyncio.wait_for(ch.wake.wait(), timeout_s)
            except TimeoutError:
                pass
            if self._channels.get(stream_id) is not ch:
                return None  # closed while waiting
        out, ch.ready = ch.ready, []
        return out

    def close(self, stream_id: str) -> None:
        """The utterance ended (front): drop its queue, wake its poller (which gets None)."""
        self._closed[stream_id] = self._clock()
        ch = self._channels.pop(stream_id, None)
        if ch is not None:
            ch.wake.set()


class TextRelay:
    """The relay actor's class (see the module docstring); every method runs on the actor's
    event loop."""

    def __init__(self) -> None:
        self._channels = TextChannels()

    # async although they never wait: then Ray runs them on the loop that runs ``take``
    async def post(self, stream_id: str, seq: int, events: list[TextEvent]) -> None:
        self._channels.post(stream_id, seq, events)

    async def take(self, stream_id: str) -> list[TextEvent] | None:
        return await self._channels.take(stream_id)

    async def close(self, stream_id: str) -> None:
        self._channels.close(stream_id)

    async def open_channels(self) -> int:
        return len(self._channels)


def relay_actor(node_id: str | None) -> Any:
    """Start a relay actor on ``node_id`` (the front's node; None: anywhere). Needs Ray
    initialized; returns its actor handle. The actor dies with the process that started it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy: Any = "DEFAULT"
    if node_id is not None:
        strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=True)
    # max_concurrency: every open utterance holds one long poll here
    actor_cls = ray.remote(num_cpus=0, max_concurrency=10_000, scheduling_strategy=strategy)(TextRelay)
    return actor_cls.remote()
