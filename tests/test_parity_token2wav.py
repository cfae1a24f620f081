"""Streaming token2wav: chunk schedule, vocoder caches and cross-fades (case f, f2).

The orchestration is tested on its own by replaying the flow mels that upstream computed for
these exact calls (case d records every flow call of case f's streaming run, case f the
non-streaming mel), so a flow error cannot hide or cause a token2wav error. Tests with the real
flow (end to end, streaming == single pass, later chunks on a flow state == re-run) run when
``voice_out.model.flow`` is present.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from tests.conftest import chunk_plans, load_case
from voice_out.engine.chunk_schedule import ChunkPlan, ChunkSchedule, HopPolicy, plan_all
from voice_out.fast.flow_step import FastToken2Wav
from voice_out.model.checkpoint import load_hift
from voice_out.model.token2wav import Token2Wav, hamming
from voice_out.model.vocoder import HiFT

WAVE_TOL = 2e-3
WAVE_MIN_SNR_DB = 60.0
SAMPLES_PER_TOKEN = 960  # fixed by the layout: 2 mel frames x 480 samples


def snr_db(ref: Tensor, x: Tensor) -> float:
    err = (ref.double() - x.double()).pow(2).sum().clamp_min(1e-300)
    return float(10.0 * torch.log10(ref.double().pow(2).sum() / err))


def assert_wave_close(name: str, ref: Tensor, x: Tensor) -> None:
    assert ref.shape == x.shape, f"{name}: {tuple(x.shape)} samples, reference {tuple(ref.shape)}"
    err, snr = float((ref - x).abs().max()), snr_db(ref, x)
    print(f"{name}: max abs {err:.3g}, SNR {snr:.1f} dB")
    assert err <= WAVE_TOL and snr >= WAVE_MIN_SNR_DB, name


@pytest.fixture(scope="module")
def hift(parity_dir: Path) -> HiFT:
    return load_hift(parity_dir)


@pytest.fixture(scope="module")
def case_f(cases_dir: Path) -> dict[str, Any]:
    return load_case(cases_dir, "f_e2e_token2wav")


class ReplayFlow:
    """Returns the mel upstream's flow returned for the same call; records the calls."""

    def __init__(self, calls: list[dict[str, Any]]) -> None:
        self.recorded = calls
        self.calls: list[tuple[int, bool, bool]] = []

    def inference(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool,
    ) -> Tensor:
        key = (int(token.shape[1]), streaming, finalize)
        self.calls.append(key)
        for c in self.recorded:
            if (c["token_len"], c["streaming"], c["finalize"]) == key:
                mel: Tensor = c["mel"]
                return mel.clone()
        raise AssertionError(f"flow called as (token_len, streaming, finalize) = {key}, which upstream never did")


@pytest.fixture()
def replay(cases_dir: Path, case_f: dict[str, Any]) -> ReplayFlow:
    d = load_case(cases_dir, "d_flow_streaming")
    calls = list(d["calls"])
    n = int(case_f["token"].shape[1])
    calls.append({"token_len": n, "streaming": False, "finalize": True, "mel": case_f["nonstream_mel"]})
    return ReplayFlow(calls)


class FakeFlow:
    """A deterministic stand-in with the real output contract: frame pair i comes from token i
    (and the speaker); a final (full-attention) call also depends on the whole sequence."""

    def __init__(self, mel_channels: int, lookahead: int = 3) -> None:
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(6561, mel_channels, 2, generator=g) - 5.0
        self.lookahead = lookahead

    def inference(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool,
    ) -> Tensor:
        n = token.shape[1] if finalize else token.shape[1] - self.lookahead
        frames = self.table[token[0, :n].long()]  # [n, C, 2]
        mel = frames.permute(1, 0, 2).reshape(1, frames.shape[1], 2 * n) + 0.1 * embedding.mean()
        if not streaming:
            mel = mel + 0.05 * torch.tanh(token.float().mean() / 1000.0)
        return mel


class SpyHiFT(torch.nn.Module):
    """Wraps the vocoder and records what token2wav feeds it: (mel, cached source length)."""

    def __init__(self, hift: HiFT) -> None:
        super().__init__()
        self.inner = hift
        self.dims = hift.dims
        self.stft_window = hift.stft_window
        self.calls: list[tuple[Tensor, int]] = []

    def forward(self, mel: Tensor, cache_source: Tensor | None, noise: Any) -> tuple[Tensor, Tensor]:
        self.calls.append((mel.clone(), 0 if cache_source is None else cache_source.shape[2]))
        out: tuple[Tensor, Tensor] = self.inner(mel, cache_source, noise)
        return out


def run_stream(t2w: Token2Wav, case: dict[str, Any], hops: HopPolicy | None = None, **kw: Any) -> list[Tensor]:
    stream = t2w.open_stream(case["prompt_token"], case["prompt_feat"], case["embedding"], **kw)
    return list(t2w.stream_all(stream, case["token"], chunk_plans(stream, case["token"], hops)))


# -- the schedule (pure python) -----------------------------------------------------------------


def test_schedule_of_case_f(case_f: dict[str, Any]) -> None:
    plans = plan_all(int(case_f["token"].shape[1]), int(case_f["prompt_token"].shape[1]))
    assert [p.token_len for p in plans] == case_f["chunk_token_len"].tolist()
    assert [p.token_offset for p in plans] == case_f["chunk_token_offset"].tolist()
    assert [p.finalize for p in plans] == case_f["chunk_finalize"].tolist()
    assert [p.n_samples() for p in plans] == case_f["chunk_samples"].tolist()


def test_schedule_with_first_hop_100_is_upstreams_second_request(cases_dir: Path) -> None:
    """Case f2: upstream's leaked hop (100) as an explicit per-request first hop."""
    f2 = load_case(cases_dir, "f2_quirk_second_stream_call")
    plans = plan_all(int(f2["token"].shape[1]), int(f2["prompt_token"].shape[1]), HopPolicy(first_hop=100))
    assert [p.token_len for p in plans] == f2["second_call_chunk_token_len"].tolist()
    assert [p.n_samples() for p in plans] == f2["second_call_chunk_samples"].tolist()
    default = plan_all(int(f2["token"].shape[1]), int(f2["prompt_token"].shape[1]))
    assert [p.n_samples() for p in default] == f2["first_call_chunk_samples"].tolist()


@pytest.mark.parametrize("prompt_tokens", [0, 1, 24, 25, 37, 87, 250])
@pytest.mark.parametrize("first_hop", [25, 50, 100])
def test_schedule_properties(prompt_tokens: int, first_hop: int) -> None:
    for n_tokens in [0, 1, 27, 28 + 25, 140, 333, 1000]:
        plans = plan_all(n_tokens, prompt_tokens, HopPolicy(first_hop=first_hop))
        assert plans[-1].finalize and not any(p.finalize for p in plans[:-1])
        assert sum(p.n_samples() for p in plans) == SAMPLES_PER_TOKEN * n_tokens
        hops = [p.hop_tokens for p in plans[:-1]]
        if hops:
            assert hops[0] == first_hop + (-prompt_tokens) % first_hop
            assert all(h == min(100, first_hop * 2**i) for i, h in enumerate(hops[1:], start=1))
        for p in plans[:-1]:
            assert (prompt_tokens + p.token_offset + p.hop_tokens) % 25 == 0  # chunk-aligned boundaries
            assert p.token_len == p.token_offset + p.hop_tokens + 3
        # tokens arriving one at a time (a chunk is made as soon as it is ready) give the same plans
        sched = ChunkSchedule(prompt_tokens=prompt_tokens, first_hop=first_hop)
        online: list[ChunkPlan] = []
        for n in range(n_tokens + 1):
            while (plan := sched.ready(n, llm_finished=n == n_tokens)) is not None:
                assert plan.token_len <= n
                online.append(plan)
                sched.commit(plan)
        assert online == plans
        assert sched.finished and sched.ready(n_tokens, True) is None


def test_schedule_tokens_needed_and_errors() -> None:
    sched = ChunkSchedule(prompt_tokens=87)
    assert sched.tokens_for_next_chunk == 41
    assert sched.ready(40, llm_finished=False) is None
    plan = sched.ready(41, llm_finished=False)
    assert plan == ChunkPlan(index=0, token_offset=0, token_len=41, hop_tokens=38, finalize=False)
    sched.commit(plan)
    assert sched.tokens_for_next_chunk == 38 + 50 + 3
    with pytest.raises(ValueError, match="not the next chunk"):
        sched.commit(plan)
    with pytest.raises(ValueError, match="multiple of the flow chunk"):
        ChunkSchedule(prompt_tokens=10, first_hop=10)


def test_schedule_module_needs_no_torch() -> None:
    code = "import sys, voice_out.engine.chunk_schedule; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_hamming_is_numpys() -> None:
    for n in (1, 2, 7, 7680):
        assert np.allclose(hamming(n).numpy(), np.hamming(n), rtol=0, atol=1e-15)
    assert hamming(7680).dtype == torch.float64


# -- token2wav against upstream, flow replayed --------------------------------------------------


def test_case_f_streaming(hift: HiFT, replay: ReplayFlow, case_f: dict[str, Any]) -> None:
    spy = SpyHiFT(hift)
    t2w = Token2Wav(replay, spy)  # type: ignore[arg-type]
    stream = t2w.open_stream(case_f["prompt_token"], case_f["prompt_feat"], case_f["embedding"])
    chunks = list(t2w.stream_all(stream, case_f["token"], chunk_plans(stream, case_f["token"])))
    # the flow calls are upstream's: (tokens given, chunk-causal, finalize)
    assert replay.calls == [
        (int(n), not fin, bool(fin))
        for n, fin in zip(case_f["chunk_token_len"].tolist(), case_f["chunk_finalize"].tolist(), strict=True)
    ]
    # the vocoder sees [8 cached frames | new frames] and a 3840-sample cached source
    seen = [(mel.shape[2], n) for mel, n in spy.calls]
    assert seen == [(c["speech_feat"].shape[2], c["cache_source_len"]) for c in case_f["hift_calls"]]
    assert [c.shape[0] for c in chunks] == case_f["chunk_samples"].tolist()
    assert all(c.dtype == torch.float32 and c.dim() == 1 for c in chunks)
    out = torch.cat(chunks)
    assert out.shape[0] == SAMPLES_PER_TOKEN * case_f["token"].shape[1]
    assert_wave_close("f stream_concat", case_f["stream_concat"][0], out)

    # A second request on the same objects. Upstream's second streaming request starts with hop
    # 100 (case f2): we deliberately do NOT copy that leak, the hop is per request. The state
    # object is reset in place (its cache tensors are kept) and gives the same audio again.
    ptr = stream.hift_cache.source.data_ptr()
    stream.reset(case_f["prompt_token"], case_f["prompt_feat"], case_f["embedding"])
    assert stream.chunks_done == 0 and not stream.hift_cache.valid and stream.samples_emitted == 0
    again = list(t2w.stream_all(stream, case_f["token"], chunk_plans(stream, case_f["token"])))
    assert stream.hift_cache.source.data_ptr() == ptr
    assert [c.shape for c in again] == [c.shape for c in chunks]
    assert all(torch.equal(a, b) for a, b in zip(chunks, again, strict=True))


def test_case_f_nonstreaming_and_speed(hift: HiFT, replay: ReplayFlow, case_f: dict[str, Any]) -> None:
    t2w = Token2Wav(replay, hift)
    args = (case_f["token"], case_f["prompt_token"], case_f["prompt_feat"], case_f["embedding"])
    assert_wave_close("f nonstream_speech", case_f["nonstream_speech"][0], t2w.synthesize(*args))
    fast = t2w.synthesize(*args, speed=float(case_f["speed"]))
    assert_wave_close("f nonstream_speech_speed", case_f["nonstream_speech_speed"][0], fast)


# -- orchestration invariants with a fake flow --------------------------------------------------


@pytest.fixture()
def fake_t2w(hift: HiFT) -> Token2Wav:
    return Token2Wav(FakeFlow(hift.dims.in_channels), hift)


def _voice(hift: HiFT, prompt_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    prompt_token = torch.randint(0, 6561, (1, prompt_tokens), generator=g, dtype=torch.int32)
    prompt_feat = torch.randn(1, 2 * prompt_tokens, hift.dims.in_channels, generator=g) - 5.0
    return prompt_token, prompt_feat, torch.randn(1, 192, generator=g)


@pytest.mark.parametrize("n_tokens", [0, 5, 41, 120])
def test_total_samples(fake_t2w: Token2Wav, hift: HiFT, n_tokens: int) -> None:
    voice = _voice(hift, 12)
    tokens = torch.randint(0, 6561, (n_tokens,), generator=torch.Generator().manual_seed(2)).tolist()
    stream = fake_t2w.open_stream(*voice)
    schedule = HopPolicy().schedule(stream.prompt_tokens)
    plans = []
    while (plan := schedule.ready(n_tokens, True)) is not None:
        plans.append(plan)
        schedule.commit(plan)
    chunks = list(fake_t2w.stream_all(stream, tokens, plans))
    assert stream.chunk_log == plans
    assert [c.shape[0] for c in chunks] == [p.n_samples() for p in plans]
    assert sum(c.shape[0] for c in chunks) == SAMPLES_PER_TOKEN * n_tokens == stream.samples_emitted
    assert stream.finished and schedule.ready(n_tokens, True) is None


def test_emitted_audio_does_not_depend_on_later_tokens(fake_t2w: Token2Wav, hift: HiFT) -> None:
    """A non-final chunk reads tokens[:token_len] only; later tokens change nothing already emitted."""
    voice = _voice(hift, 20)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 6561, (1, 90), generator=g, dtype=torch.int32)
    a_stream, b_stream = fake_t2w.open_stream(*voice), fake_t2w.open_stream(*voice)
    a_sched, b_sched = HopPolicy().schedule(20), HopPolicy().schedule(20)
    for n in range(0, 90):
        plan_a = a_sched.ready(n, llm_finished=False)
        plan_b = b_sched.ready(n, llm_finished=False)
        assert plan_a == plan_b
        if plan_a is not None and plan_b is not None:
            other = tokens[:, :n].clone()
            other[0, plan_b.token_len :] = torch.randint(0, 6561, (n - plan_b.token_len,), generator=g)
            assert torch.equal(a_stream.run_chunk(plan_a, tokens[:, :n]), b_stream.run_chunk(plan_b, other))
            a_sched.commit(plan_a)
            b_sched.commit(plan_b)
    assert a_stream.chunks_done == 2


def test_run_chunk_checks_its_input(fake_t2w: Token2Wav, hift: HiFT) -> None:
    stream = fake_t2w.open_stream(*_voice(hift, 25))
    plan = HopPolicy().schedule(25).ready(40, llm_finished=False)
    assert plan is not None and plan.token_len == 28
    with pytest.raises(ValueError, match="needs 28 tokens"):
        stream.run_chunk(plan, list(range(20)))
    stream.run_chunk(plan, list(range(40)))
    with pytest.raises(ValueError, match="not the next chunk"):
        stream.run_chunk(plan, list(range(40)))


# -- end to end with our flow -------------------------------------------------------------------


@pytest.fixture(scope="module")
def flow(parity_dir: Path) -> Any:
    checkpoint = pytest.importorskip("voice_out.model.checkpoint")
    if not hasattr(checkpoint, "load_flow"):
        pytest.skip("the flow is not available yet")
    return checkpoint.load_flow(parity_dir)


def run_on_state(flow: Any, hift: Any, case: dict[str, Any], hops: HopPolicy | None = None) -> list[Tensor]:
    """``case`` streamed as the engine streams a voice with a prompt prefix and a flow state:
    its first chunk from the prefix, its later chunks extending a state slot of its own
    (``FastToken2Wav``; eager here)."""
    t2w = FastToken2Wav(flow, hift)
    voice = (case["prompt_token"], case["prompt_feat"], case["embedding"])
    prefix = t2w.prepare_prefix(*voice)
    assert prefix is not None  # the case's prompt has a whole flow chunk before its last 3 tokens
    t2w.use_state_slots(1, prefix.n_prompt + int(case["token"].shape[1]))
    stream = t2w.open_stream(*voice, first_prefix=prefix)
    assert stream.state_slot is not None
    return list(t2w.stream_all(stream, case["token"], chunk_plans(stream, case["token"], hops)))


@pytest.fixture(scope="module")
def real_runs(flow: Any, hift: HiFT, case_f: dict[str, Any]) -> dict[str, tuple[list[Tensor], SpyHiFT]]:
    """Case f streamed through our flow, by re-run and on a flow state."""
    spy = SpyHiFT(hift)
    runs = {"rerun": (run_stream(Token2Wav(flow, spy), case_f), spy)}  # type: ignore[arg-type]
    spy = SpyHiFT(hift)
    runs["state"] = (run_on_state(flow, spy, case_f), spy)
    return runs


@pytest.mark.parametrize("path", ["rerun", "state"])
def test_case_f_end_to_end(
    real_runs: dict[str, tuple[list[Tensor], SpyHiFT]], case_f: dict[str, Any], path: str
) -> None:
    chunks, _ = real_runs[path]
    assert [c.shape[0] for c in chunks] == case_f["chunk_samples"].tolist()
    assert_wave_close(f"f stream_concat, our flow ({path})", case_f["stream_concat"][0], torch.cat(chunks))


def test_state_path_equals_rerun(real_runs: dict[str, tuple[list[Tensor], SpyHiFT]]) -> None:
    (rerun, rerun_spy), (cached, cached_spy) = real_runs["rerun"], real_runs["state"]
    for (m_a, n_a), (m_b, n_b) in zip(rerun_spy.calls, cached_spy.calls, strict=True):
        assert m_a.shape == m_b.shape and n_a == n_b
        assert float((m_a - m_b).abs().max()) <= 1e-4  # mel tolerance of the flow parity cases
    for a, b in zip(rerun, cached, strict=True):
        assert a.shape == b.shape
        err = float((a - b).abs().max())
        print(f"state vs rerun chunk: max abs {err:.3g}, SNR {snr_db(a, b):.1f} dB")
        assert err <= 5e-4


def test_streaming_equals_single_pass_for_non_final_chunks(
    flow: Any, real_runs: dict[str, tuple[list[Tensor], SpyHiFT]], case_f: dict[str, Any]
) -> None:
    """Every non-final chunk's new mel is the matching slice of ONE chunk-causal pass."""
    with torch.no_grad():
        single = flow.inference(
            case_f["token"], case_f["prompt_token"], case_f["prompt_feat"], case_f["embedding"], True, True
        )
    _, spy = real_runs["rerun"]
    plans = plan_all(int(case_f["token"].shape[1]), int(case_f["prompt_token"].shape[1]))
    for k, (plan, (mel, _)) in enumerate(zip(plans, spy.calls, strict=True)):
        if plan.finalize:
            continue
        new = mel[:, :, 8:] if k > 0 else mel  # drop the 8 cached frames
        ref = single[:, :, 2 * plan.token_offset : 2 * (plan.token_offset + plan.hop_tokens)]
        assert new.shape == ref.shape
        assert float((new - ref).abs().max()) <= 1e-4, f"chunk {k}"


def test_case_f_nonstreaming_end_to_end(flow: Any, hift: HiFT, case_f: dict[str, Any]) -> None:
    t2w = Token2Wav(flow, hift)
    with torch.no_grad():
        mel = flow.inference(
            case_f["token"], case_f["prompt_token"], case_f["prompt_feat"], case_f["embedding"], False, True
        )
    assert_wave_close("f nonstream_speech, our flow", case_f["nonstream_speech"][0], t2w.vocode(mel))
    fast = t2w.vocode(mel, speed=float(case_f["speed"]))
    assert_wave_close("f nonstream_speech_speed, our flow", case_f["nonstream_speech_speed"][0], fast)


@pytest.mark.slow
def test_case_f2_first_hop_100_reproduces_upstreams_second_request(flow: Any, hift: HiFT, cases_dir: Path) -> None:
    """Optional case f2: upstream's leaked hop, reproduced on purpose through ``first_hop=100``."""
    f2 = load_case(cases_dir, "f2_quirk_second_stream_call")
    chunks = run_on_state(flow, hift, f2, HopPolicy(first_hop=int(f2["hop_len_after_first_call"])))
    assert [c.shape[0] for c in chunks] == f2["second_call_chunk_samples"].tolist()
    assert_wave_close("f2 second_call_stream_concat", f2["second_call_stream_concat"][0], torch.cat(chunks))


def test_state_stream_reset_after_cancel(flow: Any, hift: HiFT, case_f: dict[str, Any]) -> None:
    """Barge-in: a request cut after its first chunk on its flow state, then the stream reset in
    place for the next request (its state slot given back and taken again), gives exactly what
    a fresh stream gives."""
    t2w = FastToken2Wav(flow, hift)
    voice = (case_f["prompt_token"], case_f["prompt_feat"], case_f["embedding"])
    prefix = t2w.prepare_prefix(*voice)
    assert prefix is not None
    tokens = case_f["token"][:, :120]
    t2w.use_state_slots(1, prefix.n_prompt + 120)
    first = t2w.open_stream(*voice, first_prefix=prefix)
    fresh = list(t2w.stream_all(first, tokens, chunk_plans(first, tokens)))
    stream = t2w.open_stream(*voice, first_prefix=prefix)  # the slot, given back by the first
    slot = stream.state_slot
    assert slot is not None
    schedule = HopPolicy().schedule(stream.prompt_tokens)
    for _ in range(2):  # the first chunk, then one on the state ... and the request is cancelled here
        plan = schedule.ready(120, llm_finished=False)
        assert plan is not None and not plan.finalize
        stream.run_chunk(plan, tokens)
        schedule.commit(plan)
    assert slot.started and slot.cache.n_done > prefix.n_prompt
    stream.reset(*voice, first_prefix=prefix)
    assert stream.state_slot is slot  # reused in place
    again = list(t2w.stream_all(stream, tokens, chunk_plans(stream, tokens)))
    assert [c.shape for c in again] == [c.shape for c in fresh]
    assert all(torch.equal(a, b) for a, b in zip(fresh, again, strict=True))


def test_streams_made_in_inference_mode_run_outside_it(fake_t2w: Token2Wav, hift: HiFT) -> None:
    """An engine may open (or warm up) streams under torch.inference_mode and run them later
    without it, or the reverse: the in-place cache updates must work either way."""
    voice = _voice(hift, 10)
    with torch.inference_mode():
        inside = fake_t2w.open_stream(*voice)
    outside = fake_t2w.open_stream(*voice)
    tokens = list(range(100, 160))
    a = list(fake_t2w.stream_all(inside, tokens, chunk_plans(inside, tokens)))
    with torch.inference_mode():
        b = list(fake_t2w.stream_all(outside, tokens, chunk_plans(outside, tokens)))
    assert len(a) == 2 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
