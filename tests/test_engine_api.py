"""The ``EngineLike`` / ``Stream`` contract: every engine the project ships or tests with
implements all of it, so a transport calls it without probing (no ``inspect``/``getattr``).

The assignments in :func:`_static_conformance` are checked by mypy (``make test`` runs it on
tests/): a missing or differently typed member fails the type check. The runtime test pins the
keyword options of ``open_stream`` to the protocol's, so that one added to the real engine is
added to the protocol (and every fake) too.
"""

from __future__ import annotations

import inspect

from tests.fakes import FakeEngine, FakeStream
from voice_out.engine.api import EngineLike, Stream
from voice_out.engine.engine import Engine
from voice_out.engine.stream import EngineStream


def _static_conformance(engine: Engine, fake: FakeEngine, stream: EngineStream, fake_stream: FakeStream) -> None:
    engines: list[EngineLike] = [engine, fake]
    streams: list[Stream] = [stream, fake_stream]
    assert engines and streams


def _params(fn: object) -> list[tuple[str, object, object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(n, p.kind, p.default) for n, p in sig.parameters.items() if n != "self"]


def test_open_stream_options_match_the_protocol() -> None:
    expected = _params(EngineLike.open_stream)
    assert [n for n, *_ in expected] == [
        "voice",
        "stream_id",
        "seed",
        "auto_ack",
        "fast_first",
        "instructions",
        "speed",
    ]
    assert _params(Engine.open_stream) == expected
    assert _params(FakeEngine.open_stream) == expected


def test_stream_and_lifecycle_members() -> None:
    for member in ("ack", "cancel", "push_text", "end_text", "__aiter__"):
        assert callable(getattr(EngineStream, member)) and callable(getattr(FakeStream, member))
    for member in ("__aenter__", "__aexit__"):
        assert inspect.iscoroutinefunction(getattr(Engine, member))
        assert inspect.iscoroutinefunction(getattr(FakeEngine, member))
