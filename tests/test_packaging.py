"""The demo page ships with the package: found in a checkout and in a built wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from voice_out.server.app import WEB_DIR, find_web_dir

PAGE = {"index.html", "app.js", "style.css", "meter-worklet.js"}


def test_the_checkout_serves_its_web_dir() -> None:
    assert WEB_DIR == REPO_ROOT / "web"
    assert PAGE <= {p.name for p in (REPO_ROOT / "web").iterdir()}


def test_find_web_dir_takes_the_first_with_a_page(tmp_path: Path) -> None:
    empty, installed = tmp_path / "a", tmp_path / "share" / "voice_out" / "web"
    empty.mkdir()
    installed.mkdir(parents=True)
    assert find_web_dir([empty, installed]) is None
    (installed / "index.html").write_text("<html></html>")
    assert find_web_dir([tmp_path / "missing", empty, installed]) == installed


def test_a_wheel_carries_the_page(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    for name in ("voice_out", "web"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("voice_out-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n.rsplit("/", 1)[1] for n in names if "/data/share/voice_out/web/" in n}
    assert shipped == PAGE
    assert any(n.endswith("voice_out/server/app.py") for n in names)


def test_pyproject_reads_without_a_build_warning() -> None:
    """setuptools reads the metadata without its warnings (a license given as a TOML table
    printed a deprecation block on every install)."""
    import warnings

    setuptools = pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration  # type: ignore[import-untyped]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(setuptools.Distribution(), REPO_ROOT / "pyproject.toml")
    assert [str(w.message).splitlines()[0] for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"
