"""A fresh engine's first utterances: does the first one pay anything the later ones do not?

Loads the engine as ``voice-out bench --mode webrtc`` does (random full-size weights, forced
tokens, the 150-token noise voice; ``--voice-prompts`` adds noise voices of other prompt
lengths before the start), then speaks each voice's utterances one after another, the text in
4-character deltas as the benchmark's page sends it, and prints each utterance's first audio
(its ``FirstAudioTrace``: LLM tokens, chunk) and the time to its last chunk. With
``--stacks`` it also samples the GPU worker thread's Python stack every millisecond during
each voice's first utterance and prints where it was (a first-use cost shows up as an import,
a compile or a capture there).

    python scripts/first_utterances.py --model random:0.5b --device cuda [--voice-prompts 100,75] [--stacks]
        [--chars 100] [--pin capture_voice_tokens=50]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench import parse_pin
from voice_out.bench.engine_bench import EngineBenchOptions, bench_config, load_engine, text_of  # noqa: E402
from voice_out.config import load_config, parse_overrides  # noqa: E402
from voice_out.engine.engine import Engine  # noqa: E402
from voice_out.engine.request import VoicePrompt  # noqa: E402
from voice_out.engine.runner import noise_voice  # noqa: E402


class StackSampler:
    """Samples one thread's Python stack (innermost frames, as text) every ``period_s``."""

    def __init__(self, thread_name: str, period_s: float = 0.001) -> None:
        self.thread_name = thread_name
        self.period_s = period_s
        self.samples: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            ident = next((t.ident for t in threading.enumerate() if t.name == self.thread_name), None)
            frame = sys._current_frames().get(ident) if ident is not None else None
            if frame is None:
                continue
            stack = traceback.extract_stack(frame)
            where = " > ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in stack[-6:])
            self.samples.append((time.perf_counter(), where))

    def report(self, t0: float, t1: float, top: int = 8) -> str:
        counts = Counter(where for t, where in self.samples if t0 <= t <= t1)
        return "\n".join(f"    {n:4d} x  {where}" for where, n in counts.most_common(top))


async def speak(engine: Engine, voice: str | None, chars: int) -> tuple[float, float, float, str]:
    """One utterance: (first audio s, last chunk s, audio s, its trace) from the first delta."""
    stream = engine.open_stream(voice)
    text = text_of(chars)
    t0 = time.perf_counter()
    for k in range(0, len(text), 4):
        stream.push_text(text[k : k + 4])
    stream.end_text()
    first = None
    samples = 0
    async for chunk in stream:
        samples += len(chunk.pcm)
        if first is None:
            first = time.perf_counter() - t0
    assert first is not None
    tr = engine.stats().first_audio[-1]
    trace = f"LLM tokens {tr.tokens_s * 1e3:.1f} ms ({tr.llm_steps} steps), chunk {tr.vocode_s * 1e3:.1f} ms"
    return first, time.perf_counter() - t0, samples / engine.sample_rate, trace


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--utterances", type=int, default=3, help="utterances per voice")
    ap.add_argument("--chars", type=int, default=100, help="characters per utterance")
    ap.add_argument("--voice-prompts", default="", help="comma-separated prompt lengths of extra noise voices")
    ap.add_argument("--stacks", action="store_true", help="sample the worker's stack in each voice's first utterance")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override")
    ap.add_argument("--pin", action="append", default=[], metavar="NAME=VALUE", help="a plan choice by hand")
    args = ap.parse_args()
    # the start-up's own account: kernels compiled ahead, graphs captured per prompt length
    logging.basicConfig(format="%(message)s")
    logging.getLogger("voice_out.engine.build").setLevel(logging.INFO)
    over = parse_overrides([f"model.model={args.model}", f"model.device={args.device}", *args.set])
    cfg = load_config(overrides=over)
    opts = EngineBenchOptions(
        streams=(1,),
        tokens_per_text_token=3,
        prompt_tokens=150,
        long_chars=args.chars,
        pins=tuple(parse_pin(p) for p in args.pin),
    )
    engine = load_engine(bench_config(cfg, opts), opts)
    voices: list[str | None] = [None]
    for p in (int(x) for x in args.voice_prompts.split(",") if x):
        ids, flow = noise_voice(p, seed=p)
        # a transcript of P/3 ids, as the built-in noise voice has
        engine.voices.builtin[f"noise{p}"] = VoicePrompt(f"noise{p}", tuple(range(p // 3)), tuple(ids), p, flow)
        voices.append(f"noise{p}")
    t_start = time.perf_counter()
    async with engine:
        print(f"engine ready in {time.perf_counter() - t_start:.1f} s", flush=True)
        for voice in voices:
            for i in range(args.utterances):
                sampler = StackSampler("voice_out-gpu") if args.stacks and i == 0 else None
                t0 = time.perf_counter()
                if sampler is not None:
                    with sampler:
                        first, whole, audio, trace = await speak(engine, voice, args.chars)
                else:
                    first, whole, audio, trace = await speak(engine, voice, args.chars)
                name = voice or "default"
                print(
                    f"{name} #{i + 1}: first audio {first * 1e3:.1f} ms ({trace}); "
                    f"last chunk {whole * 1e3:.0f} ms for {audio:.1f} s",
                    flush=True,
                )
                if sampler is not None:
                    print(sampler.report(t0, t0 + first), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
