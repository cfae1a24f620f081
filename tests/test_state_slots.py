"""Later chunks on a stream's own flow state (``FastToken2Wav.use_state_slots``, ``Flow.state_core``).

On the CPU the plain estimator extends the state (the start read on the host) and the slot's
GraphedFn runs eagerly, so the slot logic (who holds which state, the catch-up chunk from the
voice's prompt prefix, leaving a slot that is too small, giving it back) is checked there
against the re-run path (within 5e-5 of the audio, tiny random models). The ``requires_cuda`` tests check
the fused kernels that extend a state (the attention storing keys and values at a device
start, the copies of the conv contexts) and the replayed graphs against the plain path.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import REPO_ROOT, chunk_plans, random_voice
from tests.test_flow_streaming import state_chunk
from voice_out.engine.chunk_schedule import ChunkPlan, HopPolicy, plan_all
from voice_out.engine.runner import stream_shapes
from voice_out.fast import fused_flow
from voice_out.fast.flow_step import FastToken2Wav
from voice_out.fast.kernels import flow as flow_kernels
from voice_out.model.checkpoint import random_flow, random_hift
from voice_out.model.flow import Flow
from voice_out.model.flow_dims import FlowPrompt
from voice_out.model.flow_estimator import attention_bias, chunk_mask
from voice_out.model.token2wav import Token2WavStream

TINY = REPO_ROOT / "configs" / "models" / "tiny"
FULL = REPO_ROOT / "configs" / "models" / "cosyvoice2-0.5b"


def _speech(n: int, seed: int = 9) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(
    t2w: FastToken2Wav,
    n_prompt: int,
    n_tokens: int,
    *,
    prefix: bool = True,
    seed: int = 3,
    device: str = "cpu",
    hops: HopPolicy | None = None,
) -> tuple[list[torch.Tensor], Token2WavStream]:
    token, feat, emb = random_voice(n_prompt, device, seed)
    first_prefix = t2w.prepare_prefix(token, feat, emb) if prefix else None
    stream = t2w.open_stream(token, feat, emb, first_prefix=first_prefix)
    speech = _speech(n_tokens)
    return [c.clone() for c in t2w.stream_all(stream, speech, chunk_plans(stream, speech, hops))], stream


def _state_keys(prompt: FlowPrompt, n_tokens: int, hops: HopPolicy | None = None) -> set[int]:
    """The chunk lengths (mel frames) a stream of ``prompt``'s voice runs on a state slot in its
    first ``n_tokens`` speech tokens: its second chunk from the prompt prefix (the prompt's
    tail, the first chunk and its own tokens), then each later hop."""
    hops = hops or HopPolicy()
    sched = hops.schedule(prompt.n_prompt)
    keys: set[int] = set()
    for plan in plan_all(n_tokens, prompt.n_prompt, hops):
        if plan.index > 0 and not plan.finalize:
            done = prompt.n_prefix if plan.index == 1 else sched.flow_end(plan) - plan.hop_tokens
            keys.add(2 * (sched.flow_end(plan) - done))
    return keys


def _count_state_calls(t2w: FastToken2Wav) -> list[int]:
    """Record the frames of every ``state_core`` call (the slot's GraphedFn looks it up per call)."""
    frames: list[int] = []
    flow = t2w.flow
    assert isinstance(flow, Flow)
    core = flow.state_core

    def counted(mu: torch.Tensor, *args: object) -> torch.Tensor:
        frames.append(int(mu.shape[2]))
        return core(mu, *args)  # type: ignore[arg-type]

    flow.state_core = counted  # type: ignore[method-assign,assignment]
    return frames


@pytest.fixture
def cpu_t2w() -> FastToken2Wav:
    return FastToken2Wav(random_flow(TINY, "cpu"), random_hift(TINY, "cpu"))


@pytest.mark.parametrize("growth", ["double", "buffered"])
def test_later_chunks_on_a_state_slot_equal_the_rerun(cpu_t2w: FastToken2Wav, growth: str) -> None:
    """A stream holding a state slot: its second chunk covers the prompt's tail and the first
    chunk too (the state starts as the voice's prefix), each later one its own hop; every
    chunk equals the re-run path's; the final chunk gives the slot back."""
    hops = HopPolicy(growth=growth)
    want, _ = _run(cpu_t2w, 60, 300, prefix=False, hops=hops)
    assert cpu_t2w.use_state_slots(1, 400) == 1
    frames = _count_state_calls(cpu_t2w)
    got, stream = _run(cpu_t2w, 60, 300, hops=hops)
    assert [len(c) for c in got] == [len(c) for c in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=0)
    prompt = stream.first_prefix
    assert prompt is not None and prompt.n_prefix == 50
    keys = _state_keys(prompt, 300, hops)
    plans = [p for p in stream.chunk_log if p.index > 0 and not p.finalize]
    assert len(frames) == len(plans) and set(frames) == keys
    assert frames[0] == 2 * (60 - 50 + plans[0].token_len - 3)  # tail + first chunk + second
    assert stream.state_slot is None and cpu_t2w._state_slots[0].owner is None


def test_a_stream_on_a_slot_takes_longer_hops_and_ends_within_the_usual_final_chunk(cpu_t2w: FastToken2Wav) -> None:
    """With ``HopPolicy.state_max_hop`` (the engine's ``flow_state_max_hop_tokens``) a stream on
    a slot grows its hop to 200 tokens (25, 25, 50, 100, 200, 200 ...); once its tokens are
    all made, a rest longer than a usual final chunk first gets a non-final chunk of the usual
    largest hop. Every chunk equals the re-run path's over the same chunks."""
    hops = HopPolicy(growth="buffered", state_max_hop=200)
    for n in (695, 775):  # the rest after 615 tokens: 80 (the final chunk), 160 (100, then 60)
        token, feat, emb = random_voice(60, "cpu", 3)
        ref = cpu_t2w.open_stream(token, feat, emb)
        # the chunks the scheduler plans for a stream on a slot (HopPolicy.on_state), for both
        plans = chunk_plans(ref, _speech(n), hops, state=True)
        want = [c.clone() for c in cpu_t2w.stream_all(ref, _speech(n), plans)]
        cpu_t2w.use_state_slots(1, 60 + n)
        frames = _count_state_calls(cpu_t2w)
        stream = cpu_t2w.open_stream(token, feat, emb, first_prefix=cpu_t2w.prepare_prefix(token, feat, emb))
        assert stream.state_slot is not None
        got = [c.clone() for c in cpu_t2w.stream_all(stream, _speech(n), plans)]
        hop_list = [p.hop_tokens for p in stream.chunk_log]
        assert hop_list == [p.hop_tokens for p in ref.chunk_log]
        assert hop_list[:6] == [25 + 15, 25, 50, 100, 200, 200]  # the first with the prompt's pad
        assert hop_list[6:] == ([n - 615] if n - 615 < 103 else [100, n - 715])
        assert stream.chunk_log[-1].finalize and sum(hop_list) == n
        assert 400 in frames  # the 200-token chunks on the state
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=5e-5, rtol=0)
        flow = cpu_t2w.flow
        assert isinstance(flow, Flow)
        del flow.state_core  # the instance's counting wrapper
        cpu_t2w.use_state_slots(0, 1)


def test_a_stream_leaves_a_slot_too_small_and_goes_on_by_rerun(cpu_t2w: FastToken2Wav) -> None:
    """Capacity 160 tokens: the chunks that fit run on the state, the first that does not
    leaves the slot (free again at once) and the rest re-run: the same audio throughout."""
    want, _ = _run(cpu_t2w, 60, 250, prefix=False)
    cpu_t2w.use_state_slots(1, 160)
    frames = _count_state_calls(cpu_t2w)
    slot = cpu_t2w._state_slots[0]
    token, feat, emb = random_voice(60, "cpu", 3)
    stream = cpu_t2w.open_stream(token, feat, emb, first_prefix=cpu_t2w.prepare_prefix(token, feat, emb))
    got = []
    for chunk in cpu_t2w.stream_all(stream, _speech(250), chunk_plans(stream, _speech(250))):
        got.append(chunk.clone())
        if slot.owner is None:
            assert stream.state_slot is None
    assert 0 < len(frames) < len([p for p in stream.chunk_log if p.index > 0 and not p.finalize])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=0)


def test_slots_go_to_streams_with_a_prefix_and_come_back(cpu_t2w: FastToken2Wav) -> None:
    """One slot: the first stream with a prompt prefix takes it, a second waits without one
    (re-run), a stream without a prefix never takes one; a reset or release_state gives it
    back; use_state_slots(0) and use_cuda_graphs drop the slots and their holders' claims."""
    cpu_t2w.use_state_slots(1, 300)
    token, feat, emb = random_voice(60, "cpu", 3)
    prompt = cpu_t2w.prepare_prefix(token, feat, emb)
    a = cpu_t2w.open_stream(token, feat, emb, first_prefix=prompt)
    b = cpu_t2w.open_stream(token, feat, emb, first_prefix=prompt)
    c = cpu_t2w.open_stream(token, feat, emb)
    assert a.state_slot is cpu_t2w._state_slots[0] and b.state_slot is None and c.state_slot is None
    second = ChunkPlan(1, 40, 93, 50, False)  # a 60-token prompt: 40 tokens first, then 50
    assert not cpu_t2w.batchable(a, second) and cpu_t2w.batchable(b, second)  # a has its own state
    a.reset(token, feat, emb)  # no prefix this time: the slot is given back
    assert a.state_slot is None and cpu_t2w._state_slots[0].owner is None
    b.reset(token, feat, emb, first_prefix=prompt)
    assert b.state_slot is cpu_t2w._state_slots[0]
    cpu_t2w.release_state(b)
    assert b.state_slot is None and cpu_t2w._state_slots[0].owner is None
    c.reset(token, feat, emb, first_prefix=prompt)
    assert c.state_slot is not None
    cpu_t2w.use_state_slots(0, 1)
    assert c.state_slot is None and not cpu_t2w._state_slots
    cpu_t2w.use_state_slots(1, 300)
    c.reset(token, feat, emb, first_prefix=prompt)
    cpu_t2w.use_cuda_graphs(False)  # which drops the slots too
    assert c.state_slot is None and not cpu_t2w._state_slots
    with pytest.raises(ValueError, match="state slots"):
        cpu_t2w.use_state_slots(-1, 10)


def test_state_inputs_checks_its_chunk(cpu_t2w: FastToken2Wav) -> None:
    """A chunk off a boundary, without its look-ahead, or past the capacity is refused before
    the state changes."""
    flow = cpu_t2w.flow
    assert isinstance(flow, Flow)
    token, feat, emb = random_voice(60, "cpu", 3)
    with torch.inference_mode():
        prompt = flow.prepare_prompt(token, feat, emb)
        cache = flow.allocate_stream_cache(100)
        flow.reset_stream_cache(cache, prompt)
        with pytest.raises(ValueError, match="boundary"):
            flow.state_inputs(cache, torch.tensor([_speech(20)]))
        with pytest.raises(ValueError, match="look-ahead"):
            flow.state_inputs(cache, torch.tensor([_speech(3)]))
        with pytest.raises(ValueError, match="capacity"):
            flow.state_inputs(cache, torch.tensor([_speech(68)]))
    assert (cache.n_tokens, cache.n_done) == (60, prompt.n_prefix)


# --------------------------------------------------------------------------------------------
# CUDA: the fused kernels that extend a state, and the graphs


@pytest.mark.requires_cuda
@pytest.mark.parametrize("split", [False, True])
def test_attention_storing_its_keys_at_a_device_start_equals_sdpa(split: bool) -> None:
    """Frames ``start ..`` attending over a state's keys before ``start`` and their own, the
    start read on the device: SDPA with the chunk mask; the call's keys and values land in the
    state at ``start ..`` and nothing else there changes. With a workspace the prefix's keys
    are split over several programs (this tier's rows split): the same within rounding, the
    same bits launch after launch, the counters left at zero."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    b, t, heads, d, chunk, cap = 2, 100, 8, 64, 50, 1800
    ws = flow_kernels.attention_workspace(b * t, heads, d, dev) if split else None
    assert (ws is not None) == split  # 200 rows: the small tier, which splits
    for start in (0, 250, 400, 1650):
        qkv = torch.randn(b * t, 3 * heads * d, generator=gen, device=dev).to(dt)
        pk = torch.randn(b, heads, cap, d, generator=gen, device=dev).to(dt)
        pv = torch.randn(b, heads, cap, d, generator=gen, device=dev).to(dt)
        before = (pk.clone(), pv.clone())
        q, k, v = qkv.view(b, t, 3, heads, d).permute(2, 0, 3, 1, 4)
        keys, vals = torch.cat([pk[:, :, :start], k], dim=2), torch.cat([pv[:, :, :start], v], dim=2)
        allowed = chunk_mask(start, t, start + t, chunk, dev)
        mask = attention_bias(allowed, dt) if allowed is not None else None
        want = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask).transpose(1, 2).reshape(b * t, -1)
        at = torch.tensor([start], device=dev)
        got = flow_kernels.attention(qkv, b, heads, d, chunk, None, prefix=(pk, pv), at=at, write=True, ws=ws)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        if ws is not None:
            for _ in range(3):
                again = flow_kernels.attention(qkv, b, heads, d, chunk, None, prefix=(pk, pv), at=at, write=True, ws=ws)
                assert torch.equal(again, got)
            assert not ws[1].any()
        assert torch.equal(pk[:, :, start : start + t], k) and torch.equal(pv[:, :, start : start + t], v)
        for buf, old in zip((pk, pv), before, strict=True):
            assert torch.equal(buf[:, :, :start], old[:, :, :start])
            assert torch.equal(buf[:, :, start + t :], old[:, :, start + t :])
    with pytest.raises(ValueError, match="prefix state"):
        flow_kernels.attention(qkv, b, heads, d, chunk, None, at=at)
    with pytest.raises(ValueError, match="prefix keys"):
        flow_kernels.attention(qkv, b, heads, d, chunk, None, prefix=(pk[:, :, :50], pv[:, :, :50]), at=at, write=True)


def _pair(dims: object) -> tuple[Flow, Flow]:
    plain = random_flow(dims, "cuda", torch.bfloat16, seed=0).fuse_()  # type: ignore[arg-type]
    fused = copy.deepcopy(plain)
    assert fused_flow.use_kernels(fused, True)
    return plain, fused


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dims", [TINY, FULL], ids=["tiny", "0.5b"])
def test_state_chunks_with_kernels_equal_the_plain_state_path(dims: object) -> None:
    """Three chunks of a stream from the voice's prefix (the catch-up, then two hops) through
    ``state_core`` with the fused kernels (start on the device; the kernels extend the state)
    against the plain bf16 state path (the estimator without kernels, start read on the host):
    within bf16 rounding, chunk by chunk,
    and the fused state then holds what the plain one does."""
    plain, fused = _pair(dims)
    d = fused.dims
    n_prompt = 150 if dims == FULL else 60
    token, feat, emb = random_voice(n_prompt, "cuda", 5)
    speech = torch.tensor([_speech(400)], device="cuda")
    with torch.inference_mode():
        caches = []
        for flow in (plain, fused):
            prompt = flow.prepare_prompt(token, feat, emb)
            cache = flow.allocate_stream_cache(n_prompt + 400)
            flow.reset_stream_cache(cache, prompt)
            caches.append(cache)
        first = 2 * d.enc_chunk - (n_prompt - caches[0].n_done)  # tokens to the second boundary
        bounds = [first, first + 2 * d.enc_chunk, first + 4 * d.enc_chunk]
        done = 0
        for stop in bounds:
            new = speech[:, done : stop + d.pre_lookahead]
            want = state_chunk(plain, caches[0], new)
            mu, spk, cond, x0, at = fused.state_inputs(caches[1], new)
            got = fused.state_core(mu, spk, cond, x0, at, caches[1])
            # the state's frames from its last boundary (the first time, the prompt's tail too)
            got = got[:, :, got.shape[2] - want.shape[2] :]
            assert (got - want).abs().max() / want.abs().max() < 3e-2
            done = stop
        f = d.token_mel_ratio * caches[0].n_done
        for a, b in ((caches[0].est_k, caches[1].est_k), (caches[0].est_v, caches[1].est_v)):
            assert (a[..., :f, :] - b[..., :f, :]).abs().max() / a[..., :f, :].abs().max() < 5e-2
        for a, b in zip(caches[0].est_ctx, caches[1].est_ctx, strict=True):
            assert (a - b).abs().max() <= 5e-2 * a.abs().max() + 1e-3


@pytest.mark.requires_cuda
def test_graphed_state_slots_equal_eager_across_voices() -> None:
    """Start-up captures the slot graphs of a prompt length (placeholder streams through each
    slot: the estimator's per chunk length, the encoder's per chunk position); then streams of
    voices A, B and A again (one at a time, then two at once on two slots) replay them and
    give the audio of the same streams without slots, run eagerly with the same fused
    kernels; a longer stream's later positions run their encoder eagerly, capturing nothing."""
    flow = random_flow(TINY, "cuda", torch.bfloat16)
    assert fused_flow.use_kernels(flow, True)
    t2w = FastToken2Wav(flow, random_hift(TINY, "cuda"))
    voices = [(60, 11), (60, 12), (60, 11)]
    want = [_run(t2w, n, 300, seed=seed, device="cuda", prefix=False)[0] for n, seed in voices]
    longer, _ = _run(t2w, 60, 400, seed=11, device="cuda", prefix=False)
    t2w.use_cuda_graphs(True, first_lane=True)
    t2w.use_state_slots(2, 500)
    token, feat, emb = random_voice(60, "cuda", 11)
    prompt = t2w.prepare_prefix(token, feat, emb)
    t2w.capture_stream_shapes(token, feat, emb, 300, stream_shapes(HopPolicy(), 60), first_prefix=prompt)
    keys = _state_keys(prompt, 300)
    assert all(set(slot.graph.captured_keys) == keys for slot in t2w._state_slots)
    # the encoder's graphs: one per chunk position (the catch-up, then each hop)
    positions = len([p for p in plan_all(300, 60) if p.index > 0 and not p.finalize])
    encoders = [slot.encoder for slot in t2w._state_slots]
    assert all(e is not None and len(e.captured_keys) == positions for e in encoders)
    slot = t2w._state_slots[0]
    for (n, seed), ref in zip(voices, want, strict=True):
        got, stream = _run(t2w, n, 300, seed=seed, device="cuda")
        assert [len(c) for c in got] == [len(c) for c in ref]
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=0)
        # the stream's tokens went into the first slot's state (the placeholders' were others)
        k = slot.cache.n_done - n
        assert k > 200 and slot.cache.tokens[n : n + k].tolist() == _speech(300)[:k]
    # positions past the captured ones: their encoder runs eagerly, nothing is captured
    got, _ = _run(t2w, 60, 400, seed=11, device="cuda")
    for a, b in zip(got, longer, strict=True):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=0)
    assert all(e is not None and len(e.captured_keys) == positions for e in encoders)
    # two streams at once, one slot each, chunks interleaved
    streams = []
    for seed in (11, 12):
        tok, ft, em = random_voice(60, "cuda", seed)
        streams.append(t2w.open_stream(tok, ft, em, first_prefix=t2w.prepare_prefix(tok, ft, em)))
    assert {id(s.state_slot) for s in streams} == {id(slot) for slot in t2w._state_slots}
    outs: list[list[torch.Tensor]] = [[], []]
    speech = _speech(300)
    schedules = [HopPolicy().schedule(60) for _ in streams]
    while not all(s.finished for s in streams):
        for i, s in enumerate(streams):
            plan = schedules[i].ready(len(speech), True)
            if plan is not None:
                outs[i].append(s.run_chunk(plan, speech).clone())
                schedules[i].commit(plan)
    for out, ref in zip(outs, want[:2], strict=True):
        for a, b in zip(out, ref, strict=True):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=0)
