"""Per-utterance ``speed`` and ``instructions`` (``engine.open_stream``; spec 5.6, 2.4, 6.8).

speed: a stream with speed != 1 makes its audio as ONE final chunk over every token (the
``whole`` schedule), its mel resampled in time before the vocoder. Proven against upstream's
outputs of parity case f (``nonstream_speech``, ``nonstream_speech_speed``) through the same
``Token2WavStream`` path the engine runs, with upstream's flow mels replayed and with our flow;
then through the engine (one chunk, the length the interpolation gives).

instructions: CosyVoice2's instruct2 mode: the instruction + ``<|endofprompt|>`` takes the place
of the prompt transcript and the LLM gets no prompt speech. The rows are checked against the
spec's layouts (whole text, 2.4/6.8, on the parity case g4 inputs; bistream 5 : 15, 2.7) and the
engine is shown to feed them (the sampled speech changes with the instruction).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import chunk_plans, load_case
from tests.test_parity_token2wav import ReplayFlow, assert_wave_close
from voice_out.config import Config, EngineConfig, ServerConfig
from voice_out.engine.api import BadOptionError, PcmChunk
from voice_out.engine.build import BuildOptions
from voice_out.engine.chunk_schedule import HopPolicy
from voice_out.engine.engine import Engine
from voice_out.engine.request import FILL_TOKEN, FlowVoice, VoicePrompt
from voice_out.engine.scheduler import ForcedTokens
from voice_out.engine.textfeed import BistreamFeed
from voice_out.engine.voicebook import END_OF_PROMPT, MAX_INSTRUCTION_CHARS, instruct_prompt
from voice_out.model.checkpoint import load_hift
from voice_out.model.token2wav import Token2Wav
from voice_out.model.vocoder import HiFT
from voice_out.text.rows import SOS, TASK_ID, Row, RowKind, instruct_rows, zero_shot_rows
from voice_out.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEED = 1.25  # case f's


@pytest.fixture(scope="module")
def hift(parity_dir: Path) -> HiFT:
    return load_hift(parity_dir)


@pytest.fixture(scope="module")
def case_f(cases_dir: Path) -> dict[str, Any]:
    return load_case(cases_dir, "f_e2e_token2wav")


def whole_stream(t2w: Token2Wav, case_f: dict[str, Any], speed: float) -> list[torch.Tensor]:
    """Case f's tokens through a whole-schedule stream (what the engine runs for ``speed``)."""
    stream = t2w.open_stream(
        case_f["prompt_token"], case_f["prompt_feat"], case_f["embedding"], speed=speed, whole=True
    )
    return list(t2w.stream_all(stream, case_f["token"], chunk_plans(stream, case_f["token"])))


# -- speed ---------------------------------------------------------------------------------------


def test_speed_through_a_stream_is_upstreams_nonstreaming_path(hift: HiFT, case_f: dict[str, Any]) -> None:
    flow = ReplayFlow([])
    n = int(case_f["token"].shape[1])
    flow.recorded.append({"token_len": n, "streaming": False, "finalize": True, "mel": case_f["nonstream_mel"]})
    t2w = Token2Wav(flow, hift)
    (same,) = whole_stream(t2w, case_f, 1.0)  # one chunk: a full-attention pass over every token
    assert_wave_close("whole stream, speed 1 vs nonstream_speech", case_f["nonstream_speech"][0], same)
    (fast,) = whole_stream(t2w, case_f, SPEED)
    assert_wave_close("whole stream, speed 1.25 vs nonstream_speech_speed", case_f["nonstream_speech_speed"][0], fast)
    assert flow.calls == [(n, False, True)] * 2  # upstream's one non-streaming flow call, each time
    # and it is the spec's interpolation of the speed-1 mel (5.6): linear, align_corners=False
    mel = case_f["nonstream_mel"].float()
    resized = F.interpolate(mel, size=int(mel.shape[2] / SPEED), mode="linear", align_corners=False)
    with torch.inference_mode():
        ref, _ = hift(resized, None, None)
    assert torch.equal(ref[0], fast)
    assert fast.shape[0] == int(2 * n / SPEED) * 480


def test_speed_with_our_flow_matches_upstream(parity_dir: Path, hift: HiFT, case_f: dict[str, Any]) -> None:
    from voice_out.model.checkpoint import load_flow

    t2w = Token2Wav(load_flow(parity_dir), hift)
    (same,) = whole_stream(t2w, case_f, 1.0)
    assert_wave_close("our flow, speed 1", case_f["nonstream_speech"][0], same)
    (fast,) = whole_stream(t2w, case_f, SPEED)
    assert_wave_close("our flow, speed 1.25", case_f["nonstream_speech_speed"][0], fast)


def test_speed_needs_the_whole_schedule(hift: HiFT, case_f: dict[str, Any]) -> None:
    t2w = Token2Wav(ReplayFlow([]), hift)
    args = (case_f["prompt_token"], case_f["prompt_feat"], case_f["embedding"])
    with pytest.raises(ValueError, match="whole utterance"):
        t2w.open_stream(*args, speed=SPEED, whole=False)
    with pytest.raises(ValueError, match="> 0"):
        t2w.open_stream(*args, speed=0.0)
    stream = t2w.open_stream(*args, speed=SPEED)  # whole by default when speed != 1
    schedule = HopPolicy().schedule(stream.prompt_tokens, whole=stream.whole)  # the engine's, as it makes it
    assert stream.whole and schedule.ready(500, llm_finished=False) is None
    plan = schedule.ready(500, llm_finished=True)
    assert plan is not None and (plan.index, plan.token_offset, plan.token_len, plan.finalize) == (0, 0, 500, True)


FORCED_3 = ForcedTokens(3)


def tiny_engine(tmp: Path, forced: ForcedTokens | None = FORCED_3) -> Engine:
    cfg = Config(server=ServerConfig(voices_dir=str(tmp / "no-voices")), engine=EngineConfig(max_streams=2))
    return Engine.load(
        cfg,
        model="random:tiny",
        device="cpu",
        options=BuildOptions(forced=forced, warmup=False, text_normalizer="none", noise_prompt_tokens=0, kv_len=512),
    )


def speak(engine: Engine, text: str, **kw: Any) -> list[PcmChunk]:
    stream = engine.open_stream("noise", seed=5, **kw)
    stream.push_text(text)
    stream.end_text()
    return list(stream)


def test_the_engine_speaks_a_speed_as_one_chunk(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path)
    engine.start(timeout=120)
    try:
        text = "some words here"  # 15 ids -> 45 forced tokens: 2 chunks at speed 1
        normal = speak(engine, text)
        fast = speak(engine, text, speed=SPEED)
        slow = speak(engine, text, speed=0.5)
        with pytest.raises(BadOptionError, match="speed"):
            engine.open_stream("noise", speed=5.0)
        with pytest.raises(BadOptionError, match="speed"):
            engine.open_stream("noise", speed=float("nan"))
    finally:
        engine.close()
    assert len(normal) >= 2
    n_tokens = sum(len(c.pcm) for c in normal) // 960
    for chunks, speed in ((fast, SPEED), (slow, 0.5)):
        (chunk,) = chunks  # the whole utterance at once, after the LLM has finished
        assert chunk.final and chunk.start_sample == 0 and chunk.text_end == len(text)
        assert len(chunk.pcm) == int(2 * n_tokens / speed) * 480 and np.isfinite(chunk.pcm).all()


# -- instructions --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(parity_dir: Path) -> Any:
    return load_tokenizer(parity_dir / "CosyVoice-BlankEN")


@pytest.fixture(scope="module")
def g4(cases_dir: Path) -> dict[str, Any]:
    return load_case(cases_dir, "g4_zero_shot_model_input")


def g4_voice(g4: dict[str, Any]) -> VoicePrompt:
    """The zero-shot voice of case g4: its prompt transcript and LLM prompt speech."""
    return VoicePrompt(
        "g4",
        prompt_text_ids=tuple(int(i) for i in g4["prompt_text"][0]),
        prompt_speech_ids=tuple(int(i) for i in g4["llm_prompt_speech_token"][0]),
        flow_prompt_tokens=int(g4["flow_prompt_speech_token"].shape[1]),
        flow=FlowVoice(torch.zeros(0, dtype=torch.int32), torch.zeros(0, 80), torch.zeros(192)),  # untouched
    )


INSTRUCTION = "用四川话说这句话"  # upstream's instruct2 example


def test_instruct_prompt_is_the_instruction_and_endofprompt(tokenizer: Any, g4: dict[str, Any]) -> None:
    voice = g4_voice(g4)
    prompt = instruct_prompt(voice, INSTRUCTION, tokenizer.encode)
    eop = tokenizer.special_token_ids[END_OF_PROMPT]
    assert prompt.prompt_text_ids == tuple(tokenizer.encode(INSTRUCTION)) + (eop,)
    assert prompt.prompt_text_ids[-1] == eop and prompt.prompt_text_ids.count(eop) == 1
    assert prompt.prompt_speech_ids == ()  # instruct2 deletes llm_prompt_speech_token (spec 6.8)
    # the flow keeps the voice's prompt: only the LLM side changes
    assert (prompt.name, prompt.flow_prompt_tokens, prompt.flow) == (voice.name, voice.flow_prompt_tokens, voice.flow)
    # not normalised (spec 6.1) and not doubled when the caller already ends it
    assert instruct_prompt(voice, INSTRUCTION + END_OF_PROMPT, tokenizer.encode) == prompt
    assert instruct_prompt(voice, "Speak 2 times faster.", tokenizer.encode).prompt_text_ids[:-1] == tuple(
        tokenizer.encode("Speak 2 times faster.")
    )
    for bad in ("", "   ", END_OF_PROMPT, "x" * (MAX_INSTRUCTION_CHARS + 1)):
        with pytest.raises(BadOptionError, match="instructions"):
            instruct_prompt(voice, bad, tokenizer.encode)


def test_whole_text_rows_are_g4s_with_the_instruction_in_place_of_the_prompt(
    tokenizer: Any, g4: dict[str, Any]
) -> None:
    voice = g4_voice(g4)
    text = [int(i) for i in g4["text"][0]]
    zero_shot = zero_shot_rows(voice.prompt_text_ids, text, voice.prompt_speech_ids)
    assert len(zero_shot) == 1 + int(g4["prompt_text_len"][0]) + int(g4["text_len"][0]) + 1 + 87  # g4's L0
    prompt = instruct_prompt(voice, INSTRUCTION, tokenizer.encode)
    rows = instruct_rows(prompt.prompt_text_ids, text)
    k = len(voice.prompt_text_ids)
    n_speech = len(voice.prompt_speech_ids)
    # spec 2.4 / 6.8: g4's [SOS, prompt_text ++ text, TASK_ID, prompt_speech] with the prompt
    # transcript replaced by the instruction and the prompt speech gone
    assert rows == [SOS, *[(1, i) for i in prompt.prompt_text_ids], *zero_shot[1 + k : -n_speech]]
    assert rows[-1] == TASK_ID and rows[-1 - len(text) :] == zero_shot[1 + k : -n_speech][-1 - len(text) :]
    assert zero_shot_rows(prompt.prompt_text_ids, text, prompt.prompt_speech_ids) == rows


def run_feed(prompt: VoicePrompt, text: list[int]) -> list[list[Row]]:
    """Every LLM step's input rows of a bistream feed given ``text`` at once (the engine's path),
    answering each step with speech token 7 (a forced FILL as forced), EOS after 40 tokens."""
    feed = BistreamFeed(prompt.prompt_text_ids, prompt.prompt_speech_ids)
    feed.add_text(text)
    feed.end_text()
    steps: list[list[Row]] = []
    while (step := feed.next_step()) is not None:
        steps.append(list(step.inputs))
        token = step.force if step.force is not None else (6561 if step.allow_eos and len(steps) > 40 else 7)
        feed.on_token(token)
        assert len(steps) < 1000
    assert feed.done
    return steps


def test_bistream_rows_of_an_instructed_stream(tokenizer: Any, g4: dict[str, Any]) -> None:
    voice = g4_voice(g4)
    text = [int(i) for i in g4["text"][0]]
    prompt = instruct_prompt(voice, INSTRUCTION, tokenizer.encode)
    steps = run_feed(prompt, text)
    instr = list(prompt.prompt_text_ids)
    # spec 2.7 with no prompt speech (P = 0): the first step is SOS and the first 5 text ids,
    # which are the instruction's; the model then speaks (15 speech tokens per 5 text)
    assert steps[0] == [SOS] + [(RowKind.TEXT, i) for i in instr[:5]]
    fed = [row for step in steps for row in step]
    text_rows = [i for kind, i in fed if kind is RowKind.TEXT]
    assert text_rows == instr + text  # the instruction, then the request's text, each once
    tasks = [j for j, row in enumerate(fed) if row == TASK_ID]
    last_text = max(j for j, (kind, _) in enumerate(fed) if kind is RowKind.TEXT)
    assert len(tasks) == 1 and tasks[0] == last_text + 1
    # every speech row fed is one the model made (token 7): none comes from the voice's prompt
    assert {i for kind, i in fed if kind is RowKind.SPEECH} == {7}
    assert FILL_TOKEN not in {i for _, i in fed}
    # the zero-shot stream of the same voice interleaves 15 prompt speech ids per 5 text ids
    zero_shot = run_feed(voice, text)
    assert zero_shot[0][:6] == [SOS] + [(RowKind.TEXT, i) for i in voice.prompt_text_ids[:5]]
    assert zero_shot[0][6:21] == [(RowKind.SPEECH, i) for i in voice.prompt_speech_ids[:15]]


def test_the_engine_feeds_the_instruction_to_the_llm(tmp_path: Path) -> None:
    """Sampled speech (no forced tokens): the same seed and text give other tokens with an
    instruction, and the same ones again without it."""
    engine = tiny_engine(tmp_path, forced=None)
    engine.start(timeout=120)
    try:
        text = "hi there."
        plain = speak(engine, text)
        again = speak(engine, text)
        instructed = speak(engine, text, instructions="Speak slowly and softly.")
        with pytest.raises(BadOptionError, match="instructions"):
            engine.open_stream("noise", instructions=" ")
    finally:
        engine.close()

    def pcm(chunks: list[PcmChunk]) -> np.ndarray:
        return np.concatenate([c.pcm for c in chunks])

    np.testing.assert_array_equal(pcm(plain), pcm(again))
    assert len(pcm(plain)) != len(pcm(instructed)) or not np.array_equal(pcm(plain), pcm(instructed))


def test_instruct_prompt_keeps_other_fields() -> None:
    voice = VoicePrompt("v", prompt_text_ids=(1, 2, 3), prompt_speech_ids=(4, 5), flow_prompt_tokens=25)
    prompt = instruct_prompt(voice, "x", lambda s: [ord(c) for c in s])
    assert dataclasses.replace(prompt, prompt_text_ids=(), prompt_speech_ids=()) == dataclasses.replace(
        voice, prompt_text_ids=(), prompt_speech_ids=()
    )
    assert prompt.prompt_text_ids == tuple(ord(c) for c in "x" + END_OF_PROMPT)
