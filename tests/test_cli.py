from __future__ import annotations

import subprocess
import sys

import pytest

from voice_out.cli import build_parser, main

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
