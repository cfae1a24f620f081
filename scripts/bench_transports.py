"""First audio at the client, per transport, next to the engine's own time to first audio.

One process: the engine (random weights, forced tokens, as ``voice-out bench``), the aiohttp
app on loopback, and the clients. For N concurrent streams, all started together, each round
measures, from the moment the client sends the whole text:

* ``engine``: ``open_stream`` + ``push_text`` + ``end_text`` -> the first PCM chunk (in process);
* ``elevenlabs``: the multi-context WebSocket (``pcm_24000``; context open, text, flush and
  close in one burst) -> the first message with audio;
* ``openai``: ``POST /v1/audio/speech`` (``response_format=pcm``, ``stream_format=audio``) ->
  the first body bytes, on a new connection (skipped when the server has no such route);
* ``openai_warm``: the same on a connection opened before the clock starts (an agent's
  pooled HTTP client; the WebSocket's handshake is outside its clock too).

Each row also splits the time where the server sees it (the engine the app serves is wrapped
to stamp each stream): ``arrive`` is from the round's start (the N requests are sent in one
event-loop tick) to ``end_text`` on the engine stream (engine and ``openai`` only: the other
clocks start after a connect), ``engine part`` from there to the engine's first chunk; the rest
of a client's time is delivery. When a transport's ``engine part`` exceeds the engine mode's,
the engine served that arrival pattern more slowly (e.g. requests that missed a step), which
is not the transport's own per-request cost.

After its first audio each stream is cancelled (the WebSocket by a second ``close_context``,
HTTP by closing the response), so every stream of a round competes with the same load. Rounds
of the modes alternate. The transport's cost is its p50 minus the engine's p50.

    python scripts/bench_transports.py --model random:0.5b --device cuda --streams 1,16 --reps 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from voice_out.bench.engine_bench import EngineBenchOptions, engine_from_args, text_of
from voice_out.engine.engine import Engine
from voice_out.server.app import create_app

VOICE = "noise"


@dataclass
class Stamps:
    """Per stream opened: when its text ended (perf_counter s), and from then to its first
    chunk (s)."""

    ended: list[float] = field(default_factory=list)
    engine: list[float] = field(default_factory=list)


class StampedStream:
    def __init__(self, inner: Any, stamps: Stamps) -> None:
        self.inner = inner
        self.stamps = stamps
        self.ended = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def end_text(self) -> None:
        self.inner.end_text()
        self.ended = time.perf_counter()
        self.stamps.ended.append(self.ended)

    async def __aiter__(self) -> AsyncIterator[Any]:
        first = True
        async for chunk in self.inner:
            if first:
                self.stamps.engine.append(time.perf_counter() - self.ended)
                first = False
            yield chunk


class StampedEngine:
    """The engine as the app sees it, each stream stamped in :class:`Stamps` (event loop only)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stamps = Stamps()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def __aenter__(self) -> StampedEngine:
        await self.engine.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.engine.__aexit__(*exc)

    def open_stream(self, *args: Any, **kwargs: Any) -> StampedStream:
        return StampedStream(self.engine.open_stream(*args, **kwargs), self.stamps)


async def engine_first(engine: Engine | StampedEngine, text: str) -> float:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    stream = engine.open_stream(VOICE)
    stream.push_text(text)
    stream.end_text()
    try:
        async for _ in stream:
            return loop.time() - t0
        raise RuntimeError("the stream ended without audio")
    finally:
        stream.cancel()


async def elevenlabs_first(http: aiohttp.ClientSession, base: str, text: str, n: int) -> float:
    loop = asyncio.get_running_loop()
    url = f"ws://{base}/v1/text-to-speech/{VOICE}/multi-stream-input?output_format=pcm_24000"
    async with http.ws_connect(url) as ws:
        ctx = f"c{n}"
        t0 = loop.time()
        await ws.send_str(json.dumps({"text": " ", "context_id": ctx}))
        await ws.send_str(json.dumps({"text": text, "context_id": ctx}))
        await ws.send_str(json.dumps({"flush": True, "context_id": ctx}))
        await ws.send_str(json.dumps({"close_context": True, "context_id": ctx}))
        async for msg in ws:
            data = json.loads(msg.data)
            if data.get("audio"):
                dt = loop.time() - t0
                break
            if data.get("isFinal") or data.get("error"):
                raise RuntimeError(f"no audio: {data}")
        else:
            raise RuntimeError("the socket closed without audio")
        await ws.send_str(json.dumps({"close_context": True, "context_id": ctx}))  # interrupt
        async for msg in ws:
            if json.loads(msg.data).get("isFinal"):
                break
        return dt


async def openai_first(http: aiohttp.ClientSession, base: str, text: str, n: int, warm: bool = False) -> float:
    loop = asyncio.get_running_loop()
    body = {"model": "voice_out", "input": text, "voice": VOICE, "response_format": "pcm", "stream_format": "audio"}
    if warm:  # one connection of its own, opened and kept alive before the clock starts
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as own:
            async with own.get(f"http://{base}/healthz") as r:
                await r.read()
            await asyncio.sleep(0.2)  # every stream's connection is open before any clock starts
            return await openai_first(own, base, text, n)
    t0 = loop.time()
    async with http.post(f"http://{base}/v1/audio/speech", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        await r.content.readany()
        dt = loop.time() - t0
        r.close()  # hang up: the server cancels the stream
    return dt


async def has_openai(http: aiohttp.ClientSession, base: str) -> bool:
    async with http.post(f"http://{base}/v1/audio/speech", data=b"{}") as r:
        return r.status not in (404, 405)


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] if len(values) > 1 else values[0]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    streams = tuple(int(s) for s in args.streams.split(","))
    opts = EngineBenchOptions(streams=streams, ttfa_chars=args.chars, capacity_chars=args.chars, long_chars=args.chars)
    engine = engine_from_args(args.model, args.device, args.set, opts)
    stamped = StampedEngine(engine)
    app = create_app(engine.config, stamped, None, web_dir=None)
    runner = web.AppRunner(app)
    await runner.setup()  # enters the engine: worker started, warmed up
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"127.0.0.1:{runner.addresses[0][1]}"
    text = text_of(args.chars)
    results: dict[str, Any] = {"model": args.model, "device": args.device, "chars": args.chars, "rounds": {}}
    try:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as http:
            modes: dict[str, Callable[[int], Awaitable[float]]] = {
                "engine": lambda n: engine_first(stamped, text),
                "elevenlabs": lambda n: elevenlabs_first(http, base, text, n),
            }
            if await has_openai(http, base):
                modes["openai"] = lambda n: openai_first(http, base, text, n)
                modes["openai_warm"] = lambda n: openai_first(http, base, text, n, warm=True)
            else:
                print("no POST /v1/audio/speech on this server: openai skipped", file=sys.stderr)
            for n in streams:
                samples: dict[str, list[float]] = {m: [] for m in modes}
                split: dict[str, dict[str, list[float]]] = {m: {"arrive": [], "engine": []} for m in modes}
                for rep in range(args.warmup + args.reps):
                    for mode, first in modes.items():
                        stamped.stamps = Stamps()
                        t0 = time.perf_counter()
                        got = await asyncio.gather(*(first(i) for i in range(n)))
                        await engine.await_idle()
                        if rep >= args.warmup:
                            samples[mode] += [1000.0 * s for s in got]
                            st = stamped.stamps
                            if mode in ("engine", "openai"):  # the others' clocks start after a connect
                                split[mode]["arrive"] += [1000.0 * (e - t0) for e in st.ended]
                            split[mode]["engine"] += [1000.0 * e for e in st.engine]
                row = {m: {"p50": quantile(v, 0.5), "p95": quantile(v, 0.95), "n": len(v)} for m, v in samples.items()}
                for m in modes:
                    if split[m]["arrive"]:
                        row[m]["arrive_p50"] = quantile(split[m]["arrive"], 0.5)
                        row[m]["arrive_max"] = max(split[m]["arrive"])
                    if split[m]["engine"]:
                        row[m]["engine_p50"] = quantile(split[m]["engine"], 0.5)
                    if m != "engine":
                        row[m]["over_engine_p50"] = row[m]["p50"] - row["engine"]["p50"]
                results["rounds"][str(n)] = row
                print(
                    f"streams={n}: "
                    + "  ".join(
                        f"{m} p50 {r['p50']:.1f} p95 {r['p95']:.1f} ms"
                        + (
                            f" (arrive p50 {r['arrive_p50']:.1f} max {r['arrive_max']:.1f})"
                            if "arrive_p50" in r
                            else ""
                        )
                        + (f" (engine part p50 {r['engine_p50']:.1f})" if "engine_p50" in r else "")
                        for m, r in row.items()
                    )
                )
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chars", type=int, default=100)
    ap.add_argument("--set", action="append", default=[], help="SECTION.FIELD=VALUE")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    t_start = time.time()
    out = asyncio.run(main(a))
    out["wall_s"] = round(time.time() - t_start, 1)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
