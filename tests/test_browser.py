"""A real browser against the real server: headless Chromium opens the demo page, connects over
WebRTC, streams text like an LLM, barges in, and the page's own WebAudio measurements (see
``window.voiceOut`` in web/app.js) are asserted.

The server is the real stack, in this process: ``load_runtime`` (engine and voice store, as
``voice-out serve`` builds them) on the tiny official-layout model of ``VOICE_OUT_PARITY_DIR``
(random weights: it speaks noise, through every stage of the real engine), ``create_app``, and
aiortc. Chromium is driven through its DevTools protocol over a WebSocket (aiohttp), so the
test needs no browser-automation package (voice_out.bench.chromium, which the WebRTC benchmark's
Chromium client uses too). Everything stays on this machine: the server listens
on 127.0.0.1 and the page loads nothing from elsewhere (asserted).

Set ``VOICE_OUT_BROWSER_ARTIFACTS=<dir>`` to keep the screenshot and the page's measurements.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.fakes import FakeEngine, FakeVoiceStore
from voice_out.bench.chromium import DevToolsError, Page, chromium
from voice_out.config import Config, EngineConfig, ModelConfig, ServerConfig
from voice_out.server.app import create_app, load_runtime

pytestmark = pytest.mark.browser

TEST_TIMEOUT_S = 90.0

# Bounds on what the page measures, on a 2-core CPU machine with the tiny model (design §5):
# first delta sent -> first audible sample decoded; cancel sent -> last audible sample decoded.
MAX_PAGE_TTFA_MS = 5000.0
MAX_BARGE_IN_MS = 600.0
# After a barge-in the page must stay silent this long (no late audio).
QUIET_AFTER_CANCEL_S = 1.0

# What the page streams: a short utterance played to the end, then a long one cut by the
# barge-in button, then the long one again, cut by the microphone.
SHORT_TEXT = "Hello there, this is a short test."
LONG_TEXT = (
    "This is a much longer paragraph that keeps arriving word by word, just like the reply of a "
    "language model, so that there is plenty of speech left to interrupt when the listener "
    "decides to barge in and talk over the agent."
)
TOKENS_PER_S = 30
# The voice the page records from Chromium's fake microphone and registers.
VOICE = "browser_mic"
TRANSCRIPT = "A short recording made in the browser."
RECORD_MS = 3000


# Runs in the page: wait for a block heard in the last 20 ms, then send the cancel at once.
CANCEL_WHILE_AUDIBLE = """(async () => {
  const deadline = performance.now() + 5000;
  while (!(voiceOut.audio.lastAudibleEnd > performance.now() - 20)) {
    if (performance.now() > deadline) return false;
    await new Promise((resolve) => setTimeout(resolve, 2));
  }
  voiceOut.cancel(null, "test");
  return true;
})()"""


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` on a free port of 127.0.0.1; yield its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()  # enters the engine: worker started, model loaded, warmed up
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def running_server(config: Config) -> AsyncIterator[str]:
    """The real voice_out server (engine, voice store, app) as ``voice-out serve`` builds it."""
    engine, store = await asyncio.get_running_loop().run_in_executor(None, load_runtime, config)
    async with serving(create_app(config, engine, store)) as base_url:
        yield base_url


async def browser_session(config: Config, profile: Path, out: dict[str, Any]) -> None:
    """Run the conversation; ``out`` receives what the page measured (``"measured"``) and
    screenshots (``"*.png"``), also when the conversation fails half-way."""
    async with running_server(config) as base_url, chromium(profile) as page:
        try:
            await conversation(page, base_url, out)
        finally:
            with contextlib.suppress(Exception):
                out.setdefault("measured", await page.evaluate("window.voiceOut && voiceOut.summary()"))
                out.setdefault("demo.png", await page.screenshot())


async def conversation(page: Page, base_url: str, out: dict[str, Any]) -> None:
    """Drive the page through one conversation."""
    await page.send("Page.navigate", {"url": base_url + "/"})
    await page.wait_for("window.voiceOut && window.voiceOut.loaded", 15, "the demo page to load")
    session_id = await page.evaluate("voiceOut.connect()")
    assert session_id, "POST /offer answered without a session id"

    # 0. A voice recorded with the (fake) microphone, registered through POST /voices.
    recorded = await page.evaluate(f"voiceOut.record({RECORD_MS})")
    assert recorded["seconds"] > 0.8 * RECORD_MS / 1000, recorded
    await page.evaluate(f"voiceOut.uploadVoice({json.dumps(VOICE)}, null, {json.dumps(TRANSCRIPT)})")
    voices = await page.evaluate("voiceOut.listVoices()")
    assert VOICE in voices, voices
    assert await page.evaluate("document.getElementById('voice').value") == VOICE

    # 1. A short utterance streamed like an LLM and played to the end.
    short_id = await page.evaluate(f"voiceOut.stream({json.dumps(SHORT_TEXT)}, {{tps: {TOKENS_PER_S}}})")
    await page.wait_for(
        f"['done', 'error'].includes(voiceOut.utterances[{json.dumps(short_id)}].status)",
        30,
        "audio.done of the short utterance",
    )
    await page.wait_for("!voiceOut.audio.audible", 5, "silence after the short utterance")

    # 2. A long utterance, interrupted once the page has heard it for a while.
    long_id = await page.evaluate(f"voiceOut.stream({json.dumps(LONG_TEXT)}, {{tps: {TOKENS_PER_S}}})")
    await page.wait_for(
        f"voiceOut.utterances[{json.dumps(long_id)}].firstAudibleAt !== null", 30, "audio of the long utterance"
    )
    await asyncio.sleep(0.3)
    out["demo-playing.png"] = await page.screenshot()
    # Barge in while the page is hearing sound (random weights pause often), so that the
    # measured time runs from audible speech to silence.
    assert await page.evaluate(CANCEL_WHILE_AUDIBLE), "no audible sound to interrupt"
    await page.wait_for("voiceOut.bargeIns[0].silenceAt !== null", 10, "silence after the barge-in")
    await asyncio.sleep(QUIET_AFTER_CANCEL_S)
    await page.wait_for(f"voiceOut.utterances[{json.dumps(long_id)}].status === 'cancelled'", 5, "the cancelled event")

    # 3. Barge-in by voice: the page's energy VAD on the microphone. Chromium's fake
    #    microphone beeps (~50 ms every 0.5 s), so the test asks for 40 ms of "speech".
    #    The microphone listens once the page hears the agent, so the cut is audible.
    await page.evaluate("voiceOut.micVad.speechMs = 40")
    mic_id = await page.evaluate(f"voiceOut.stream({json.dumps(LONG_TEXT)}, {{tps: {TOKENS_PER_S}}})")
    await page.wait_for(
        f"voiceOut.utterances[{json.dumps(mic_id)}].firstAudibleAt !== null", 30, "audio of the third utterance"
    )
    await page.evaluate("voiceOut.micBargeIn(true)")
    await page.wait_for(
        "voiceOut.bargeIns.length === 2 && voiceOut.bargeIns[1].silenceAt !== null", 10, "a microphone barge-in"
    )
    await page.evaluate("voiceOut.micBargeIn(false)")
    await page.wait_for(f"voiceOut.utterances[{json.dumps(mic_id)}].status === 'cancelled'", 5, "cancelled")

    measured: dict[str, Any] = await page.evaluate("voiceOut.summary()")
    measured["rtp"] = await page.evaluate("voiceOut.rtpStats()")
    # The received level around each barge-in, for the record (and for a failure's diagnosis).
    measured["levels_around_barge_ins"] = [
        await page.evaluate(f"voiceOut.levels({b['at']} - 300, {b['at']} + 500)") for b in measured["bargeIns"]
    ]
    measured.update(short_id=short_id, long_id=long_id, mic_id=mic_id)
    # No uncaught exception in the page.
    thrown = [e for e in page.devtools.events if e.get("method") == "Runtime.exceptionThrown"]
    assert thrown == [], page.console()
    # The page is self-contained: everything it loaded came from the server (or from itself).
    urls = page.requested_urls()
    assert base_url + "/app.js" in urls and base_url + "/style.css" in urls, urls
    foreign = [u for u in urls if not u.startswith((base_url + "/", "data:", "blob:"))]
    assert foreign == [], foreign
    out["measured"] = measured


def test_demo_page_speaks_and_barges_in(tmp_path: Path, parity_dir: Path) -> None:
    keep = os.environ.get("VOICE_OUT_BROWSER_ARTIFACTS")
    artifacts = Path(keep) if keep else tmp_path
    artifacts.mkdir(parents=True, exist_ok=True)
    # The tiny model in the official layout: random weights (it speaks noise), but every stage
    # of the real engine runs, and its prompt networks let the page register a voice.
    config = Config(
        model=ModelConfig(model=str(parity_dir), device="cpu", dtype="float32", offline=True),
        # Random weights rarely stop on their own: cap the speech at a natural length
        # (~6 speech tokens, a quarter second, per text token) so the short utterance ends.
        engine=EngineConfig(max_streams=4, max_speech_tokens_per_text_token=6, seed=0),
        server=ServerConfig(host="127.0.0.1", port=0, voices_dir=str(tmp_path / "voices")),
    )
    out: dict[str, Any] = {}
    try:
        asyncio.run(asyncio.wait_for(browser_session(config, tmp_path / "profile", out), TEST_TIMEOUT_S))
    finally:
        for name, value in out.items():
            if name.endswith(".png"):
                (artifacts / name).write_bytes(value)
        (artifacts / "measured.json").write_text(json.dumps(out.get("measured"), indent=2))
    measured = out["measured"]
    check_measurements(measured)


def check_measurements(m: dict[str, Any]) -> None:
    short = m["utterances"][m["short_id"]]
    long = m["utterances"][m["long_id"]]
    audio = m["audio"]
    events = m["events"]
    types = [e["type"] for e in events]

    # Events, in order: ready, then the short utterance start to end, then the long one cut.
    assert types[0] == "session.ready", types
    assert "error" not in types, [e for e in events if e["type"] == "error"]
    by_id = [(e["type"], e.get("id")) for e in events if e.get("id") is not None]
    expected = [
        ("audio.started", m["short_id"]),
        ("audio.done", m["short_id"]),
        ("audio.started", m["long_id"]),
        ("cancelled", m["long_id"]),
    ]
    expected += [("audio.started", m["mic_id"]), ("cancelled", m["mic_id"])]
    assert by_id == expected, by_id

    # The page heard every utterance, with energy, soon after its first delta (measured by
    # the AudioWorklet, which the page loaded from the server).
    assert audio["meter"] == "worklet"
    assert audio["maxRms"] > 4 * audio["threshold"], audio["maxRms"]
    for u in (short, long, m["utterances"][m["mic_id"]]):
        assert u["voice"] == VOICE, u
        assert u["pageTtfaMs"] is not None, u
        assert 0 < u["pageTtfaMs"] < MAX_PAGE_TTFA_MS, u
        # The page cannot hear audio before the server put it on the track.
        assert u["serverTtfaMs"] is not None and u["serverTtfaMs"] <= u["pageTtfaMs"] + 50, u
    assert short["audioMs"] > 300, short
    assert audio["audibleMs"] > 0.5 * short["audioMs"], (audio["audibleMs"], short["audioMs"])

    # Barge-in: the page was hearing the long utterance, then heard silence within the bound,
    # and nothing after it.
    barge_in, by_voice = m["bargeIns"]
    assert barge_in["ids"] == [m["long_id"]] and barge_in["reason"] == "test", barge_in
    assert long["firstAudibleAt"] < barge_in["at"]
    assert barge_in["ms"] is not None and barge_in["ms"] < MAX_BARGE_IN_MS, barge_in
    next_start = m["utterances"][m["mic_id"]]["firstDeltaAt"]
    assert next_start - barge_in["silenceAt"] >= QUIET_AFTER_CANCEL_S * 1000 - 100
    later_onsets = [o for o in audio["onsets"] if barge_in["silenceAt"] < o["t"] < next_start]
    assert later_onsets == [], later_onsets
    assert LONG_TEXT.startswith(long["playedText"]), long["playedText"]
    assert 0 < long["playedMs"], long

    # Barge-in by voice: the microphone VAD cancelled the third utterance, and it went quiet.
    assert by_voice["reason"] == "microphone" and by_voice["ids"] == [m["mic_id"]], by_voice
    assert m["utterances"][m["mic_id"]]["firstAudibleAt"] < by_voice["at"]
    assert "micBargeIn" in m["marks"]
    assert by_voice["ms"] is not None and by_voice["ms"] < MAX_BARGE_IN_MS, by_voice
    assert [o for o in audio["onsets"] if o["t"] > by_voice["silenceAt"]] == []


TOKEN = "browser-test-token"


async def token_and_errors(profile: Path) -> dict[str, Any]:
    engine = FakeEngine(voices=("alice",))
    app = create_app(Config(server=ServerConfig(auth_token=TOKEN)), engine, FakeVoiceStore(engine))
    async with serving(app) as base_url, chromium(profile) as page:
        await page.send("Page.navigate", {"url": base_url + "/"})
        await page.wait_for("window.voiceOut && window.voiceOut.loaded", 15, "the demo page to load")
        result: dict[str, Any] = {}
        result["without_token"] = await page.evaluate("voiceOut.connect().then(() => 'connected', (e) => e.message)")
        result["status_after_failure"] = await page.evaluate("document.getElementById('status').textContent")
        await page.evaluate(f"document.getElementById('token').value = {json.dumps(TOKEN)}")
        result["session_id"] = await page.evaluate("voiceOut.connect()")
        result["voices"] = await page.evaluate("voiceOut.listVoices()")
        bad = await page.evaluate("voiceOut.speak('Hello', {voice: 'nobody'})")
        await page.wait_for(f"voiceOut.utterances[{json.dumps(bad)}].status === 'error'", 10, "the error")
        # "fast start" on: the first delta carries fast_first = 12, beyond the fake engine's
        # 4-token first hop (bad_field); the real engine's answer is in tests/test_server_engine.py
        await page.evaluate("document.getElementById('fast-start').checked = true")
        fast = await page.evaluate("voiceOut.speak('Hello, quickly.', {voice: 'alice'})")
        await page.wait_for(f"voiceOut.utterances[{json.dumps(fast)}].status === 'error'", 10, "the fast_first error")
        await page.evaluate("document.getElementById('fast-start').checked = false")
        result["fast_first"] = await page.evaluate(f"voiceOut.utterances[{json.dumps(fast)}].fastFirst")
        good = await page.evaluate("voiceOut.speak('Hello there, again.', {voice: 'alice'})")
        await page.wait_for(f"voiceOut.utterances[{json.dumps(good)}].status === 'done'", 10, "audio.done")
        await page.wait_for(f"voiceOut.utterances[{json.dumps(good)}].pageTtfaMs !== null", 5, "the page to hear it")
        await page.evaluate("voiceOut.ping()")
        await page.wait_for("voiceOut.log.some((e) => e.type === 'pong')", 5, "the pong")
        result["rtt_shown"] = await page.evaluate("document.getElementById('stat-rtt').textContent")
        result["summary"] = await page.evaluate("voiceOut.summary()")
        result["ids"] = (bad, fast, good)
        return result


def test_demo_page_bearer_token_and_errors(tmp_path: Path) -> None:
    """The page's auth and error paths, against the server app with the fake engine (a tone)."""
    r = asyncio.run(asyncio.wait_for(token_and_errors(tmp_path / "profile"), TEST_TIMEOUT_S))
    assert "HTTP 401" in r["without_token"] and "bearer token" in r["without_token"], r["without_token"]
    assert r["status_after_failure"] == "error"
    assert r["session_id"] and r["voices"] == ["alice"], r
    bad, fast, good = r["ids"]
    events = r["summary"]["events"]
    errors = [e for e in events if e["type"] == "error"]
    # One error per refused delta: the text.done sent right behind it is not a second one.
    assert [(e["id"], e["code"]) for e in errors] == [(bad, "unknown_voice"), (fast, "bad_field")], errors
    assert "fast_first" in next(e["message"] for e in errors if e["id"] == fast)
    assert r["fast_first"] == 12
    assert [(e["type"], e.get("id")) for e in events if e["type"].startswith("audio.")] == [
        ("audio.started", good),
        ("audio.done", good),
    ]
    heard = r["summary"]["utterances"][good]
    assert heard["pageTtfaMs"] is not None and heard["pageTtfaMs"] < MAX_PAGE_TTFA_MS, (heard, r["summary"])
    pongs = [e for e in events if e["type"] == "pong"]
    assert len(pongs) == 1 and isinstance(pongs[0]["t"], int | float)
    assert r["rtt_shown"].endswith("ms"), r["rtt_shown"]


# ------------------------------------------------------------------------------------------------
# What the page shows for a random-weight model, whose noise is far quieter than speech


async def random_model_page(config: Config, profile: Path, out: dict[str, Any]) -> None:
    """A user's first run on ``random:tiny``: Connect, Speak, watch, barge in (button, then
    microphone). The DOM's level meter and page TTFA are sampled while it plays."""
    async with running_server(config) as base_url, chromium(profile) as page:
        await page.send("Page.navigate", {"url": base_url + "/"})
        await page.wait_for("window.voiceOut && window.voiceOut.loaded", 15, "the demo page to load")
        await page.evaluate("document.getElementById('connect').click()")
        await page.wait_for("!document.getElementById('speak').disabled", 30, "the session to open")
        await page.wait_for("document.getElementById('voice').options.length > 1", 10, "the voice menu")
        out["menu"] = await page.evaluate(
            "[...document.getElementById('voice').options].map((o) => [o.value, o.text, o.selected])"
        )
        await asyncio.sleep(1.0)  # the track's silence, before anything is said
        out["idle_levels"] = await page.evaluate("voiceOut.levels().map(([, rms]) => rms)")
        await page.evaluate("document.getElementById('speak').click()")
        # (seconds on a 2-core CI machine; minutes on a crowded one)
        await page.wait_for("voiceOut.audio.onsets.length > 0", 180, "the first sound")
        out["samples"] = await page.evaluate(SAMPLE_WHAT_THE_USER_SEES, timeout_s=90)
        out["demo-random.png"] = await page.screenshot()
        # barge in with the button while it is audible; then by voice (the fake microphone)
        cancel_while_audible = CANCEL_WHILE_AUDIBLE.replace('voiceOut.cancel(null, "test")', CLICK_CANCEL)
        assert await page.evaluate(cancel_while_audible.replace("5000", "60000"), timeout_s=90), "nothing to cut"
        await page.wait_for("voiceOut.bargeIns[0].silenceAt !== null", 10, "silence after the barge-in")
        out["bargein_shown"] = await page.evaluate("document.getElementById('stat-bargein').textContent")
        await page.evaluate("voiceOut.micVad.speechMs = 40")
        await page.evaluate("document.getElementById('speak').click()")
        await page.wait_for("voiceOut.audio.audible", 180, "audio of the second utterance")
        await page.evaluate("voiceOut.micBargeIn(true)")
        await page.wait_for("voiceOut.bargeIns.length === 2 && voiceOut.bargeIns[1].silenceAt !== null", 10, "mic")
        await page.evaluate("voiceOut.micBargeIn(false)")
        out["measured"] = await page.evaluate("voiceOut.summary()")


CLICK_CANCEL = "document.getElementById('cancel').click()"
# Runs in the page: the level meter, its dBFS reading and the page TTFA, every 50 ms, until 20
# readings showed a level (a CPU that makes the audio slower than real time plays it in bursts).
SAMPLE_WHAT_THE_USER_SEES = """(async () => {
  const samples = [];
  const deadline = performance.now() + 60000;
  while (samples.filter((s) => s.level > 0).length < 20 && performance.now() < deadline) {
    samples.push({
      level: document.getElementById("out-level").value,
      db: document.getElementById("out-db").textContent,
      ttfa: document.getElementById("stat-page-ttfa").textContent,
    });
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  return samples;
})()"""


def test_demo_page_shows_a_random_model(tmp_path: Path) -> None:
    """On ``random:tiny`` (RMS 0.0015 to 0.003) the page used to look dead: flat waveform,
    level meter at 0, page TTFA "-", barge-in "0 ms (quiet)", no microphone barge-in."""
    config = Config(
        model=ModelConfig(model="random:tiny", device="cpu"),
        engine=EngineConfig(max_streams=4, seed=0),
        server=ServerConfig(host="127.0.0.1", port=0, voices_dir=str(tmp_path / "voices")),
    )
    out: dict[str, Any] = {}
    keep = os.environ.get("VOICE_OUT_BROWSER_ARTIFACTS")
    try:
        asyncio.run(asyncio.wait_for(random_model_page(config, tmp_path / "profile", out), 600))
    finally:
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            if "demo-random.png" in out:
                (Path(keep) / "demo-random.png").write_bytes(out.pop("demo-random.png"))
            (Path(keep) / "random.json").write_text(json.dumps(out, indent=2, default=str))
    # the menu offers the server's default voice (the model's built-in "noise") and selects it
    assert out["menu"] == [["", "server default (noise)", True], ["noise", "noise", False]], out["menu"]
    m = out["measured"]
    threshold = m["audio"]["threshold"]
    # the track's silence stays far below the threshold: nothing is heard before the first delta
    assert out["idle_levels"] and max(out["idle_levels"]) < threshold / 4, max(out["idle_levels"])
    assert all(o["t"] > m["marks"]["firstDeltaSent"] for o in m["audio"]["onsets"])
    # the level meter moves (a dBFS scale: the noise is ~-50 dBFS) and the page TTFA shows
    levels = [s["level"] for s in out["samples"]]
    assert len({round(v, 3) for v in levels if v > 0}) >= 5, levels  # 20 readings with a level
    assert max(levels) > 0.2, levels
    assert any(s["db"].endswith("dBFS") for s in out["samples"]), out["samples"]
    shown = out["samples"][-1]["ttfa"]
    assert shown.endswith(("ms", " s")) and shown[0].isdigit(), shown
    first, second = (m["utterances"][i] for i in m["utterances"])
    for u in (first, second):
        assert u["voice"] is None and u["pageTtfaMs"] is not None, u
        assert u["serverTtfaMs"] <= u["pageTtfaMs"], u  # (no bound: a loaded CPU is slower than real time)
    assert m["audio"]["maxRms"] < 0.05, m["audio"]["maxRms"]  # it is the quiet noise indeed
    # barge-in: read as a time (the page heard the sound end), by button and by microphone
    button, mic = m["bargeIns"]
    assert button["reason"] == "button" and button["ms"] is not None and button["ms"] < MAX_BARGE_IN_MS, button
    # the page heard the sound it cut (it had heard nothing before, and read "0 ms (quiet)"),
    # and shows what it measured (0 when the sound stopped before the cancel went out)
    assert button["lastAudibleAt"] is not None and button["lastAudibleAt"] > button["at"] - 100, button
    ms = round(button["ms"])
    assert out["bargein_shown"] == (f"{ms} ms" if ms > 0 else "0 ms (quiet)"), (out["bargein_shown"], button)
    assert mic["reason"] == "microphone" and mic["ms"] is not None and mic["ms"] < MAX_BARGE_IN_MS, mic
    assert [e["type"] for e in m["events"] if e["type"] == "error"] == []


# ------------------------------------------------------------------------------------------------
# Page TTFA: a sound after a pause is not the first sound of the next, queued utterance


async def pause_then_queued(profile: Path) -> dict[str, Any]:
    engine = FakeEngine(voices=("alice", "bob"), default_voice=None)
    async with serving(create_app(Config(), engine, FakeVoiceStore(engine))) as base_url, chromium(profile) as page:
        await page.send("Page.navigate", {"url": base_url + "/"})
        await page.wait_for("window.voiceOut && window.voiceOut.loaded", 15, "the demo page to load")
        await page.evaluate("voiceOut.connect().then(() => voiceOut.listVoices())")
        menu = await page.evaluate("[...document.getElementById('voice').options].map((o) => [o.value, o.selected])")
        # the first: a tone, a 0.8 s pause, a tone, a 0.6 s pause; the second, queued behind it
        first = await page.evaluate(f"voiceOut.speak({json.dumps('Hello' + '~' * 20 + 'there' + '~' * 15)})")
        second = await page.evaluate("voiceOut.speak('And the second one.')")
        await page.wait_for(f"voiceOut.utterances[{json.dumps(second)}].status === 'done'", 20, "audio.done")
        await page.wait_for("!voiceOut.audio.audible", 5, "silence")
        return {"menu": menu, "ids": (first, second), "summary": await page.evaluate("voiceOut.summary()")}


def test_page_ttfa_is_never_before_the_servers(tmp_path: Path) -> None:
    r = asyncio.run(asyncio.wait_for(pause_then_queued(tmp_path / "profile"), TEST_TIMEOUT_S))
    # no default voice on the server: the menu selects a registered one (no no_voice on Speak)
    assert r["menu"] == [["alice", True], ["bob", False]], r["menu"]
    first_id, second_id = r["ids"]
    s = r["summary"]
    first, second = s["utterances"][first_id], s["utterances"][second_id]
    assert first["voice"] == "alice" and [e for e in s["events"] if e["type"] == "error"] == []
    onsets = s["audio"]["onsets"]
    # the sound after the first one's pause came while the second was queued; nobody's first
    resumed = [o for o in onsets if first["firstAudibleAt"] < o["t"] < second["firstAudibleAt"]]
    assert resumed and all(o["id"] is None for o in resumed), onsets
    assert resumed[0]["t"] < second["startedAt"], (resumed, second)
    for u in (first, second):
        assert u["pageTtfaMs"] is not None and u["serverTtfaMs"] <= u["pageTtfaMs"], u


def test_a_browser_that_dies_is_reported_with_its_last_output(tmp_path: Path) -> None:
    """A browser lost mid-run (a crash, a missing font) ends the run with Chromium's own words."""

    async def run() -> None:
        async with chromium(tmp_path / "profile") as page:
            with contextlib.suppress(DevToolsError, TimeoutError):
                await page.send("Browser.crash", timeout_s=5)
            await page.evaluate("1 + 1")

    with pytest.raises(DevToolsError, match="Chromium's last output"):
        asyncio.run(asyncio.wait_for(run(), TEST_TIMEOUT_S))
