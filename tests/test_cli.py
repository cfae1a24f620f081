from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from voice_out.cli import build_parser, log_level, main

SUBCOMMANDS = ["serve", "say", "voices", "bench", "download"]


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
def test_every_subcommand_has_help(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: voice-out {cmd}")


def test_console_script_runs() -> None:
    r = subprocess.run([sys.executable, "-m", "voice_out.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for cmd in SUBCOMMANDS:
        assert cmd in r.stdout


def test_bad_config_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["download", "--set", "server.port=banana"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().count("\n") == 0
    assert err.startswith("voice-out: error: server.port = 'banana' is invalid")


def test_download_random_model_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["download", "random:tiny"]) == 2
    assert "nothing to download" in capsys.readouterr().err


def test_parser_lists_all() -> None:
    p = build_parser()
    text = p.format_help()
    for cmd in SUBCOMMANDS:
        assert cmd in text


@pytest.mark.parametrize(
    ("argv", "env", "level"),
    [
        (["serve"], "", "INFO"),
        (["bench"], "", "INFO"),
        (["say", "hi"], "", "WARNING"),
        (["voices", "list"], "", "WARNING"),
        (["say", "hi", "--log-level", "debug"], "", "DEBUG"),
        (["serve"], "error", "ERROR"),
        (["serve", "--log-level", "warning"], "debug", "WARNING"),
    ],
)
def test_log_level_by_command_option_and_environment(
    argv: list[str], env: str, level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The long-running commands log their start-up (the memory plan, captures) at info; the
    option beats the environment, which beats the command's default."""
    monkeypatch.setenv("VOICE_OUT_LOG_LEVEL", env)
    assert log_level(build_parser().parse_args(argv)) == getattr(logging, level)


def test_a_bad_log_level_in_the_environment_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VOICE_OUT_LOG_LEVEL", "loud")
    assert main(["voices", "list"]) == 2
    assert capsys.readouterr().err.strip() == (
        "voice-out: error: VOICE_OUT_LOG_LEVEL='loud': expected one of debug, info, warning, error"
    )


def test_the_start_up_log_reaches_stderr(tmp_path: Path) -> None:
    """A command run as a user runs it (no logging configured by anyone else) prints the
    engine's plan line at info, and nothing of it at the default warning of ``say``."""
    base = [sys.executable, "-m", "voice_out.cli", "say", "Hi.", "--model", "random:tiny", "--device", "cpu"]
    base += ["--voices-dir", str(tmp_path / "v"), "-o", str(tmp_path / "a.wav")]
    env = {k: v for k, v in os.environ.items() if k != "VOICE_OUT_LOG_LEVEL"}
    loud = subprocess.run([*base, "--log-level", "info"], capture_output=True, text=True, timeout=300, env=env)
    assert loud.returncode == 0, loud.stderr
    assert "INFO voice_out.engine" in loud.stderr and "plan: cpu" in loud.stderr
    quiet = subprocess.run(base, capture_output=True, text=True, timeout=300, env=env)
    assert quiet.returncode == 0, quiet.stderr
    assert "plan: cpu" not in quiet.stderr and " INFO " not in quiet.stderr
