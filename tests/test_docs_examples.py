"""Every fenced ``python`` block of README.md and docs/*.md runs, as written, on ``random:tiny``.

Each block runs in a fresh interpreter whose environment points the configuration the
``voice-out`` commands read at the tiny random model on the CPU (``VOICE_OUT_MODEL_MODEL``,
``VOICE_OUT_MODEL_DEVICE``, an empty voices directory). A block that talks to a server
(``VOICE_OUT_URL``) gets one: ``voice-out serve`` on that model, on a free port.

A block that cannot run is marked in the Markdown, on the line before its fence, with
``<!-- illustrative: why -->``; it must still compile. Keep those few and say why: an API
sketch with placeholders, or one that needs the real model's files.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

ILLUSTRATIVE = re.compile(r"<!--\s*illustrative:\s*(?P<why>\S.*?)\s*-->")
#: The blocks that do not run, per file: API sketches with placeholders (llm.md, token2wav.md),
#: a fragment of a LiveKit agent and a client of a registered voice (agents.md), and the voice
#: store, which needs a real model's prompt networks and a recording (voices.md); the tests
#: named in each marker run those calls.
ILLUSTRATIVE_BLOCKS = {"docs/agents.md": 1, "docs/llm.md": 1, "docs/token2wav.md": 2, "docs/voices.md": 2}
RUN_TIMEOUT_S = 300
SERVE_START_S = 240


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    illustrative: str | None  # why it cannot run, or None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"


def python_blocks(path: Path) -> Iterator[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            assert j < len(lines), f"{path}:{start + 1}: unterminated code block"
            before = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            marker = ILLUSTRATIVE.search(before)
            yield Block(path, start + 1, "\n".join(lines[start + 1 : j]) + "\n", marker["why"] if marker else None)
            i = j
        i += 1


def all_blocks() -> list[Block]:
    files = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    return [b for f in files for b in python_blocks(f)]


BLOCKS = all_blocks()
RUNNABLE = [b for b in BLOCKS if b.illustrative is None]


def test_the_docs_have_examples_and_few_are_illustrative() -> None:
    names = {b.name.split(":")[0] for b in RUNNABLE}
    assert {"README.md", "docs/engine.md", "docs/protocol.md", "docs/text.md"} <= names, names
    illustrative = [b for b in BLOCKS if b.illustrative is not None]
    per_file: dict[str, int] = {}
    for b in illustrative:
        per_file[b.name.split(":")[0]] = per_file.get(b.name.split(":")[0], 0) + 1
    assert per_file == ILLUSTRATIVE_BLOCKS, "a new illustrative block: make it run, or justify it here"
    for b in illustrative:
        assert len(b.illustrative or "") >= 20, f"{b.name}: say why it cannot run"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.illustrative], ids=lambda b: b.name)
def test_an_illustrative_block_compiles(block: Block) -> None:
    compile(block.code, block.name, "exec")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def example_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOICE_OUT_") or k == "VOICE_OUT_PARITY_DIR"}
    env.update(
        PYTHONPATH=str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        VOICE_OUT_MODEL_MODEL="random:tiny",
        VOICE_OUT_MODEL_DEVICE="cpu",
        VOICE_OUT_SERVER_VOICES_DIR=str(tmp_path / "voices"),
    )
    return env


def wait_healthy(url: str, server: subprocess.Popen[str], log: Path) -> None:
    deadline = time.monotonic() + SERVE_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"voice-out serve exited with {server.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"voice-out serve was not healthy within {SERVE_START_S} s")


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_the_example_runs(block: Block, tmp_path: Path) -> None:
    env = example_env(tmp_path)
    script = tmp_path / "example.py"
    script.write_text(block.code, encoding="utf-8")
    server: subprocess.Popen[str] | None = None
    server_log = tmp_path / "serve.log"
    if "VOICE_OUT_URL" in block.code:
        port = free_port()
        log = server_log.open("w")
        env["VOICE_OUT_URL"] = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [sys.executable, "-m", "voice_out.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )
    try:
        if server is not None:
            wait_healthy(env["VOICE_OUT_URL"], server, server_log)
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
    finally:
        if server is not None:
            server.terminate()  # a graceful stop; the example's subject is the client
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(30)
            log.close()
    served = server_log.read_text()[-2000:] if server is not None else ""
    assert done.returncode == 0, f"{block.name} failed:\n{done.stderr[-3000:]}\nserver:\n{served}"
