"""What the agents' transports add to first audio, on the CPU, with the fake engine.

The server (the real aiohttp app over ``tests/fakes.py``'s FakeEngine: each stream's first
chunk ``--first-ms`` after its text ends) runs in its own process; the clients run in this one,
as an agent's would. perf_counter is CLOCK_MONOTONIC, shared by the two processes, so each
request is split where the server sees it:

* ``arrive``: the client's clock start -> ``end_text`` on the engine stream (connect, request,
  parse, route, handler);
* ``deliver``: the engine's first chunk -> the client's first audio byte;
* ``cpu/req``: the server process's CPU time per request (user + system), the figure the
  machine's load disturbs least.

Modes, N requests started in one event-loop tick per round: ``engine`` (in the server process,
no transport), ``openai`` (``POST /v1/audio/speech``, pcm, a new connection per request, as
scripts/bench_transports.py measures it), ``openai_warm`` (a connection opened before the clock
starts), ``elevenlabs`` (the multi-context WebSocket; its clock starts after the handshake).

    python scripts/transport_overhead_cpu.py --streams 16 --reps 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fakes

now = time.perf_counter
TEXT = "Hello there, this is a sentence of about one hundred characters that the fake engine will speak now."


def serve(port_q: Any, first_s: float) -> None:
    """The server process: the app over a stamping FakeEngine, plus two probe routes."""
    from aiohttp import web

    from tests.fakes import FakeEngine, FakeScript
    from voice_out.config import ServerConfig
    from voice_out.server.app import create_app

    marks: dict[str, dict[str, float]] = {}

    class Stamped(FakeEngine):
        def open_stream(self, voice: str | None = None, **kw: Any) -> Any:
            stream = super().open_stream(voice, **kw)
            end_text, chunks = stream.end_text, stream._chunks

            def stamped_end() -> None:
                end_text()
                marks.setdefault(stream.text.split()[0], {})["ended"] = now()

            async def stamped_chunks() -> Any:
                first = True
                async for chunk in chunks():
                    if first:
                        marks.setdefault(stream.text.split()[0], {})["chunk"] = now()
                        first = False
                    yield chunk

            stream.end_text = stamped_end  # type: ignore[method-assign]
            stream._chunks = stamped_chunks  # type: ignore[method-assign]
            return stream

    engine = Stamped(script=FakeScript(first_chunk_delay_s=first_s, chunk_delay_s=0.02, chars_per_chunk=10))
    engine.capacity = 1024
    app = create_app(ServerConfig(serve_web=False), engine, None, web_dir=None)

    async def probe(request: web.Request) -> web.Response:
        out = dict(marks)
        marks.clear()
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return web.json_response({"marks": out, "cpu": ru.ru_utime + ru.ru_stime})

    async def direct(request: web.Request) -> web.Response:
        """N engine streams opened in one tick in this process: the engine mode."""
        times: dict[str, tuple[float, float]] = {}

        async def one(key: str) -> None:
            t0 = now()
            stream = engine.open_stream("alice")
            stream.push_text(f"{key} {TEXT}")
            stream.end_text()
            async for _ in stream:
                times[key] = (t0, now())
                break
            stream.cancel()

        await asyncio.gather(*(one(f"r{i}") for i in range(int(request.query["n"]))))
        return web.json_response(times)

    app.router.add_get("/probe", probe)
    app.router.add_get("/direct", direct)

    async def run() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_q.put(runner.addresses[0][1])
        await asyncio.Event().wait()

    asyncio.run(run())


async def openai_first(http: Any, base: str, key: str, out: dict[str, tuple[float, float]]) -> None:
    body = {"model": "x", "input": f"{key} {TEXT}", "voice": "alice", "response_format": "pcm"}
    t0 = now()
    async with http.post(f"http://{base}/v1/audio/speech", json=body) as r:
        assert r.status == 200, await r.text()
        await r.content.readany()
        out[key] = (t0, now())
        r.close()


async def openai_warm_first(base: str, key: str, out: dict[str, tuple[float, float]], go: asyncio.Event) -> None:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as own:
        async with own.get(f"http://{base}/healthz") as r:
            await r.read()
        await go.wait()
        await openai_first(own, base, key, out)


async def elevenlabs_first(http: Any, base: str, key: str, out: dict[str, tuple[float, float]]) -> None:
    url = f"ws://{base}/v1/text-to-speech/alice/multi-stream-input?output_format=pcm_24000"
    async with http.ws_connect(url) as ws:
        t0 = now()
        for msg in ({"text": " "}, {"text": f"{key} {TEXT}"}, {"flush": True}, {"close_context": True}):
            await ws.send_str(json.dumps({**msg, "context_id": "c"}))
        async for m in ws:
            if json.loads(m.data).get("audio"):
                out[key] = (t0, now())
                break
        await ws.send_str(json.dumps({"close_context": True, "context_id": "c"}))
        async for m in ws:
            if json.loads(m.data).get("isFinal"):
                break


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


async def measure(base: str, n: int, reps: int, warmup: int) -> dict[str, dict[str, float]]:
    import aiohttp

    modes = ("engine", "openai", "openai_warm", "elevenlabs")
    got: dict[str, dict[str, list[float]]] = {m: {"total": [], "arrive": [], "deliver": [], "cpu": []} for m in modes}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for rep in range(warmup + reps):
            for mode in modes:
                keys = [f"r{i}" for i in range(n)]
                out: dict[str, tuple[float, float]] = {}
                async with http.get(f"http://{base}/probe") as r:
                    cpu0 = (await r.json())["cpu"]
                if mode == "engine":
                    async with http.get(f"http://{base}/direct?n={n}") as r:
                        out = {k: (a, b) for k, (a, b) in (await r.json()).items()}
                elif mode == "openai":
                    await asyncio.gather(*(openai_first(http, base, k, out) for k in keys))
                elif mode == "openai_warm":
                    go = asyncio.Event()
                    tasks = [asyncio.ensure_future(openai_warm_first(base, k, out, go)) for k in keys]
                    await asyncio.sleep(0.3)  # every connection open
                    go.set()
                    await asyncio.gather(*tasks)
                else:
                    await asyncio.gather(*(elevenlabs_first(http, base, k, out) for k in keys))
                await asyncio.sleep(0.1)
                async with http.get(f"http://{base}/probe") as r:
                    probe = await r.json()
                if rep < warmup:
                    continue
                row = got[mode]
                row["cpu"].append(1000 * (probe["cpu"] - cpu0) / n)
                for k in keys:
                    t0, first = out[k]
                    server = probe["marks"][k]
                    row["total"].append(1000 * (first - t0))
                    row["arrive"].append(1000 * (server["ended"] - t0))
                    row["deliver"].append(1000 * (first - server["chunk"]))
    return {
        m: {f"{k}_p50": pct(v, 0.5) for k, v in r.items()} | {f"{k}_p95": pct(v, 0.95) for k, v in r.items()}
        for m, r in got.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--first-ms", type=float, default=50.0, help="the fake engine's time to first chunk")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    server = ctx.Process(target=serve, args=(port_q, args.first_ms / 1000), daemon=True)
    server.start()
    try:
        base = f"127.0.0.1:{port_q.get(timeout=120)}"
        rows = asyncio.run(measure(base, args.streams, args.reps, args.warmup))
    finally:
        server.terminate()
    print(f"{args.streams} concurrent requests, fake engine first chunk {args.first_ms:g} ms; p50 / p95 ms")
    for mode, r in rows.items():
        print(
            f"{mode:12s} total {r['total_p50']:6.1f} / {r['total_p95']:6.1f}  arrive {r['arrive_p50']:5.1f} / "
            f"{r['arrive_p95']:5.1f}  deliver {r['deliver_p50']:5.1f} / {r['deliver_p95']:5.1f}  "
            f"cpu/req {r['cpu_p50']:.2f}"
        )


if __name__ == "__main__":
    main()
