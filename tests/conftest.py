"""Shared fixtures and marker handling.

* ``slow`` tests are skipped unless selected (``-m slow`` or ``--run-slow``).
* ``requires_cuda`` tests are skipped when torch sees no CUDA device.
* ``browser`` tests are skipped when no Chromium binary is installed (or named by
  ``$VOICE_OUT_CHROMIUM``); under CI (``CI`` set) they fail instead: CI installs it.
* ``parity_dir``: the parity model directory, from ``VOICE_OUT_PARITY_DIR`` (default
  ``../shared/parity/tiny-a`` relative to the repository root). Parity tests read every
  dimension from it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from voice_out.bench.chromium import find_chromium

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PARITY_DIR = REPO_ROOT.parent / "shared" / "parity" / "tiny-a"


def parity_dir_path() -> Path:
    return Path(os.environ.get("VOICE_OUT_PARITY_DIR", str(DEFAULT_PARITY_DIR))).resolve()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="run the tests marked slow too (also selected by a -m expression naming slow, e.g. -m slow)",
    )


def slow_selected(config: pytest.Config) -> bool:
    """``slow`` tests are opt-in: ``--run-slow``, or a ``-m`` expression that asks for them
    (``-m slow``, ``-m "slow and not browser"``; not ``-m "not slow"``)."""
    if config.getoption("--run-slow"):
        return True
    markexpr = str(config.getoption("markexpr") or "")
    return "slow" in markexpr and "not slow" not in markexpr


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = _cuda_available()
    chromium = find_chromium() is not None or bool(os.environ.get("CI"))  # CI: fail in setup
    slow = slow_selected(config)
    for item in items:
        if "slow" in item.keywords and not slow:
            item.add_marker(pytest.mark.skip(reason="slow: select with -m slow or --run-slow"))
        if "requires_cuda" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "browser" in item.keywords and not chromium:
            item.add_marker(pytest.mark.skip(reason="needs Chromium (apt-get install chromium)"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "browser" in item.keywords and os.environ.get("CI") and find_chromium() is None:
        # CI installs Chromium (.ci/run): missing, the browser tests must not pass silently
        pytest.fail("needs Chromium (apt-get install chromium), which CI must have")


@pytest.fixture(scope="session")
def parity_dir() -> Path:
    d = parity_dir_path()
    if not (d / "cosyvoice2.yaml").is_file():
        msg = f"parity directory {d} not found (set VOICE_OUT_PARITY_DIR)"
        if os.environ.get("CI"):
            pytest.fail(msg)  # CI always has it: a missing directory must not pass silently
        pytest.skip(msg)
    return d


@pytest.fixture(scope="session")
def cases_dir(parity_dir: Path) -> Path:
    return parity_dir / "cases"


def load_case(cases_dir: Path, name: str) -> dict[str, Any]:
    """A parity case file (``<name>.pt``, loaded weights-only); skips when the directory lacks it."""
    import torch

    path = cases_dir / f"{name}.pt"
    if not path.is_file():
        pytest.skip(f"{path} not in the parity directory")
    case: dict[str, Any] = torch.load(path, weights_only=True)
    return case


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Small ops on a shared 2-core machine run far faster on one thread (no spin-waiting).
    Use per module: ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_voice(n_prompt: int, device: str = "cpu", seed: int = 5) -> tuple[Any, Any, Any]:
    """A synthetic token2wav voice (torch tensors): prompt tokens int32 ``[1, P]``, a smooth
    prompt mel float32 ``[1, 2P, 80]`` and a speaker embedding ``[1, 192]``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    token = torch.randint(0, 6561, (1, n_prompt), generator=g, dtype=torch.int32)
    feat = torch.randn(1, 2 * n_prompt, 80, generator=g).cumsum(1) * 0.05 - 6.0
    emb = torch.randn(1, 192, generator=g)
    return token.to(device), feat.to(device), emb.to(device)


def random_speech(n: int, seed: int) -> list[int]:
    """``n`` random speech token ids."""
    import torch

    return [int(t) for t in torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed))]


def chunk_plans(stream: Any, tokens: Any, hops: Any = None, fast_first: int = 0, *, state: bool = False) -> list[Any]:
    """The chunks the engine's schedule makes of ``tokens`` (all known: a list or a ``[1, n]`` /
    ``[n]`` tensor) for a token2wav ``stream`` (its prompt length, whether it is whole), with
    ``hops`` (None: upstream's), ``fast_first`` and ``state`` as ``plan_all`` takes them."""
    from voice_out.engine.chunk_schedule import plan_all

    n = int(tokens.shape[-1]) if hasattr(tokens, "shape") else len(tokens)
    return plan_all(n, stream.prompt_tokens, hops, fast_first, state=state, whole=stream.whole)
