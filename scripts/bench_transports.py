"""First audio at the client, per transport, next to the engine's own time to first audio.

The server process (this one) holds the engine (random weights, forced tokens, as
``voice-out bench``) and the real aiohttp app on a loopback port, on the event loop
``voice-out serve`` uses (uvloop where installed). The clients run in a child process of their
own (this script with ``--client-of``), as an agent's would, so that their work shares neither
the server's event loop nor its GIL. Modes:

* ``engine``: in the server process, no transport: ``open_stream`` + ``push_text`` +
  ``end_text`` -> the first PCM chunk (the engine's own TTFA);
* ``elevenlabs``: the multi-context WebSocket (``pcm_24000``; context open, text, flush and
  close sent together) -> the first message with audio; the socket is opened before the round;
* ``openai``: ``POST /v1/audio/speech`` (``response_format=pcm``, ``stream_format=audio``) on a
  new connection, connect included -> the first body bytes;
* ``openai_warm``: the same on a connection opened before the round (an agent's pooled HTTP
  client).

A round of N streams starts stream i at ``i * ramp_s / N`` seconds (``--ramp-s``, default 1 s,
as ``voice-out bench``'s capacity scenario), the same schedule for every mode, and reads every
stream to its end (all N are open together while first audio is due; ``--cancel-at-first`` and
``--ramp-s 0`` give the old burst whose streams were cancelled at their first audio). Each
request carries a tag in its text (every text has the same length), so the server's stamps of
its engine stream are matched to the client's: per request

* ``client``: the client's clock, text sent -> first audio byte;
* ``engine part``: the engine stream's ``end_text`` -> its first chunk (stamped in the server);
* ``cost``: client minus engine part, the transport's own cost for that request, whatever
  step of the engine its first chunk happened to catch;
* ``arrive``: text sent -> ``end_text`` (perf_counter is CLOCK_MONOTONIC, one clock for both
  processes on Linux).

Per mode and stream count: client p50/p95, engine part p50, cost p50/p95, arrive p50, and the
client p50 minus the engine mode's client p50 of the same repeat. Rounds of the modes
alternate (ABCD ABCD ...); ``--repeats K`` runs the whole set K times and reports each repeat
and the median over repeats; ``--out`` writes them as JSON after every repeat (``complete``
false until the end), with each request's own figures (``requests``); ``--budget-s`` starts
no repeat that would end past it (judged by the one before), for a run under a time limit.
``--reps R`` counts rounds per mode and repeat at 1 stream; at N streams ``ceil(R / sqrt(N))``
rounds of N requests each (a round costs N utterances of GPU work). The server process needs what
``voice-out serve`` needs (the app imports aiortc, the PCM encoder PyAV); the client process
imports none of the server's stack (torch, voice_out, aiortc, av: it says so at start and the
run stops if it did).

    python scripts/bench_transports.py --model random:0.5b --device cuda --streams 1,16 \\
        --reps 10 --repeats 3 --out transports.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

VOICE = "noise"
MODES = ("engine", "elevenlabs", "openai", "openai_warm")
#: What the client process must not import: it is an agent's process, not the server's.
SERVER_ONLY = ("torch", "voice_out", "aiortc", "av")
#: Each request's raw figures in the JSON (``requests``), in this order: its stream's index
#: in the round (its place in the ramp), and ms.
RAW_FIELDS = ("index", "client", "engine_part", "arrive")
#: The longest a round may take before the run fails (a stream that never ends).
ROUND_TIMEOUT_S = 300.0
now = time.perf_counter


def tagged_text(text: str, seq: int) -> str:
    """``text`` with its start replaced by a tag for request ``seq``: the same length (so the
    same number of text and forced speech tokens) for every request."""
    tag = f"q{seq:06d} "
    if len(text) <= len(tag):
        raise ValueError(f"--chars must be more than {len(tag)}")
    return tag + text[len(tag) :]


def tag_of(text: str) -> str:
    return text[:7]


# --------------------------------------------------------------------------------------------
# the server process: the engine, each stream stamped


@dataclass
class Stamp:
    """One engine stream: when its text ended, and when its first chunk came (perf_counter s)."""

    ended: float = 0.0
    first: float = 0.0


class StampedStream:
    """An engine stream as the app sees it: ``end_text`` and the first chunk stamped, under the
    tag at the start of its text (event loop only)."""

    def __init__(self, inner: Any, stamps: dict[str, Stamp]) -> None:
        self.inner = inner
        self.stamps = stamps
        self.stamp = Stamp()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def end_text(self) -> None:
        self.inner.end_text()
        self.stamp.ended = now()
        self.stamps[tag_of(self.inner.text)] = self.stamp

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for chunk in self.inner:
            if not self.stamp.first:
                self.stamp.first = now()
            yield chunk


class StampedEngine:
    """The engine as the app sees it, each stream stamped into :attr:`stamps` (event loop only)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stamps: dict[str, Stamp] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def __aenter__(self) -> StampedEngine:
        await self.engine.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.engine.__aexit__(*exc)

    def open_stream(self, *args: Any, **kwargs: Any) -> StampedStream:
        return StampedStream(self.engine.open_stream(*args, **kwargs), self.stamps)


async def engine_one(engine: StampedEngine, text: str, at: float, cancel_at_first: bool) -> dict[str, float]:
    """One stream in the server process, started at perf_counter ``at``."""
    await asyncio.sleep(max(0.0, at - now()))
    t0 = now()
    stream = engine.open_stream(VOICE)
    stream.push_text(text)
    stream.end_text()
    first = 0.0
    samples = 0
    try:
        async for chunk in stream:
            first = first or now()
            samples += len(chunk.pcm)
            if cancel_at_first:
                break
    finally:
        stream.cancel()
    if not first:
        raise RuntimeError("an engine stream ended without audio")
    return {"t0": t0, "first": first, "end": now(), "bytes": 2 * samples}


# --------------------------------------------------------------------------------------------
# the client process


async def elevenlabs_connect(http: aiohttp.ClientSession, base: str) -> aiohttp.ClientWebSocketResponse:
    url = f"ws://{base}/v1/text-to-speech/{VOICE}/multi-stream-input?output_format=pcm_24000"
    return await http.ws_connect(url)


async def elevenlabs_one(
    ws: aiohttp.ClientWebSocketResponse, text: str, at: float, cancel_at_first: bool
) -> dict[str, float]:
    import base64

    await asyncio.sleep(max(0.0, at - now()))
    ctx = "c"
    t0 = now()
    for msg in ({"text": " "}, {"text": text}, {"flush": True}, {"close_context": True}):
        await ws.send_str(json.dumps({**msg, "context_id": ctx}))
    first, size = 0.0, 0
    async for m in ws:
        data = json.loads(m.data)
        if data.get("error"):
            raise RuntimeError(f"elevenlabs: {data}")
        if data.get("audio"):
            if not first:
                first = now()
                if cancel_at_first:
                    await ws.send_str(json.dumps({"close_context": True, "context_id": ctx}))  # interrupt
            size += len(base64.b64decode(data["audio"]))
        if data.get("isFinal"):
            break
    else:
        raise RuntimeError("elevenlabs: the socket closed before the final message")
    end = now()
    await ws.close()
    if not first:
        raise RuntimeError("elevenlabs: no audio")
    return {"t0": t0, "first": first, "end": end, "bytes": size}


async def openai_one(
    http: aiohttp.ClientSession, base: str, text: str, at: float, cancel_at_first: bool
) -> dict[str, float]:
    body = {"model": "voice_out", "input": text, "voice": VOICE, "response_format": "pcm", "stream_format": "audio"}
    await asyncio.sleep(max(0.0, at - now()))
    t0 = now()
    async with http.post(f"http://{base}/v1/audio/speech", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"openai: HTTP {r.status}: {(await r.text())[:200]}")
        data = await r.content.readany()
        first, size = now(), len(data)
        if cancel_at_first:
            r.close()  # hang up: the server cancels the stream
        else:
            while data := await r.content.readany():
                size += len(data)
    if not size:
        raise RuntimeError("openai: an empty body")
    return {"t0": t0, "first": first, "end": now(), "bytes": size}


async def warm_session(base: str) -> aiohttp.ClientSession:
    """A client of one kept-alive connection, opened now (outside any clock)."""
    own = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
    async with own.get(f"http://{base}/healthz") as r:
        await r.read()
    return own


async def client_round(base: str, cmd: dict[str, Any]) -> dict[str, dict[str, float]]:
    """One round in the client process: ``cmd`` names the mode, the texts and each one's start
    (s after the round's clock, which starts once every pre-opened connection is up)."""
    mode, texts, offsets, cancel = cmd["mode"], cmd["texts"], cmd["offsets"], cmd["cancel_at_first"]
    async with contextlib.AsyncExitStack() as stack:
        if mode == "elevenlabs":
            http = await stack.enter_async_context(aiohttp.ClientSession())
            sockets = await asyncio.gather(*(elevenlabs_connect(http, base) for _ in texts))
            for ws in sockets:
                stack.push_async_callback(ws.close)
            t = now()
            coros = [elevenlabs_one(ws, x, t + o, cancel) for ws, x, o in zip(sockets, texts, offsets, strict=True)]
        elif mode == "openai":  # a new connection for every request, its connect inside the clock
            http = await stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
            )
            t = now()
            coros = [openai_one(http, base, x, t + o, cancel) for x, o in zip(texts, offsets, strict=True)]
        elif mode == "openai_warm":
            own = await asyncio.gather(*(warm_session(base) for _ in texts))
            for s in own:
                stack.push_async_callback(s.close)
            t = now()
            coros = [openai_one(s, base, x, t + o, cancel) for s, x, o in zip(own, texts, offsets, strict=True)]
        else:
            raise ValueError(f"unknown client mode {mode!r}")
        got = await asyncio.gather(*coros)
    return {tag_of(x): g for x, g in zip(texts, got, strict=True)}


async def client_main(base: str) -> None:
    """The client process: one JSON command a line on stdin, one JSON reply a line on stdout."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    # an agent's process: none of the server's stack (say so, the server checks)
    heavy = sorted({m.split(".")[0] for m in sys.modules} & set(SERVER_ONLY))
    print(json.dumps({"ready": True, "server_modules": heavy}), flush=True)
    while line := await reader.readline():
        try:
            reply: dict[str, Any] = {"requests": await client_round(base, json.loads(line))}
        except Exception as e:  # the server reports it and stops the run
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


class ClientProcess:
    """The child process that runs the clients (server process side, event loop only)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, base: str) -> ClientProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--client-of",
            base,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        client = cls(proc)
        hello = await client.reply(60.0)
        if hello.get("server_modules"):
            await client.close()
            raise RuntimeError(f"the client process imported the server's {', '.join(hello['server_modules'])}")
        return client

    async def reply(self, wait_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), wait_s)
        if not line:
            raise RuntimeError(f"the client process exited (status {await self.proc.wait()})")
        return dict(json.loads(line))

    async def round(self, cmd: dict[str, Any]) -> dict[str, dict[str, float]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        got = await self.reply(ROUND_TIMEOUT_S)
        if "error" in got:
            raise RuntimeError(f"{cmd['mode']} round failed in the client process: {got['error']}")
        return dict(got["requests"])

    async def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 10.0)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


# --------------------------------------------------------------------------------------------
# figures


def quantile(values: Sequence[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def rounds_at(reps: int, n: int) -> int:
    """Rounds per mode and repeat at ``n`` streams: ``reps`` at 1 stream, fewer at more, as a
    round of ``n`` gives ``n`` requests for ``n`` utterances of GPU work."""
    return max(1, math.ceil(reps / math.sqrt(n)))


def figures(requests: list[dict[str, float]]) -> dict[str, float]:
    """The figures (ms) of one mode's requests at one stream count, in one repeat."""
    client = [r["client"] for r in requests]
    part = [r["engine_part"] for r in requests]
    cost = [r["cost"] for r in requests]
    arrive = [r["arrive"] for r in requests]
    return {
        "client_p50": quantile(client, 0.5),
        "client_p95": quantile(client, 0.95),
        "engine_part_p50": quantile(part, 0.5),
        "cost_p50": quantile(cost, 0.5),
        "cost_p95": quantile(cost, 0.95),
        "arrive_p50": quantile(arrive, 0.5),
        "audio_s": statistics.fmean(r["audio_s"] for r in requests),
        "n": len(requests),
    }


def median_over(repeats: list[dict[str, dict[str, dict[str, float]]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Each figure's median over the repeats, per stream count and mode."""
    first = repeats[0]
    return {
        n: {m: {key: statistics.median(r[n][m][key] for r in repeats) for key in f} for m, f in modes.items()}
        for n, modes in first.items()
    }


def table(title: str, rows: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [
        title,
        f"{'streams':>7} {'mode':<12} {'client p50':>10} {'p95':>7} {'engine part':>11} {'cost p50':>8} "
        f"{'p95':>6} {'arrive':>6} {'over engine p50':>15} {'n':>4}",
    ]
    for n, modes in rows.items():
        for mode, f in modes.items():
            lines.append(
                f"{n:>7} {mode:<12} {f['client_p50']:10.1f} {f['client_p95']:7.1f} {f['engine_part_p50']:11.1f} "
                f"{f['cost_p50']:8.1f} {f['cost_p95']:6.1f} {f['arrive_p50']:6.1f} "
                f"{f['over_engine_p50']:+15.1f} {int(f['n']):4d}"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the run


async def server_main(args: argparse.Namespace) -> dict[str, Any]:
    t_start = now()
    from aiohttp import web

    from voice_out.bench.engine_bench import EngineBenchOptions, engine_from_args, text_of, wait_warm
    from voice_out.server.app import create_app

    streams = tuple(int(s) for s in args.streams.split(","))
    modes = tuple(args.modes.split(","))
    if set(modes) - set(MODES) or "engine" not in modes:
        raise SystemExit(f"--modes: choose from {', '.join(MODES)}, engine included")
    opts = EngineBenchOptions(
        streams=streams,
        ttfa_chars=args.chars,
        capacity_chars=args.chars,
        long_chars=args.chars,
        prompt_tokens=args.prompt_tokens,
    )
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    engine = engine_from_args(args.model, args.device, args.set, opts)
    stamped = StampedEngine(engine)
    app = create_app(engine.config, stamped, None, web_dir=None)
    runner = web.AppRunner(app)
    await runner.setup()  # enters the engine: worker started, warmed up
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    # start-up's graph captures after ready would take turns with the first rounds: measure
    # the engine as it serves once they are done, as `voice-out bench` does
    await asyncio.to_thread(wait_warm, engine, 900.0)
    base = f"127.0.0.1:{runner.addresses[0][1]}"
    text = text_of(args.chars)
    plan = {n: rounds_at(args.reps, n) for n in streams}
    out: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "chars": args.chars,
        "ramp_s": args.ramp_s,
        "cancel_at_first": args.cancel_at_first,
        "modes": list(modes),
        "rounds_per_repeat": {str(n): r for n, r in plan.items()},
        "warmup_rounds": args.warmup,
        "ready_s": round(now() - t_start, 1),
        "complete": False,
        "repeats": [],
        "requests": [],
    }
    seq = 0

    def save() -> None:
        """The figures so far into ``--out`` (after every repeat: a run cut short keeps them)."""
        if out["repeats"]:
            out["median"] = median_over(out["repeats"])
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)

    async def one_round(mode: str, n: int) -> list[dict[str, float]]:
        nonlocal seq
        texts = [tagged_text(text, seq + i) for i in range(n)]
        seq += n
        offsets = [args.ramp_s * i / n for i in range(n)]
        stamped.stamps = {}
        if mode == "engine":
            t = now()
            got = await asyncio.wait_for(
                asyncio.gather(
                    *(engine_one(stamped, x, t + o, args.cancel_at_first) for x, o in zip(texts, offsets, strict=True))
                ),
                ROUND_TIMEOUT_S,
            )
            by_tag = {tag_of(x): g for x, g in zip(texts, got, strict=True)}
        else:
            cmd = {"mode": mode, "texts": texts, "offsets": offsets, "cancel_at_first": args.cancel_at_first}
            by_tag = await client.round(cmd)
        await engine.await_idle()
        rows = []
        for i, x in enumerate(texts):
            c, s = by_tag[tag_of(x)], stamped.stamps.get(tag_of(x))
            if s is None or not s.first:
                raise RuntimeError(f"{mode}: the server has no stamp of request {tag_of(x)}")
            client_ms, part_ms = 1000 * (c["first"] - c["t0"]), 1000 * (s.first - s.ended)
            rows.append(
                {
                    "client": client_ms,
                    "engine_part": part_ms,
                    "cost": client_ms - part_ms,
                    "arrive": 1000 * (s.ended - c["t0"]),
                    "audio_s": c["bytes"] / 2 / 24000,
                    "index": i,
                }
            )
        return rows

    t_run, last_repeat_s = now(), 0.0
    client = await ClientProcess.start(base)
    try:
        for n in streams:  # warm-up: every mode's first use (connections, code paths), not counted
            for _ in range(args.warmup):
                for mode in modes:
                    await one_round(mode, n)
        for k in range(args.repeats):
            t_repeat = now()
            if k and args.budget_s and t_repeat - t_start + last_repeat_s > args.budget_s:
                print(f"--budget-s {args.budget_s:g}: stopping after {k} repeats", file=sys.stderr, flush=True)
                break
            per: dict[str, dict[str, dict[str, float]]] = {}
            raw: dict[str, dict[str, list[list[float]]]] = {}
            for n in streams:
                got: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
                for _ in range(plan[n]):
                    for mode in modes:
                        got[mode] += await one_round(mode, n)
                per[str(n)] = {m: figures(rows) for m, rows in got.items()}
                raw[str(n)] = {m: [[r[k] for k in RAW_FIELDS] for r in rows] for m, rows in got.items()}
                print(f"repeat {k + 1}, {n} streams: done at {now() - t_run:.0f} s", file=sys.stderr, flush=True)
                for f in per[str(n)].values():
                    f["over_engine_p50"] = f["client_p50"] - per[str(n)]["engine"]["client_p50"]
            out["repeats"].append(per)
            out["requests"].append(raw)
            save()
            last_repeat_s = now() - t_repeat
            print(table(f"repeat {k + 1} of {args.repeats} (ms)", per), flush=True)
    finally:
        with contextlib.suppress(Exception):
            await client.close()
        with contextlib.suppress(Exception):
            await runner.cleanup()
    out["complete"] = True
    out["wall_s"] = round(now() - t_start, 1)
    save()
    print(table(f"median over {len(out['repeats'])} repeats (ms)", out["median"]), flush=True)
    print(f"wall {out['wall_s']} s (engine and app ready after {out['ready_s']} s)", flush=True)
    return out


def new_loop() -> asyncio.AbstractEventLoop:
    """The event loop ``voice-out serve`` runs on: uvloop where installed."""
    with contextlib.suppress(ImportError):
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default="random:0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", default="1,16", help="stream counts, comma-separated")
    ap.add_argument(
        "--reps", type=int, default=10, help="rounds per mode and repeat at 1 stream; ceil(reps/sqrt(N)) at N streams"
    )
    ap.add_argument("--repeats", type=int, default=3, help="times the whole interleaved set runs")
    ap.add_argument(
        "--warmup", type=int, default=1, help="warm-up rounds per mode and stream count, before the repeats"
    )
    ap.add_argument(
        "--budget-s", type=float, default=0.0, help="start no repeat that would end later than this (s from start)"
    )
    ap.add_argument("--ramp-s", type=float, default=1.0, help="stream i of N starts at i * ramp / N s")
    ap.add_argument("--cancel-at-first", action="store_true", help="cancel each stream at its first audio")
    ap.add_argument("--chars", type=int, default=100, help="characters of each utterance")
    ap.add_argument("--prompt-tokens", type=int, default=150, help="speech tokens of the random voice's prompt")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, engine included")
    ap.add_argument("--set", action="append", default=[], help="SECTION.FIELD=VALUE")
    ap.add_argument("--out", "--json", dest="out", help="write the figures here (JSON)")
    ap.add_argument("--client-of", help=argparse.SUPPRESS)  # the client process: the server's host:port
    a = ap.parse_args(argv)
    if a.client_of is None:
        if a.reps < 1 or a.repeats < 1 or a.warmup < 0:
            ap.error("--reps and --repeats must be >= 1, --warmup >= 0")
        if a.budget_s < 0:
            ap.error("--budget-s must be >= 0 (0: no limit)")
        if a.ramp_s < 0:
            ap.error("--ramp-s must be >= 0")
        if a.chars <= 8:
            ap.error("--chars must be more than 8 (each text starts with an 8-character tag)")
    return a


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    if a.client_of is not None:
        asyncio.run(client_main(a.client_of))
        return
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(server_main(a))


if __name__ == "__main__":
    main()
