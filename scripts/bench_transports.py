"""First audio at the client, per transport, next to the engine's own time to first audio.

One process: the engine (random weights, forced tokens, as ``voice-out bench``), the aiohttp
app on loopback, and the clients. For N concurrent streams, all started together, each round
measures, from the moment the client sends the whole text:

* ``engine``: ``open_stream`` + ``push_text`` + ``end_text`` -> the first PCM chunk (in process);
* ``elevenlabs``: the multi-context WebSocket (``pcm_24000``; context open, text, flush and
  close in one burst) -> the first message with audio;
* ``openai``: ``POST /v1/audio/speech`` (``response_format=pcm``, ``stream_format=audio``) ->
  the first body bytes (skipped when the server has no such route).

After its first audio each stream is cancelled (the WebSocket by a second ``close_context``,
HTTP by closing the response), so every stream of a round competes with the same load. Rounds
of the three modes alternate. The transport's cost is its p50 minus the engine's p50.

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
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from voice_out.bench.engine_bench import EngineBenchOptions, engine_from_args, text_of
from voice_out.engine.engine import Engine
from voice_out.server.app import create_app

VOICE = "noise"


async def engine_first(engine: Engine, text: str) -> float:
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


async def openai_first(http: aiohttp.ClientSession, base: str, text: str, n: int) -> float:
    loop = asyncio.get_running_loop()
    body = {"model": "voice_out", "input": text, "voice": VOICE, "response_format": "pcm", "stream_format": "audio"}
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
    app = create_app(engine.config, engine, None, web_dir=None)
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
                "engine": lambda n: engine_first(engine, text),
                "elevenlabs": lambda n: elevenlabs_first(http, base, text, n),
            }
            if await has_openai(http, base):
                modes["openai"] = lambda n: openai_first(http, base, text, n)
            else:
                print("no POST /v1/audio/speech on this server: openai skipped", file=sys.stderr)
            for n in streams:
                samples: dict[str, list[float]] = {m: [] for m in modes}
                for rep in range(args.warmup + args.reps):
                    for mode, first in modes.items():
                        got = await asyncio.gather(*(first(i) for i in range(n)))
                        await engine.await_idle()
                        if rep >= args.warmup:
                            samples[mode] += [1000.0 * s for s in got]
                row = {m: {"p50": quantile(v, 0.5), "p95": quantile(v, 0.95), "n": len(v)} for m, v in samples.items()}
                for m in modes:
                    if m != "engine":
                        row[m]["over_engine_p50"] = row[m]["p50"] - row["engine"]["p50"]
                results["rounds"][str(n)] = row
                print(
                    f"streams={n}: "
                    + "  ".join(f"{m} p50 {r['p50']:.1f} p95 {r['p95']:.1f} ms" for m, r in row.items())
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
