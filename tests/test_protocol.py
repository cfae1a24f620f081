"""Protocol v1: parsing of every client message, serialization of every server message, and
every error code (the session-level ones through a Session on a fake engine, no WebRTC)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakes import FakeEngine, FakeScript
from voice_out.server import protocol as p
from voice_out.server.session import Session

# -- parsing: the good cases -------------------------------------------------------------------


def test_parse_every_client_message() -> None:
    assert p.parse('{"type":"text.delta","id":"u1","delta":"Hel"}') == p.TextDelta("u1", "Hel")
    assert p.parse('{"type":"text.delta","id":"u1","delta":"","voice":"bob"}') == p.TextDelta("u1", "", "bob")
    assert p.parse('{"type":"text.delta","id":"u1","delta":"","fast_first":12}') == p.TextDelta("u1", "", fast_first=12)
    assert p.parse('{"type":"text.delta","id":"u1","delta":"","fast_first":0}') == p.TextDelta("u1", "", fast_first=0)
    assert p.parse('{"type":"text.delta","id":"u1","delta":"a","alignment":true}') == p.TextDelta(
        "u1", "a", alignment=True
    )
    both = '{"type":"text.delta","id":"u1","delta":"","instructions":"Speak softly.","speed":2}'
    assert p.parse(both) == p.TextDelta("u1", "", instructions="Speak softly.", speed=2.0)
    assert p.parse('{"type":"text.done","id":"u1"}') == p.TextDone("u1")
    assert p.parse('{"type":"cancel"}') == p.Cancel(None)
    assert p.parse('{"type":"cancel","id":null}') == p.Cancel(None)
    assert p.parse('{"type":"cancel","id":"u7"}') == p.Cancel("u7")
    assert p.parse('{"type":"ping","t":12.5}') == p.Ping(12.5)
    assert p.parse('{"type":"ping","t":3}') == p.Ping(3)


def test_unknown_extra_fields_are_ignored() -> None:
    assert p.parse('{"type":"text.done","id":"a","future":1}') == p.TextDone("a")


def test_cancel_is_an_interrupt_and_text_is_data() -> None:
    assert isinstance(p.Cancel(), p.InterruptMessage)
    for msg in (p.TextDelta("a", "b"), p.TextDone("a"), p.Ping(1)):
        assert isinstance(msg, p.DataMessage)
        assert not isinstance(msg, p.InterruptMessage)


def test_unicode_text_round_trips() -> None:
    msg = p.parse(json.dumps({"type": "text.delta", "id": "ü", "delta": "你好, wörld 👋"}))
    assert msg == p.TextDelta("ü", "你好, wörld 👋")


# -- parsing: every parse-level error code -----------------------------------------------------

BAD_INPUT: list[tuple[str | bytes, p.ErrorCode]] = [
    ("not json", p.ErrorCode.BAD_JSON),
    ("", p.ErrorCode.BAD_JSON),
    ("[1, 2]", p.ErrorCode.BAD_JSON),
    ('"text.delta"', p.ErrorCode.BAD_JSON),
    ('{"type":"ping","t":NaN}', p.ErrorCode.BAD_JSON),
    (b'{"type":"cancel"}', p.ErrorCode.BAD_JSON),
    ('{"type":"text.delta","id":"a","delta":"' + "x" * p.MAX_MESSAGE_BYTES + '"}', p.ErrorCode.MESSAGE_TOO_LARGE),
    (
        '{"type":"text.delta","id":"a","delta":"' + "é" * (p.MAX_MESSAGE_BYTES // 2) + '"}',
        p.ErrorCode.MESSAGE_TOO_LARGE,
    ),
    ('{"id":"a"}', p.ErrorCode.MISSING_FIELD),
    ('{"type":"speak"}', p.ErrorCode.UNKNOWN_TYPE),
    ('{"type":"TEXT.DELTA","id":"a","delta":"x"}', p.ErrorCode.UNKNOWN_TYPE),
    ('{"type":7}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","delta":"x"}', p.ErrorCode.MISSING_FIELD),
    ('{"type":"text.delta","id":"a"}', p.ErrorCode.MISSING_FIELD),
    ('{"type":"text.done"}', p.ErrorCode.MISSING_FIELD),
    ('{"type":"ping"}', p.ErrorCode.MISSING_FIELD),
    ('{"type":"text.delta","id":"","delta":"x"}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":5,"delta":"x"}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"' + "i" * (p.MAX_ID_CHARS + 1) + '","delta":"x"}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":5}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":null}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","voice":3}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","voice":""}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","fast_first":"12"}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","fast_first":true}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","fast_first":-1}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","alignment":1}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","fast_first":1.5}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","fast_first":1001}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","speed":0.1}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","speed":"fast"}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","speed":true}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","instructions":7}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","instructions":""}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.delta","id":"a","delta":"x","instructions":"' + "y" * 501 + '"}', p.ErrorCode.BAD_FIELD),
    ('{"type":"text.done","id":["a"]}', p.ErrorCode.BAD_FIELD),
    ('{"type":"cancel","id":42}', p.ErrorCode.BAD_FIELD),
    ('{"type":"ping","t":"now"}', p.ErrorCode.BAD_FIELD),
    ('{"type":"ping","t":true}', p.ErrorCode.BAD_FIELD),
]


@pytest.mark.parametrize(("raw", "code"), BAD_INPUT, ids=[f"{c}-{i}" for i, (_, c) in enumerate(BAD_INPUT)])
def test_parse_errors_have_stable_codes(raw: str | bytes, code: p.ErrorCode) -> None:
    with pytest.raises(p.ProtocolError) as e:
        p.parse(raw)
    assert e.value.code is code
    assert e.value.message


def test_error_keeps_the_utterance_id_when_known() -> None:
    with pytest.raises(p.ProtocolError) as e:
        p.parse('{"type":"text.delta","id":"u9","delta":1}')
    assert e.value.id == "u9"
    err = p.error_from(e.value)
    assert json.loads(p.dumps(err)) == {"type": "error", "id": "u9", "code": "bad_field", "message": e.value.message}


def test_deeply_nested_json_is_bad_json_not_a_crash() -> None:
    with pytest.raises(p.ProtocolError) as e:
        p.parse("[" * 100000 + "]" * 100000)
    assert e.value.code in (p.ErrorCode.BAD_JSON, p.ErrorCode.MESSAGE_TOO_LARGE)
    with pytest.raises(p.ProtocolError) as e:
        p.parse("[" * 30000 + "]" * 30000)
    assert e.value.code is p.ErrorCode.BAD_JSON


# -- serialization -----------------------------------------------------------------------------


def test_server_messages_serialize_per_the_contract() -> None:
    cases: list[tuple[p.ServerMessage, dict[str, Any]]] = [
        (
            p.SessionReady("s1", 24000, ("alice", "bob")),
            {"type": "session.ready", "session_id": "s1", "sample_rate": 24000, "voices": ["alice", "bob"]},
        ),
        (p.AudioStarted("u1", 81.23456), {"type": "audio.started", "id": "u1", "ttfa_ms": 81.235}),
        (p.AudioDone("u1", 1500.0), {"type": "audio.done", "id": "u1", "audio_ms": 1500.0}),
        (
            p.Cancelled("u1", 420.0, "Hello"),
            {"type": "cancelled", "id": "u1", "played_ms": 420.0, "played_text": "Hello"},
        ),
        (p.Error(None, "bad_json", "x"), {"type": "error", "id": None, "code": "bad_json", "message": "x"}),
        (p.Pong(5), {"type": "pong", "t": 5}),
    ]
    for msg, wire in cases:
        text = p.dumps(msg)
        assert json.loads(text) == wire
        assert next(iter(json.loads(text))) == "type"
        assert p.parse_server(text) == (msg if not isinstance(msg, p.AudioStarted) else p.AudioStarted("u1", 81.235))


def test_parse_server_ignores_unknown_fields_and_rejects_junk() -> None:
    assert p.parse_server('{"type":"pong","t":1,"extra":2}') == p.Pong(1)
    with pytest.raises(ValueError):
        p.parse_server('{"type":"nope"}')


# -- session-level error codes (a Session on the fake engine; no WebRTC) -----------------------


class ListSink:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.closed = False

    def send(self, text: str) -> None:
        self.messages.append(json.loads(text))

    def close(self) -> None:
        self.closed = True

    def errors(self) -> list[tuple[str | None, str]]:
        return [(m["id"], m["code"]) for m in self.messages if m["type"] == "error"]


def _session(engine: FakeEngine, **kw: Any) -> tuple[Session, ListSink]:
    s = Session("s", engine, **kw)
    sink = ListSink()
    s.add_sink(sink)
    return s, sink


def _msg(**fields: Any) -> str:
    return json.dumps(fields)


@pytest.mark.asyncio
async def test_session_error_codes() -> None:
    engine = FakeEngine(capacity=3, script=FakeScript(first_chunk_delay_s=5.0))
    async with engine:
        s, sink = _session(engine, max_queued_utterances=2, max_text_chars=20)
        assert sink.messages[0]["type"] == "session.ready"
        s.receive(_msg(type="text.delta", id="a", delta="x" * 21))
        s.receive(_msg(type="text.delta", id="a", delta="hello", voice="nobody"))
        s.receive(_msg(type="text.delta", id="a", delta="hello"))
        s.receive(_msg(type="text.delta", id="a", delta=" there, how are you"))
        s.receive(_msg(type="text.delta", id="b", delta="hi"))
        s.receive(_msg(type="text.delta", id="c", delta="hi"))
        s.receive(_msg(type="text.done", id="zzz"))
        s.receive(_msg(type="cancel", id="zzz"))
        s.receive(_msg(type="text.done", id="b"))
        s.receive(_msg(type="text.delta", id="b", delta="more"))
        s.receive(_msg(type="cancel", id="b"))
        s.receive(_msg(type="text.delta", id="b", delta="again"))
        # Capacity: the engine has 3 slots; "a" holds one, so fill the others elsewhere.
        other = [engine.open_stream() for _ in range(2)]
        s.receive(_msg(type="text.delta", id="d", delta="hi"))
        for st in other:
            st.cancel()
        engine.default_voice = None
        s.receive(_msg(type="text.delta", id="e", delta="hi"))
        s.receive(_msg(type="text.delta", id="f", delta="hi", voice="../etc"))
        engine.voices.append("cracked")
        engine.broken_voices.add("cracked")
        s.receive(_msg(type="text.delta", id="g", delta="hi", voice="cracked"))
        assert sink.errors() == [
            ("a", "text_too_long"),
            ("a", "unknown_voice"),
            ("a", "text_too_long"),
            ("c", "too_many_utterances"),
            ("zzz", "unknown_id"),
            ("zzz", "unknown_id"),
            ("b", "utterance_closed"),
            ("b", "utterance_closed"),
            ("d", "overloaded"),
            ("e", "no_voice"),
            ("f", "unknown_voice"),
            ("g", "voice_unusable"),
        ]
        # The session went on: "a" still holds its accepted text and is live.
        assert list(s.live) == ["a"]
        assert engine.opened[0].text == "hello"
        await s.close()
    assert s.n_tasks == 0


@pytest.mark.asyncio
async def test_not_ready_and_internal_codes() -> None:
    engine = FakeEngine(script=FakeScript(first_chunk_delay_s=0.0, chunk_delay_s=0.0))
    s, sink = _session(engine)
    s.receive(_msg(type="text.delta", id="a", delta="hi"))  # engine not entered: not ready
    async with engine:
        s.receive(_msg(type="text.delta", id="b", delta="<CRASH> boom"))
        s.receive(_msg(type="text.done", id="b"))
        for _ in range(50):
            if len(sink.errors()) == 2:
                break
            await asyncio.sleep(0.01)
        s.receive(_msg(type="ping", t=1))
        await s.close()
    assert sink.errors() == [("a", "not_ready"), ("b", "internal")]
    assert sink.messages[-1] == {"type": "pong", "t": 1}
    assert sink.closed


@pytest.mark.asyncio
async def test_stream_failure_is_an_error_for_that_utterance_only() -> None:
    engine = FakeEngine(script=FakeScript(first_chunk_delay_s=0.0, chunk_delay_s=0.0))
    async with engine:
        s, sink = _session(engine)
        s.receive(_msg(type="text.delta", id="bad", delta="<FAIL> one two three four five"))
        s.receive(_msg(type="text.done", id="bad"))
        s.receive(_msg(type="text.delta", id="good", delta="fine"))
        for _ in range(100):
            if sink.errors():
                break
            await asyncio.sleep(0.01)
        assert sink.errors() == [("bad", "internal")]
        assert list(s.live) == ["good"]
        await s.close()
    assert not engine.active


# -- nothing a client sends escapes as anything but a ProtocolError -----------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
messages = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["text.delta", "text.done", "cancel", "ping", "other"]) | json_values,
        "id": st.text(max_size=5) | json_values,
        "delta": st.text(max_size=30) | json_values,
        "voice": st.sampled_from(["alice", "nobody", ""]) | json_values,
        "t": json_values,
    },
)


@given(st.one_of(messages.map(json.dumps), st.text(max_size=50), st.binary(max_size=20)))
@settings(max_examples=400, deadline=None)
def test_parse_returns_a_message_or_a_protocol_error(raw: str | bytes) -> None:
    try:
        msg = p.parse(raw)
    except p.ProtocolError as e:
        assert isinstance(e.code, p.ErrorCode) and e.message
    else:
        assert isinstance(msg, p.TextDelta | p.TextDone | p.Cancel | p.Ping)


@given(st.lists(messages.map(json.dumps), min_size=1, max_size=25))
@settings(max_examples=60, deadline=None)
def test_a_session_survives_any_message_sequence(batch: list[str]) -> None:
    async def run() -> None:
        engine = FakeEngine(capacity=4, script=FakeScript(first_chunk_delay_s=0.0, chunk_delay_s=0.0))
        async with engine:
            s, sink = _session(engine, max_queued_utterances=3, max_text_chars=50)
            for raw in batch:
                s.receive(raw)
                await asyncio.sleep(0)
            assert len(s.live) <= 3
            assert all(m["code"] != "internal" for m in sink.messages if m["type"] == "error")
            await s.close()
            assert s.n_tasks == 0 and not engine.active and not s.live

    asyncio.run(run())


def test_engine_errors_map_to_protocol_codes() -> None:
    from voice_out.engine.api import NoVoiceError, OverloadedError, StreamClosedError, StreamFailedError
    from voice_out.server.session import _error_code

    assert _error_code(StreamClosedError("ended")) is p.ErrorCode.UTTERANCE_CLOSED
    assert _error_code(NoVoiceError("none")) is p.ErrorCode.NO_VOICE
    assert _error_code(OverloadedError("full")) is p.ErrorCode.OVERLOADED
    assert _error_code(StreamFailedError("boom")) is p.ErrorCode.INTERNAL
