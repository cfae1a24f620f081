"""Headless Chromium, driven through its DevTools protocol: the real-browser client.

The WebRTC benchmark's ``--client chromium`` and the browser tests open the demo page (web/)
in headless Chromium and read what the page itself measured (``window.voiceOut``, see
docs/browser.md). Chromium is driven over one DevTools WebSocket with aiohttp, so no
browser-automation package is needed; any Chromium build with ``--remote-debugging-port``
works, the full browser or the smaller ``chromium-headless-shell``.

Threads: everything here runs on the asyncio thread that created it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

#: Where :func:`find_chromium` looks, in order, after ``$VOICE_OUT_CHROMIUM``.
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chromium-headless-shell")

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # A closed network: without these Chromium keeps trying to reach Google's hosts.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
    "--autoplay-policy=no-user-gesture-required",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    # Offer real host addresses instead of mDNS names, and let WebRTC use loopback too.
    "--disable-features=WebRtcHideLocalIpsWithMdns",
    "--allow-loopback-in-peer-connection",
    "--window-size=1280,1200",
    # Containers often give /dev/shm only 64 MB, too little for the renderer's shared memory.
    "--disable-dev-shm-usage",
)
DEVTOOLS_LINE = re.compile(rb"DevTools listening on (ws://\S+)")
LAUNCH_TIMEOUT_S = 20.0
#: How long one DevTools command may take (an evaluation that awaits a promise included).
COMMAND_TIMEOUT_S = 30.0


class DevToolsError(RuntimeError):
    """The browser answered a DevTools command with an error, or went away."""


def find_chromium() -> str | None:
    """The Chromium binary to use: ``$VOICE_OUT_CHROMIUM``, else the first of
    :data:`CHROMIUM_NAMES` on ``PATH``; None when there is none."""
    named = os.environ.get("VOICE_OUT_CHROMIUM")
    if named:
        return named
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class DevTools:
    """A minimal Chrome DevTools protocol client: one browser WebSocket, flattened sessions."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for message in self._ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            future = self._pending.pop(data["id"], None) if "id" in data else None
            if future is None:
                self.events.append(data)
            elif not future.done():
                if "error" in data:
                    future.set_exception(DevToolsError(f"{data['error']}"))
                else:
                    future.set_result(data.get("result", {}))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(DevToolsError("the browser closed the DevTools connection"))

    async def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        session: str | None = None,
        timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> dict[str, Any]:
        """Send one command; return its result (raises :class:`DevToolsError`)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        await self._ws.send_str(json.dumps(message))
        return await asyncio.wait_for(future, timeout_s)

    async def close(self) -> None:
        await self._ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class Page:
    """One browser tab, attached through a flattened DevTools session."""

    def __init__(self, devtools: DevTools, session: str, version: str = "") -> None:
        self.devtools = devtools
        self.session = session
        #: The browser's product string (``Browser.getVersion``), e.g. ``HeadlessChrome/150.0...``.
        self.version = version

    async def send(
        self, method: str, params: dict[str, Any] | None = None, timeout_s: float = COMMAND_TIMEOUT_S
    ) -> dict[str, Any]:
        return await self.devtools.send(method, params, self.session, timeout_s)

    async def evaluate(self, expression: str, timeout_s: float = COMMAND_TIMEOUT_S) -> Any:
        """Evaluate JavaScript as if from a user gesture; await promises (for at most
        ``timeout_s``); return the value."""
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "awaitPromise": True, "returnByValue": True, "userGesture": True},
            timeout_s,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise DevToolsError(f"{expression!r} threw: {text}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float, what: str, poll_s: float = 0.05) -> Any:
        """Poll ``expression`` until it is truthy; return its value (``TimeoutError`` naming
        ``what``, the page's state and its console output after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                page_state = await self.evaluate("window.voiceOut ? JSON.stringify(voiceOut.summary()) : null")
                raise TimeoutError(
                    f"timed out after {timeout_s} s waiting for {what}\npage: {page_state}\n{self.console()}"
                )
            await asyncio.sleep(poll_s)

    def requested_urls(self) -> list[str]:
        """Every URL the page has requested so far."""
        return [
            e["params"]["request"]["url"]
            for e in self.devtools.events
            if e.get("method") == "Network.requestWillBeSent" and e.get("sessionId") == self.session
        ]

    def console(self) -> str:
        """The page's console output and uncaught exceptions so far (for failure messages)."""
        lines = []
        for event in self.devtools.events:
            if event.get("method") == "Runtime.consoleAPICalled":
                args = event["params"]["args"]
                lines.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in args))
            elif event.get("method") == "Runtime.exceptionThrown":
                details = event["params"]["exceptionDetails"]
                lines.append("exception: " + str(details.get("exception", {}).get("description", details)))
        return "\n".join(lines)

    async def screenshot(self) -> bytes:
        """The whole page as PNG."""
        result = await self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        return base64.b64decode(result["data"])


@contextlib.asynccontextmanager
async def chromium(
    profile_dir: Path, binary: str | None = None, extra_flags: Sequence[str] = ()
) -> AsyncIterator[Page]:
    """Launch headless Chromium (``binary``, else :func:`find_chromium`) with a fresh profile in
    ``profile_dir``; yield its first tab. The browser is closed, and its process reaped, on exit."""
    binary = binary or find_chromium()
    if binary is None:
        raise FileNotFoundError(
            "no Chromium found: install chromium (or chromium-headless-shell), or set VOICE_OUT_CHROMIUM"
        )
    process = await asyncio.create_subprocess_exec(
        binary,
        *CHROMIUM_FLAGS,
        *extra_flags,
        f"--user-data-dir={profile_dir}",
        "about:blank",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    stderr_tail: deque[bytes] = deque(maxlen=50)
    drainer: asyncio.Task[None] | None = None
    try:
        url = None
        async with asyncio.timeout(LAUNCH_TIMEOUT_S):
            while url is None:
                line = await process.stderr.readline()
                if not line:
                    raise DevToolsError("Chromium exited:\n" + b"".join(stderr_tail).decode(errors="replace"))
                stderr_tail.append(line)
                found = DEVTOOLS_LINE.search(line)
                url = found.group(1).decode() if found else None

        async def drain(stream: asyncio.StreamReader) -> None:
            while line := await stream.readline():
                stderr_tail.append(line)

        drainer = asyncio.get_running_loop().create_task(drain(process.stderr))
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(url, max_msg_size=0)
            devtools = DevTools(ws)
            try:
                version = (await devtools.send("Browser.getVersion")).get("product", "")
                target = await devtools.send("Target.createTarget", {"url": "about:blank"})
                attached = await devtools.send(
                    "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
                )
                page = Page(devtools, attached["sessionId"], version)
                await page.send("Runtime.enable")
                await page.send("Page.enable")
                await page.send("Network.enable")
                try:
                    yield page
                except (DevToolsError, aiohttp.ClientError) as e:
                    # The browser went away (a crash, a missing font or library): say why.
                    await asyncio.sleep(0.2)  # let the drainer read its last words
                    tail = b"".join(stderr_tail).decode(errors="replace").strip()
                    raise DevToolsError(f"{e}\nChromium's last output:\n{tail or '(none)'}") from e
            finally:
                with contextlib.suppress(Exception):
                    await devtools.send("Browser.close")
                await devtools.close()
    finally:
        if drainer is not None:
            drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drainer
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()
