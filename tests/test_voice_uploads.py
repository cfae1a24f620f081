"""Hostile uploads to ``POST /voices`` (and deletes) against the real server and the real voice
store (the parity directory's prompt networks): nothing is written outside the voices
directory whatever the name, filename or body, and a large upload is refused with the
server's memory bounded while it streams in.
"""

from __future__ import annotations

import asyncio
import io
import os
import wave
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestServer

from tests.fakes import FakeEngine
from voice_out.config import ServerConfig
from voice_out.server.app import MAX_UPLOAD_BYTES, create_app
from voice_out.voices.store import VoiceStore


def wav_bytes(seconds: float = 3.0, rate: int = 16000) -> bytes:
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * rate)) / rate
    pcm = 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.3 * rng.standard_normal(t.shape))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(pcm, -1, 1) * 32767).astype(np.int16).tobytes())
    return buf.getvalue()


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: relative path -> (size, mtime_ns)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = Path(dirpath) / f
            st = path.stat()
            out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.asyncio
async def test_hostile_uploads_write_nothing_outside_the_voices_dir(tmp_path: Path, parity_dir: Path) -> None:
    voices_dir = tmp_path / "data" / "voices"
    voices_dir.mkdir(parents=True)
    outside = tmp_path / "data" / "precious"
    outside.mkdir()
    (outside / "manifest.json").write_text("{}")  # looks like a voice to a careless delete
    model_before = tree(parity_dir)
    engine = FakeEngine(voices=())
    store = VoiceStore(voices_dir, parity_dir)
    app = create_app(ServerConfig(voices_dir=str(voices_dir)), engine, store, web_dir=None)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    audio = wav_bytes()
    hostile_names = [
        "../precious",
        "..",
        ".",
        "a/../../precious",
        "/tmp/x",
        str(outside),
        "x\x00y",
        "..\\precious",
        ".hidden",
        "a" * 65,
        "ünï",
        " ",
        "",
        "precious/../..",
        "%2e%2e%2fprecious",
    ]
    before_outside = tree(tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            for name in hostile_names:
                form = aiohttp.FormData()
                form.add_field("name", name)
                form.add_field("transcript", "Hello there, this is a test.")
                form.add_field("audio", audio, filename="../../../precious/evil.wav", content_type="audio/wav")
                async with http.post(url + "/voices", data=form) as r:
                    body = await r.json()
                    assert r.status == 400 and body["error"]["code"] == "invalid_voice_name", (name, r.status, body)
            for name in ("..%2Fprecious", "%2e%2e", "..", "precious"):
                async with http.delete(url + "/voices/" + name) as r:
                    assert r.status in (400, 404, 405), (name, r.status)  # %2e%2e: the path is /: 405
                    assert r.content_type == "application/json"
            # garbage audio, a huge transcript, a traversal filename on a good name: refused
            refused: list[tuple[bytes, str, str | None]] = [
                (b"\x00" * 5000, "Hello there.", None),
                (audio, "word " * 100_000, "transcript_too_long"),
            ]
            for upload, transcript, code in refused:
                form = aiohttp.FormData()
                form.add_field("name", "mallory")
                form.add_field("transcript", transcript)
                form.add_field("audio", upload, filename="../../evil.wav")
                async with http.post(url + "/voices", data=form) as r:
                    body = await r.json()
                    assert r.status == 400 and (code is None or body["error"]["code"] == code), body
            # the one good upload lands inside the voices dir, under its own name only
            form = aiohttp.FormData()
            form.add_field("name", "alice")
            form.add_field("transcript", "Hello there, this is a test.")
            form.add_field("audio", audio, filename="../../../precious/evil.wav")
            async with http.post(url + "/voices", data=form) as r:
                assert r.status == 201, await r.text()
    finally:
        await server.close()
    after = tree(tmp_path / "data")
    outside_before = {k: v for k, v in before_outside.items() if not k.startswith("voices/")}
    outside_after = {k: v for k, v in after.items() if not k.startswith("voices/")}
    assert outside_after == outside_before
    assert {Path(k).parts[1] for k in after if k.startswith("voices/")} == {"alice"}
    assert tree(parity_dir) == model_before


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc (Linux)")
@pytest.mark.asyncio
async def test_a_large_upload_is_refused_with_memory_bounded(tmp_path: Path) -> None:
    engine = FakeEngine(voices=())
    # a read-only store (no prompt networks) would answer 501 only after reading the body:
    # the limit must hold before that
    store = VoiceStore(tmp_path / "voices", None)
    app = create_app(ServerConfig(voices_dir=str(tmp_path / "voices")), engine, store, web_dir=None)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    total = 4 * MAX_UPLOAD_BYTES  # 64 MiB, chunked: no Content-Length to refuse it by
    boundary = "XXbXX"
    piece = os.urandom(64 * 1024)

    async def body() -> AsyncIterator[bytes]:
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nbig\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="audio"; filename="a.wav"\r\n\r\n'
        ).encode()
        for _ in range(total // len(piece)):
            yield piece

    peak = 0
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_bytes())
            await asyncio.sleep(0.02)

    base = rss_bytes()
    sampler = asyncio.create_task(sample())
    try:
        async with aiohttp.ClientSession() as http:
            headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
            try:
                async with http.post(url + "/voices", data=body(), headers=headers) as r:
                    assert r.status == 413 and (await r.json())["error"]["code"] == "too_large"
            except aiohttp.ClientOSError:
                pass  # the server may close the socket on the rest of the body: a refusal too
    finally:
        stop.set()
        await sampler
        await server.close()
    # the limit (16 MiB) plus buffers, never the 64 MiB body
    assert peak - base < MAX_UPLOAD_BYTES + 24 * 1024 * 1024, (base, peak)
    assert not (tmp_path / "voices").exists() or not any((tmp_path / "voices").iterdir())
