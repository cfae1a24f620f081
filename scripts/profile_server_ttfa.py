"""Where the server's time to first audio goes, hop by hop, over real WebRTC on loopback.

Runs the real server app (``create_app``) and the aiortc client of ``voice_out.client`` in one
process, as ``voice-out bench --mode webrtc`` does, and sends utterances the way the benchmark
does (text.delta messages of 4 characters back to back, then text.done). The engine is either

* ``--engine delay`` (default): real :class:`~voice_out.engine.stream.EngineStream` handles
  and outboxes, served by a worker thread whose first chunk of an utterance is ready a fixed
  time after the utterance's first text reaches it. ``--worker sleep``: exactly
  ``--delay-ms`` later, waiting with the GIL released (a worker waiting on the GPU);
  ``step``: after ``--delay-ms`` worth of steps, each holding the GIL for ``--hold-ms`` (host
  work) then releasing it for ``--release-ms`` (waiting on the GPU), going on for 0.1 s after
  the first chunk, as the real worker does; ``spin``: steps of 5 ms that never release the
  GIL (a worst case, not a GPU worker);
* ``--engine real``: the real engine, loaded as the benchmark loads it (``--model
  random:tiny --device cpu``).

For each utterance it records, on one clock (``time.monotonic``): the client's send of the
first delta, the server's receipt and parse of it, ``push_text``, the worker's receipt of the
first text, the delivery of the first chunk into the stream's outbox, its push into the track,
the first frame built after the delivery, and the frame that carried it (the ``audio.started``
time). It prints the median (mean, max) of every hop, the server's own TTFA
(``audio.started.ttfa_ms``), and that TTFA less the engine's own time (worker has the text ->
chunk delivered) and less the wait for the next frame (the 20 ms tick): what the transport
adds. ``--direct`` also pushes the same text into the engine in-process (4-character deltas,
and whole), before, during and after the session, and with ``--engine real`` prints the
engine's own first-audio traces of each group.

    python scripts/profile_server_ttfa.py --reps 30 [--delay-ms 60] [--worker step --hold-ms 0.4 --release-ms 1.3]
    python scripts/profile_server_ttfa.py --engine real --model random:tiny --device cpu --reps 15 [--direct]
    python scripts/profile_server_ttfa.py --engine real --model random:0.5b --device cuda --prompt-tokens 150 --direct
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import statistics
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.client import VoiceOutClient, connect  # noqa: E402
from voice_out.config import Config  # noqa: E402
from voice_out.engine import stream as stream_mod  # noqa: E402
from voice_out.engine.api import SAMPLE_RATE, PcmChunk  # noqa: E402
from voice_out.engine.request import RequestStatus  # noqa: E402
from voice_out.engine.stream import EngineStream  # noqa: E402
from voice_out.engine.worker import Cancel, EndOfStream, EndText, Message, Open, Text  # noqa: E402
from voice_out.server import protocol as p  # noqa: E402
from voice_out.server import session as session_mod  # noqa: E402
from voice_out.server import track as track_mod  # noqa: E402
from voice_out.server.app import create_app  # noqa: E402

TEXT = "Sure, I can help with that. Your order shipped this morning and should arrive on Thursday. "


def now() -> float:
    return time.monotonic()


# --------------------------------------------------------------------------------------------
# Timestamps of one utterance


@dataclass
class Marks:
    sent: float | None = None  # client: first delta sent
    received: float | None = None  # server: first delta's Session.receive entered
    parsed: float | None = None  # server: first delta parsed
    pushed_text: float | None = None  # server: first EngineStream.push_text
    last_received: float | None = None  # server: text.done's Session.receive entered
    worker_text: float | None = None  # delay engine: the worker took the first Text
    delivered: float | None = None  # the first chunk was handed to the stream's outbox
    track_push: float | None = None  # it was pushed into the track (by the pump, or at a frame)
    next_build: float | None = None  # the first frame built after it was delivered
    missed: int | None = None  # frames built after its delivery that did not carry it
    started: float | None = None  # the frame that carried it was built (audio.started's time)
    ttfa_ms: float | None = None  # audio.started.ttfa_ms as the client received it


MARKS: dict[str, Marks] = {}


def marks_of(stream_or_uid: str) -> Marks:
    uid = stream_or_uid.rsplit("/", 1)[-1]
    return MARKS.setdefault(uid, Marks())


def instrument() -> None:
    """Wrap the hops of the server with timestamping shims (this process only)."""
    orig_receive = session_mod.Session.receive
    orig_parse = p.parse

    def receive(self: session_mod.Session, raw: str | bytes, reply: Any = None) -> None:
        t = now()
        try:
            msg = json.loads(raw)
            m = marks_of(str(msg.get("id")))
            if msg.get("type") == "text.delta" and m.received is None:
                m.received = t
            if msg.get("type") == "text.done":
                m.last_received = t
        except (ValueError, AttributeError):
            pass
        orig_receive(self, raw, reply)

    def parse(text: str | bytes) -> p.ClientMessage:
        msg = orig_parse(text)
        if isinstance(msg, p.TextDelta):
            m = marks_of(msg.id)
            if m.parsed is None:
                m.parsed = now()
        return msg

    orig_push_text = EngineStream.push_text

    def push_text(self: EngineStream, delta: str) -> None:
        m = marks_of(self.id)
        if m.pushed_text is None:
            m.pushed_text = now()
        orig_push_text(self, delta)

    orig_deliver = stream_mod._Outbox.deliver

    def deliver(self: stream_mod._Outbox, item: PcmChunk | EndOfStream) -> None:
        uid = getattr(self, "uid", None)
        if uid is not None and isinstance(item, PcmChunk) and item.start_sample == 0:
            marks_of(uid).delivered = now()
        orig_deliver(self, item)

    orig_track_push = track_mod.UtteranceTrack.push

    def track_push(self: track_mod.UtteranceTrack, uid: str, chunk: PcmChunk) -> None:
        m = marks_of(uid)
        if m.track_push is None and chunk.start_sample == 0:
            m.track_push = now()
        orig_track_push(self, uid, chunk)

    orig_next_frame = track_mod.UtteranceTrack.next_frame

    builds: dict[int, deque[float]] = {}

    def next_frame(self: track_mod.UtteranceTrack, now: float) -> tuple[np.ndarray, list[track_mod.TrackEvent]]:
        built = builds.setdefault(id(self), deque(maxlen=64))
        built.append(now)
        out, events = orig_next_frame(self, now)
        for ev in events:
            if isinstance(ev, track_mod.Started):
                m = marks_of(ev.id)
                m.started = ev.t
                if m.delivered is not None:
                    after = [b for b in built if b >= m.delivered]
                    m.next_build = after[0] if after else None
                    m.missed = sum(1 for b in after if b < ev.t)
        return out, events

    session_mod.Session.receive = receive  # type: ignore[method-assign]
    p.parse = parse
    EngineStream.push_text = push_text  # type: ignore[method-assign]
    stream_mod._Outbox.deliver = deliver  # type: ignore[method-assign]
    track_mod.UtteranceTrack.push = track_push  # type: ignore[method-assign]
    track_mod.UtteranceTrack.next_frame = next_frame  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------
# An engine whose first chunk is ready a fixed time after the first text reaches it


class DelayEngine:
    """``EngineLike`` over real ``EngineStream`` handles and one worker thread (see the module
    docstring). Each stream speaks 0.5 s of a tone at ``delay_s`` after its first text, and
    0.5 s more (final) once its text has ended and the first chunk is out."""

    def __init__(
        self, delay_s: float, worker: str, hold_s: float = 0.0, release_s: float = 0.0, busy_after_s: float = 0.1
    ) -> None:
        self.delay_s = delay_s
        self.worker = worker
        self.hold_s = hold_s if worker == "step" else 0.005 if worker == "spin" else 0.0
        self.release_s = release_s if worker == "step" else 0.0
        self.busy_after_s = busy_after_s
        self._inbox: queue.Queue[Message | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._n = 0

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    @property
    def ready(self) -> bool:
        return self._thread is not None

    def voice_names(self) -> list[str]:
        return ["tone"]

    def open_stream(
        self,
        voice: str | None = None,
        *,
        stream_id: str | None = None,
        seed: int | None = None,
        auto_ack: bool = True,
        fast_first: int | None = None,
    ) -> EngineStream:
        self._n += 1
        sid = stream_id or f"s{self._n}"
        s = EngineStream(sid, "tone", send=self._inbox.put, post=self._inbox.put, max_text_chars=4000, auto_ack=False)
        s.outbox.uid = sid  # type: ignore[attr-defined]
        self._inbox.put(Open(sid, None, 0, s.outbox))  # type: ignore[arg-type]
        return s

    async def __aenter__(self) -> DelayEngine:
        self._thread = threading.Thread(target=self._run, name="delay-worker", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None

    def _run(self) -> None:
        @dataclass
        class S:
            sink: stream_mod._Outbox
            due: float | None = None  # sleep worker: when the first chunk is ready
            steps_left: int = 0  # step and spin workers: steps of work before it is ready
            first_out: float | None = None
            ended: bool = False

        streams: dict[str, S] = {}
        tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(SAMPLE_RATE // 2) / SAMPLE_RATE)).astype(np.float32)
        while True:
            t = now()
            # "busy": a stream has text and its first chunk is not out, or went out less than
            # busy_after_s ago (the real worker goes on stepping after the first chunk)
            busy = self.worker != "sleep" and any(
                s.due is not None and (s.first_out is None or t - s.first_out < self.busy_after_s)
                for s in streams.values()
            )
            msg: Message | None = Message()
            if busy:
                # one step: host work holding the GIL, then a wait with the GIL released
                end = t + self.hold_s
                while now() < end:
                    pass
                if self.release_s > 0:
                    time.sleep(self.release_s)
                for s in streams.values():
                    s.steps_left -= 1
                with contextlib.suppress(queue.Empty):
                    msg = self._inbox.get_nowait()
            else:
                dues = [s.due for s in streams.values() if s.due is not None and s.first_out is None]
                timeout = max(0.0, min(dues) - t) if dues else None
                with contextlib.suppress(queue.Empty):
                    msg = self._inbox.get(timeout=timeout)
            while msg is not None:
                if isinstance(msg, Open):
                    streams[msg.request_id] = S(msg.sink)  # type: ignore[arg-type]
                elif isinstance(msg, Text):
                    st = streams.get(msg.request_id)
                    if st is not None and st.due is None:
                        marks_of(msg.request_id).worker_text = now()
                        st.due = now() + self.delay_s
                        st.steps_left = max(1, round(self.delay_s / (self.hold_s + self.release_s or 1.0)))
                elif isinstance(msg, EndText):
                    if msg.request_id in streams:
                        streams[msg.request_id].ended = True
                elif isinstance(msg, Cancel):
                    streams.pop(msg.request_id, None)
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    break
            if msg is None:
                return
            for rid, s in list(streams.items()):
                ready = s.steps_left <= 0 if self.worker != "sleep" else s.due is not None and now() >= s.due
                if s.due is not None and s.first_out is None and ready:
                    s.first_out = now()
                    s.sink.deliver(PcmChunk(tone, 0, 1))
                if s.first_out is not None and s.ended and now() - s.first_out >= self.busy_after_s:
                    s.sink.deliver(PcmChunk(tone, len(tone), 2, final=True))
                    s.sink.deliver(EndOfStream(RequestStatus.FINISHED))
                    del streams[rid]


def instrument_real_outbox() -> None:
    """Name each real engine outbox after its stream (for the delivery timestamp)."""
    from voice_out.engine.engine import Engine

    orig_open = Engine.open_stream

    def open_stream(self: Engine, *args: Any, **kwargs: Any) -> EngineStream:
        s = orig_open(self, *args, **kwargs)
        s.outbox.uid = s.id  # type: ignore[attr-defined]
        return s

    Engine.open_stream = open_stream  # type: ignore[method-assign]

    from voice_out.engine.scheduler import Scheduler

    orig_sched_push = Scheduler.push_text

    def sched_push(self: Scheduler, request_id: str, delta: str) -> None:
        m = marks_of(request_id)
        if m.worker_text is None:
            m.worker_text = now()
        orig_sched_push(self, request_id, delta)

    Scheduler.push_text = sched_push  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------
# The run


async def one(engine: Any, client: VoiceOutClient, uid: str, chars: int, delta_chars: int) -> None:
    text = (TEXT * (chars // len(TEXT) + 1))[:chars]
    deltas = [text[k : k + delta_chars] for k in range(0, len(text), delta_chars)]
    m = marks_of(uid)
    m.sent = client.send_text(uid, deltas[0])
    for d in deltas[1:]:
        client.send_text(uid, d)
    client.done(uid)
    started = await client.wait_for(
        lambda msg: isinstance(msg, p.AudioStarted | p.Error) and getattr(msg, "id", None) == uid, timeout_s=120
    )
    if isinstance(started, p.Error):
        raise RuntimeError(f"{uid}: {started.code}: {started.message}")
    assert isinstance(started, p.AudioStarted)
    m.ttfa_ms = started.ttfa_ms
    await asyncio.sleep(0.1)
    client.cancel()
    await client.wait_for(lambda msg: isinstance(msg, p.Cancelled | p.AudioDone) and msg.id == uid, timeout_s=60)
    if hasattr(engine, "await_idle"):
        await engine.await_idle()  # a step of the cancelled stream may still run (seconds on a CPU)
    # let the tick phase drift against the next utterance's start
    await asyncio.sleep(0.05 + (hash(uid) % 97) / 1000)


HOPS: list[tuple[str, str, str]] = [
    ("client send -> server receive (ICE/DTLS/SCTP)", "sent", "received"),
    ("receive -> parsed", "received", "parsed"),
    ("parsed -> push_text (session start, open_stream)", "parsed", "pushed_text"),
    ("push_text -> the worker has the text", "pushed_text", "worker_text"),
    ("the worker has the text -> first chunk delivered", "worker_text", "delivered"),
    ("first delta received -> first chunk delivered", "received", "delivered"),
    ("first delta received -> text.done received", "received", "last_received"),
    ("delivered -> in the track", "delivered", "track_push"),
    ("delivered -> next frame built (the tick)", "delivered", "next_build"),
    ("next frame built -> the frame carrying it built", "next_build", "started"),
]


def _stats(vals: list[float]) -> str:
    return f"median {statistics.median(vals):7.2f} ms  mean {statistics.fmean(vals):7.2f}  max {max(vals):7.2f}"


def report(marks: list[Marks], log: Callable[[str], None]) -> dict[str, float]:
    """Median (and mean, max) of every hop over ``marks``; returns the medians and means."""
    out: dict[str, float] = {}
    for label, a, b in HOPS:
        vals = [1e3 * (getattr(m, b) - getattr(m, a)) for m in marks if None not in (getattr(m, a), getattr(m, b))]
        if vals:
            out[label] = statistics.median(vals)
            out[label + " (mean)"] = statistics.fmean(vals)
            log(f"{label:<55} {_stats(vals)}  (n={len(vals)})")
    missed = [m.missed for m in marks if m.missed is not None]
    if missed:
        out["frames missed (mean)"] = statistics.fmean(missed)
        log(f"{'frames built after delivery without it':<55} mean {statistics.fmean(missed):5.2f}  (n={len(missed)})")
    ttfa = [m.ttfa_ms for m in marks if m.ttfa_ms is not None]
    if ttfa:
        out["server ttfa"] = statistics.median(ttfa)
        log(f"{'server TTFA (audio.started.ttfa_ms)':<55} {_stats(ttfa)}")
    # what the server adds beyond the engine's own time and the wait for the next frame: the
    # text's way to the worker, the chunk's way into the track, any frame that went out without it
    overhead = [
        m.ttfa_ms - 1e3 * (m.next_build - m.worker_text)
        for m in marks
        if m.ttfa_ms is not None and m.next_build is not None and m.worker_text is not None
    ]
    if overhead:
        out["overhead"] = statistics.median(overhead)
        out["overhead (mean)"] = statistics.fmean(overhead)
        log(f"{'server TTFA - engine (text -> chunk) - tick':<55} {_stats(overhead)}")
    return out


async def direct(engine: Any, uid: str, chars: int, delta_chars: int) -> None:
    """The same deltas pushed into the engine in this process (no WebRTC, no server)."""
    text = (TEXT * (chars // len(TEXT) + 1))[:chars]
    deltas = [text[k : k + delta_chars] for k in range(0, len(text), delta_chars)]
    m = marks_of(uid)
    stream = engine.open_stream(stream_id=uid, auto_ack=False)
    stream.outbox.bind_loop(asyncio.get_running_loop())
    m.received = m.parsed = m.pushed_text = now()
    for d in deltas:
        stream.push_text(d)
    stream.end_text()
    m.last_received = now()
    async for _chunk in stream:
        m.track_push = now()  # the consumer has it
        break
    m.delivered = m.delivered or m.track_push
    stream.cancel()
    if hasattr(engine, "await_idle"):
        await engine.await_idle()
    await asyncio.sleep(0.05 + (hash(uid) % 97) / 1000)


def traces_report(engine: Any, groups: dict[str, list[str]], log: Callable[[str], None]) -> None:
    """The engine's own first-audio phases (ms) of each group of utterances."""
    traces = {t.request_id.rsplit("/", 1)[-1]: t for t in engine.stats().first_audio}
    for name, uids in groups.items():
        ts = [traces[u] for u in uids if u in traces]
        if not ts:
            continue
        med = {
            k: statistics.median(1e3 * getattr(t, k) for t in ts) for k in ("slot_s", "tokens_s", "queue_s", "vocode_s")
        }
        steps = statistics.median(t.llm_steps for t in ts)
        total = statistics.median(1e3 * t.total_s for t in ts)
        parts = "  ".join(f"{k[:-2]} {v:6.1f}" for k, v in med.items())
        log(f"engine trace, {name:<7}: total {total:6.1f} ms  {parts}  llm_steps {steps:g}  (n={len(ts)})")


async def run(args: argparse.Namespace) -> None:
    instrument()
    engine: Any
    cfg = Config()
    if args.engine == "delay":
        engine = DelayEngine(args.delay_ms / 1000, args.worker, args.hold_ms / 1000, args.release_ms / 1000)
    else:
        from voice_out.bench import engine_bench as eb

        instrument_real_outbox()
        eopts = eb.EngineBenchOptions(
            streams=(1,), prompt_tokens=args.prompt_tokens, long_chars=args.chars, threads=args.threads
        )
        over = {"model": {"model": args.model, "device": args.device}}
        from voice_out.config import load_config

        cfg = eb.bench_config(load_config(None, environ={}, overrides=over), eopts)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = eb.load_engine(cfg, eopts)
    runner = web.AppRunner(create_app(cfg, engine, None))
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        # the whole text in-process with no session at all (no RTP flowing): the engine bench's case
        aids = [f"a{i}" for i in range(args.reps)] if args.direct else []
        for aid in aids:
            await direct(engine, aid, args.chars, args.chars)
        client = await connect(f"http://{host}:{port}")
        uids = [f"u{i}" for i in range(args.reps)]
        dids = [f"d{i}" for i in range(args.reps)] if args.direct else []
        wids = [f"t{i}" for i in range(args.reps)] if args.direct else []
        try:
            for i in range(args.warmup):
                await one(engine, client, f"w{i}", args.chars, args.delta_chars)
            # alternate, so that drift of the machine's speed hits every variant alike
            for i, uid in enumerate(uids):
                await one(engine, client, uid, args.chars, args.delta_chars)
                if dids:
                    await direct(engine, dids[i], args.chars, args.delta_chars)
                    await direct(engine, wids[i], args.chars, args.chars)
        finally:
            await client.close()
        # and again once the session has gone: the machine's drift, apart from the session's load
        zids = [f"z{i}" for i in range(args.reps)] if args.direct else []
        await asyncio.sleep(1.0)
        for zid in zids:
            await direct(engine, zid, args.chars, args.chars)
        print(
            f"engine={args.engine} worker={args.worker} hold/release={args.hold_ms}/{args.release_ms} ms "
            f"switch={sys.getswitchinterval() * 1e3:g} ms delay={args.delay_ms} ms reps={args.reps} "
            f"chars={args.chars} delta_chars={args.delta_chars}"
        )
        print("-- over WebRTC (the server's hops)")
        report([MARKS[u] for u in uids], print)
        if dids:
            print("-- the same deltas pushed in-process (no server; the client connected, idle)")
            report([MARKS[u] for u in dids], print)
            print("-- the whole text in one push, in-process")
            report([MARKS[u] for u in wids], print)
            print("-- the whole text in one push, in-process, before any session (no RTP)")
            report([MARKS[u] for u in aids], print)
            print("-- the whole text in one push, in-process, after the session closed (no RTP)")
            report([MARKS[u] for u in zids], print)
        if args.engine == "real":
            traces_report(engine, {"webrtc": uids, "deltas": dids, "whole": wids, "before": aids, "after": zids}, print)
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("delay", "real"), default="delay")
    ap.add_argument("--delay-ms", type=float, default=60.0)
    ap.add_argument("--worker", choices=("sleep", "step", "spin"), default="sleep")
    ap.add_argument("--hold-ms", type=float, default=0.7, help="step worker: host time a step holds the GIL")
    ap.add_argument("--release-ms", type=float, default=0.5, help="step worker: then waits with it released")
    ap.add_argument("--switch-interval-ms", type=float, default=None, help="sys.setswitchinterval for the run")
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-tokens", type=int, default=25, help="real engine: the voice prompt (the bench: 150)")
    ap.add_argument("--threads", type=int, default=1, help="real engine: torch's CPU threads")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--direct", action="store_true", help="also push the text in-process (deltas, whole)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chars", type=int, default=100)
    ap.add_argument("--delta-chars", type=int, default=4)
    args = ap.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    if args.engine == "real":
        import torch

        torch.set_num_threads(args.threads)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
