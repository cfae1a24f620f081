"""Model resolution and the real download path, against a fake hub on loopback."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.fake_hub import fake_hub
from voice_out.cli import main
from voice_out.hub import REQUIRED_FILES, ModelNotFoundError, download, resolve_model

REPO_ID = "acme/CosyVoice2-test"


def _make_model_dir(root: Path) -> Path:
    for rel in REQUIRED_FILES:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f"content of {rel}".encode() * 50)
    (root / "README.md").write_text("not needed for inference")
    (root / "flow.decoder.estimator.fp32.onnx").write_bytes(b"x" * 100)  # skipped by the patterns
    return root


@pytest.fixture
def hub_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")


def test_download_then_resolve_from_cache(tmp_path: Path, hub_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _make_model_dir(tmp_path / "remote")
    cache = tmp_path / "cache"
    with fake_hub(src, REPO_ID) as (endpoint, requests):
        snap = download(REPO_ID, str(cache), endpoint=endpoint)
    assert any("/resolve/" in r for r in requests)
    for rel in REQUIRED_FILES:
        assert (snap / rel).read_bytes() == (src / rel).read_bytes()
    assert not (snap / "flow.decoder.estimator.fp32.onnx").exists()
    assert not (snap / "README.md").exists()
    # Offline now: resolution finds the cached snapshot without any network.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve_model(REPO_ID, str(cache), offline=True)
    assert source.path is not None and source.path.resolve() == snap.resolve()


def test_cli_download_prints_path(tmp_path: Path, hub_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    src = _make_model_dir(tmp_path / "remote")
    with fake_hub(src, REPO_ID) as (endpoint, _):
        rc = main(["download", REPO_ID, "--cache-dir", str(tmp_path / "c"), "--endpoint", endpoint])
    assert rc == 0
    out = Path(capsys.readouterr().out.strip())
    assert (out / "llm.pt").is_file()


def test_unknown_repo_is_clear(tmp_path: Path, hub_env: None) -> None:
    src = _make_model_dir(tmp_path / "remote")
    with fake_hub(src, REPO_ID) as (endpoint, _), pytest.raises(ModelNotFoundError) as e:
        download("acme/does-not-exist", str(tmp_path / "c"), endpoint=endpoint)
    assert "acme/does-not-exist" in str(e.value)
    assert "\n" not in str(e.value)


def test_incomplete_repo_is_reported(tmp_path: Path, hub_env: None) -> None:
    src = _make_model_dir(tmp_path / "remote")
    (src / "hift.pt").unlink()
    with fake_hub(src, REPO_ID) as (endpoint, _), pytest.raises(ModelNotFoundError, match="lacks hift.pt"):
        download(REPO_ID, str(tmp_path / "c"), endpoint=endpoint)


def test_unreachable_hub_names_the_fix(tmp_path: Path, hub_env: None) -> None:
    # Port 9 on loopback: nothing listens; connection refused at once.
    with pytest.raises(ModelNotFoundError) as e:
        download(REPO_ID, str(tmp_path / "c"), endpoint="http://127.0.0.1:9")
    msg = str(e.value)
    assert "voice-out download" in msg and "--model" in msg
    assert "\n" not in msg


def test_offline_missing_model_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(REPO_ID, str(tmp_path / "empty"), offline=True)
    assert f"voice-out download {REPO_ID}" in str(e.value)


def test_local_directory_and_random(tmp_path: Path) -> None:
    d = _make_model_dir(tmp_path / "m")
    assert resolve_model(str(d), str(tmp_path)).path == d
    (d / "llm.pt").unlink()
    with pytest.raises(ModelNotFoundError, match="lacks llm.pt"):
        resolve_model(str(d), str(tmp_path))
    assert resolve_model("random:tiny", str(tmp_path)).random_preset == "tiny"
    with pytest.raises(ModelNotFoundError, match="unknown random model"):
        resolve_model("random:huge", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="neither an existing directory"):
        resolve_model(str(tmp_path / "nope" / "deeper"), str(tmp_path))
    shutil.rmtree(d)
