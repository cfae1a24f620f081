"""The stream handle of the engine: :class:`EngineStream` and its thread-safe outbox.

The handle is what a transport holds (it implements :class:`voice_out.engine.api.Stream`). Its
methods run on the asyncio thread (or the one thread that owns the stream) and only post typed
messages to the worker; the worker appends the stream's items (``PcmChunk`` ..., then one
``EndOfStream``) to its :class:`_Outbox`, the one object both threads touch, which wakes an
async consumer with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from voice_out.engine.api import (
    EngineError,
    PcmChunk,
    StreamClosedError,
    StreamFailedError,
    StreamState,
    TextTooLongError,
)
from voice_out.engine.request import RequestStatus
from voice_out.engine.worker import Ack, Cancel, EndOfStream, EndText, Message, Text

# --------------------------------------------------------------------------------------------
# Per-stream outbox: the only object both threads touch


class _Outbox:
    """A stream's queue of items from the worker. ``deliver`` (worker) and ``close`` (consumer)
    are thread-safe; once closed, deliveries are dropped."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: collections.deque[PcmChunk | EndOfStream] = collections.deque()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        # the stream's state lives here, not in the stream: the worker holds the outbox, and
        # must not keep an abandoned stream alive (its finalizer cancels it)
        self.state = StreamState.WAITING
        self.error: EngineError | None = None

    def _track(self, item: PcmChunk | EndOfStream) -> None:
        if isinstance(item, PcmChunk):
            if self.state is StreamState.WAITING:
                self.state = StreamState.RUNNING
        else:
            self.state = item.status.stream_state()
            self.error = item.error

    def abort(self) -> bool:
        """Mark the stream ABORTED and close; False when it had already ended."""
        with self._cond:
            ended = self.state.terminal
            if not ended:
                self.state = StreamState.ABORTED
        self.close()
        return not ended

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._items)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        """Called on the loop's thread by the async iterator."""
        with self._cond:
            if self._event is None or self._loop is not loop:
                self._loop, self._event = loop, asyncio.Event()
            return self._event

    def deliver(self, item: PcmChunk | EndOfStream) -> None:
        with self._cond:
            if self._closed:
                return
            self._items.append(item)
            self._track(item)
            self._cond.notify_all()
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass

    def poll(self) -> PcmChunk | EndOfStream | None:
        with self._cond:
            return self._items.popleft() if self._items else None

    def get(self, timeout: float | None = None) -> PcmChunk | EndOfStream | None:
        """Block until an item arrives (None: closed, or ``timeout`` passed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._closed, timeout)
            return self._items.popleft() if self._items else None


# --------------------------------------------------------------------------------------------
# The stream handle


class EngineStream:
    """One utterance (implements :class:`voice_out.engine.api.Stream`).

    Call ``push_text``/``end_text``/``cancel``/``ack`` from the asyncio thread (or the one
    thread that owns the stream); iterate it once, async or plain. With ``auto_ack`` (the
    default) a chunk counts as played when the iterator hands it out; a transport that buffers
    ahead of playback turns it off and calls :meth:`ack` with what was actually played, so that
    back-pressure (``engine.max_ahead_s``) follows the listener.
    """

    def __init__(
        self,
        stream_id: str,
        voice: str,
        *,
        send: Callable[[Message], None],
        post: Callable[[Message], None],
        max_text_chars: int,
        auto_ack: bool,
    ) -> None:
        self._send = send  # to the worker; raises when the engine is stopped
        self._post = post  # to the worker; never raises (cancel paths)
        self._max_text_chars = max_text_chars
        self._id = stream_id
        self._voice = voice
        self._auto_ack = auto_ack
        self._text: list[str] = []
        self._n_chars = 0
        self._ended = False
        self._cancelled = False
        self._iterated = False
        self.outbox = _Outbox()
        self.samples_received = 0
        #: Cancels the stream if it is garbage-collected unfinished (set by the engine).
        self.finalizer: weakref.finalize[Any, Any] | None = None

    # ---- Stream protocol ---------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self._id

    @property
    def voice(self) -> str:
        return self._voice

    @property
    def state(self) -> StreamState:
        return self.outbox.state

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def error(self) -> EngineError | None:
        """Why the stream FAILED (None otherwise)."""
        return self.outbox.error

    def push_text(self, delta: str) -> None:
        """Append ``delta`` to the utterance. Raises StreamClosedError after ``end_text`` or
        ``cancel``, TextTooLongError past ``engine.max_text_chars`` (the text is not taken)."""
        if not isinstance(delta, str):
            raise TypeError(f"delta must be a str, not {type(delta).__name__}")
        if self._cancelled or self._ended or self.state.terminal:
            raise StreamClosedError(f"stream {self._id} no longer takes text")
        limit = self._max_text_chars
        if self._n_chars + len(delta) > limit:
            raise TextTooLongError(f"an utterance may hold at most {limit} characters")
        if not delta:
            return
        self._text.append(delta)
        self._n_chars += len(delta)
        self._send(Text(self._id, delta))

    def end_text(self) -> None:
        """No more text: speak what is left. Idempotent; a no-op after ``cancel``."""
        if self._ended or self._cancelled:
            return
        self._ended = True
        self._send(EndText(self._id))

    def cancel(self) -> None:
        """Stop now (barge-in): see the module docstring. Idempotent, any stage."""
        if self._cancelled:
            return
        self._cancelled = True
        if self.finalizer is not None:
            self.finalizer.detach()
        if self.outbox.abort():
            self._post(Cancel(self._id))

    def ack(self, samples_played: int) -> None:
        """The listener has heard ``samples_played`` samples of this stream (monotone)."""
        if not self._cancelled and not self.state.terminal:
            self._send(Ack(self._id, int(samples_played)))

    def _take(self, item: PcmChunk | EndOfStream) -> PcmChunk | None:
        """Consume one item; None means the iteration ends (raises on failure)."""
        if isinstance(item, PcmChunk):
            self.samples_received = item.start_sample + len(item.pcm)
            if self._auto_ack and not item.final:
                self._send(Ack(self._id, self.samples_received))
            return item
        self.outbox.close()
        if self.finalizer is not None:
            self.finalizer.detach()  # ended: nothing left to cancel
        if item.status is RequestStatus.FAILED:
            err = item.error or StreamFailedError("the stream failed")
            raise err
        return None

    def _start_iteration(self) -> None:
        if self._iterated:
            raise RuntimeError(f"stream {self._id} is already being iterated")
        self._iterated = True

    def __aiter__(self) -> AsyncIterator[PcmChunk]:
        self._start_iteration()
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[PcmChunk]:
        event = self.outbox.bind_loop(asyncio.get_running_loop())
        while True:
            item = self.outbox.poll()
            if item is None:
                if self.outbox.closed:
                    return
                event.clear()
                item = self.outbox.poll()
                if item is None:
                    if self.outbox.closed:
                        return
                    await event.wait()
                    continue
            chunk = self._take(item)
            if chunk is None:
                return
            yield chunk

    def __iter__(self) -> Iterator[PcmChunk]:
        self._start_iteration()
        return self._iter()

    def _iter(self) -> Iterator[PcmChunk]:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            chunk = self._take(item)
            if chunk is None:
                return
            yield chunk

    def __repr__(self) -> str:
        return f"EngineStream(id={self._id!r}, voice={self._voice!r}, state={self.state.value})"
