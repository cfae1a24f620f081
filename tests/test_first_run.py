"""What a newcomer hits on a first run (issue 34): the length of random-weight speech, a CUDA
device on a CPU-only torch, a port in use, an unregistered default voice, the config that
``Engine.load`` reads, the random-weights warning.

The engines here are built (``Engine.load``: dims, tokenizer, voice book) but not started,
except where a start-up failure is the point.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT
from voice_out.cli import main
from voice_out.config import Config, ModelConfig, ServerConfig
from voice_out.engine.build import RANDOM_TOKENS_PER_TEXT_TOKEN, BuildOptions
from voice_out.engine.engine import Engine, EngineStartError
from voice_out.engine.placement import Placement
from voice_out.engine.scheduler import ForcedTokens
from voice_out.server import app as app_module

CPU_ONLY_TORCH = not torch.backends.cuda.is_built()


@pytest.fixture(autouse=True)
def _no_voice_out_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # the engines of these tests read the environment's config (Engine.load without a config)
    monkeypatch.delenv("VOICE_OUT_CONFIG", raising=False)
    for key in [k for k in os.environ if k.startswith(("VOICE_OUT_MODEL_", "VOICE_OUT_ENGINE_", "VOICE_OUT_SERVER_"))]:
        monkeypatch.delenv(key)


def tiny(tmp_path: Path, **server: object) -> Config:
    return Config(
        model=ModelConfig(model="random:tiny", device="cpu"),
        server=ServerConfig(voices_dir=str(tmp_path / "voices"), **server),  # type: ignore[arg-type]
    )


# ------------------------------------------------------------------------------------------------
# 2. random weights: one length rule for serve, say and the in-process API


def test_random_weights_speak_a_capped_length_whoever_loads_them(tmp_path: Path) -> None:
    """``serve`` (``load_runtime``), ``say`` and an embedding agent (``Engine.load(cfg)``) get
    the same forced length for random weights; real weights stop on EOS; None forces nothing."""
    cap = ForcedTokens(RANDOM_TOKENS_PER_TEXT_TOKEN)
    served, _ = app_module.load_runtime(tiny(tmp_path))  # the server's placement of one engine
    assert isinstance(served, Placement)
    (engine,) = served.engines
    assert isinstance(engine, Engine) and engine.forced == cap
    assert Engine.load(tiny(tmp_path), options=BuildOptions(warmup=False)).forced == cap  # what say.py calls
    assert Engine.load(tiny(tmp_path), options=BuildOptions(warmup=False, forced=None)).forced is None
    assert Engine.load(
        tiny(tmp_path), options=BuildOptions(warmup=False, forced=ForcedTokens(5))
    ).forced == ForcedTokens(5)


def test_real_weights_are_not_capped(tmp_path: Path, parity_dir: Path) -> None:
    cfg = Config(model=ModelConfig(model=str(parity_dir), device="cpu", offline=True))
    assert Engine.load(cfg, options=BuildOptions(warmup=False)).forced is None


def test_say_loads_its_engine_like_serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``say`` passes no length rule of its own (it had one; ``serve`` had none)."""
    from voice_out.engine import say as say_module

    seen: list[Engine] = []
    real_load = Engine.load

    def load(*args: object, **kw: object) -> Engine:
        eng = real_load(*args, **kw)  # type: ignore[arg-type]
        seen.append(eng)
        raise SystemExit(7)  # stop before the model runs

    monkeypatch.setattr(say_module.Engine, "load", load)
    with pytest.raises(SystemExit):
        main(["say", "Hello.", "--model", "random:tiny", "--device", "cpu", "-o", str(tmp_path / "a.wav")])
    assert [e.forced for e in seen] == [ForcedTokens(RANDOM_TOKENS_PER_TEXT_TOKEN)]


# ------------------------------------------------------------------------------------------------
# 12. the random-weights warning, once


def test_the_random_weights_warning_prints_once() -> None:
    code = (
        "from voice_out.engine.build import BuildOptions; from voice_out.engine.engine import Engine; "
        "Engine.load(model='random:tiny', device='cpu', options=BuildOptions(warmup=False))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stderr.count("RANDOM WEIGHTS") == 1, done.stderr


# ------------------------------------------------------------------------------------------------
# 6. Engine.load reads the config every command reads


def test_engine_load_reads_the_config_file_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    voices = tmp_path / "voices"
    config = tmp_path / "voice_out.toml"
    config.write_text(f'[server]\nvoices_dir = "{voices}"\ndefault_voice = "noise"\n[engine]\nmax_streams = 3\n')
    monkeypatch.setenv("VOICE_OUT_CONFIG", str(config))
    monkeypatch.setenv("VOICE_OUT_ENGINE_MAX_TEXT_CHARS", "1234")
    eng = Engine.load(model="random:tiny", device="cpu", options=BuildOptions(warmup=False))
    assert eng.config.engine.max_streams == 3
    assert eng.config.engine.max_text_chars == 1234
    assert eng.config.server.voices_dir == str(voices)
    assert eng.config.model.model == "random:tiny"  # the arguments override the file
    monkeypatch.setenv("VOICE_OUT_ENGINE_MAX_STREAMS", "many")
    with pytest.raises(ValueError, match="engine.max_streams = 'many'"):
        Engine.load(model="random:tiny", device="cpu", options=BuildOptions(warmup=False))


# ------------------------------------------------------------------------------------------------
# 7. a CUDA device on a CPU-only torch: one line naming the fix


@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="needs a CPU-only torch build")
@pytest.mark.parametrize("command", ["say", "serve"])
def test_cuda_on_a_cpu_only_torch_is_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    args = [command, "--model", "random:tiny", "--device", "cuda", "--voices-dir", str(tmp_path / "v")]
    args += ["Hello.", "-o", str(tmp_path / "a.wav")] if command == "say" else ["--port", "0"]
    with caplog.at_level(logging.ERROR):
        assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "RANDOM WEIGHTS" not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("voice-out: error: model.device = 'cuda'"), err
    assert "CPU-only" in lines[0] and "CUDA build of torch" in lines[0] and "--device cpu" in lines[0]
    assert "Traceback" not in err and [r for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.asyncio
async def test_a_start_up_failure_is_said_once(tmp_path: Path) -> None:
    """The server reports the worker's start-up failure with one prefix (it had two)."""
    from aiohttp.test_utils import TestServer

    eng = Engine.load(tiny(tmp_path), options=BuildOptions(warmup=False))

    def broken() -> object:
        raise RuntimeError("out of memory on purpose")

    eng._runner_factory = broken  # type: ignore[assignment]
    server = TestServer(app_module.create_app(tiny(tmp_path), eng, None), host="127.0.0.1")
    with pytest.raises(EngineStartError) as e:
        await server.start_server()
    await server.close()
    assert str(e.value) == "the engine failed to start: RuntimeError: out of memory on purpose"


# ------------------------------------------------------------------------------------------------
# 4. no_voice says how to set a default


def test_no_voice_says_how_to_name_one_or_set_a_default(tmp_path: Path) -> None:
    from voice_out.engine.api import NoVoiceError
    from voice_out.engine.voicebook import VoiceBook
    from voice_out.voices.store import VoiceStore

    book = VoiceBook(VoiceStore(tmp_path / "voices", None), lambda s: [1])
    with pytest.raises(NoVoiceError) as e:
        book.resolve(None)
    for fix in ("voice-out voices add", "voice-out serve --voice NAME", "server.default_voice"):
        assert fix in str(e.value), str(e.value)
    with pytest.raises(NoVoiceError) as e:
        VoiceStore(tmp_path / "voices", None).resolve(None)
    assert "--voice NAME" in str(e.value) and "server.default_voice" in str(e.value)


def test_serve_voice_sets_the_default_voice(tmp_path: Path) -> None:
    from voice_out.cli import build_parser, load_cli_config

    cfg = load_cli_config(build_parser().parse_args(["serve", "--voice", "alice"]))
    assert cfg.server.default_voice == "alice"


# ------------------------------------------------------------------------------------------------
# 8. an unregistered default voice fails at start


def test_an_unregistered_default_voice_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(app_module.UnknownDefaultVoiceError) as e:
        app_module.load_runtime(tiny(tmp_path, default_voice="bob"))
    message = str(e.value)
    assert message.startswith("server.default_voice = 'bob' is not a registered voice"), message
    assert "noise" in message and "voice-out voices add bob" in message
    engine, _ = app_module.load_runtime(tiny(tmp_path, default_voice="noise"))  # the built-in one
    assert engine.voice_names() == ["noise"]


def test_serve_says_it_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["serve", "--model", "random:tiny", "--device", "cpu", "--port", "0", "--voices-dir", str(tmp_path)]
    assert main([*args, "--set", "server.default_voice=bob"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "RANDOM WEIGHTS" not in line]
    assert len(err) == 1 and err[0].startswith("voice-out: error: server.default_voice = 'bob'"), err


# ------------------------------------------------------------------------------------------------
# 9. a port in use, before the model loads


def test_a_port_in_use_is_reported_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded: list[Config] = []

    def load_runtime(cfg: Config) -> tuple[None, None]:
        loaded.append(cfg)
        return None, None

    monkeypatch.setattr(app_module, "load_runtime", load_runtime)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = main(["serve", "--model", "random:tiny", "--host", "127.0.0.1", "--port", str(port)])
    err = capsys.readouterr().err
    assert rc == 2 and loaded == []
    assert err.startswith(f"voice-out: error: cannot listen on 127.0.0.1:{port}: ") and "--port" in err, err
    assert err.count("\n") == 1


def test_check_port_accepts_a_free_port() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app_module.check_port("127.0.0.1", port)  # free again: no error
    with pytest.raises(app_module.ListenError, match="cannot listen on no-such-host.invalid"):
        app_module.check_port("no-such-host.invalid", port)
    with pytest.raises(app_module.ListenError, match="cannot listen on 192.0.2.1"):  # not this machine's
        app_module.check_port("192.0.2.1", port)
    app_module.check_port("localhost", port)  # IPv4 and (where the host has it) IPv6
