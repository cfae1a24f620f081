"""The flow's incremental path (a stream's own state: ``state_inputs`` / ``state_core``, eager
here) against its re-run reference path.

A small random flow (encoder width 512 as upstream requires, everything else tiny) with a
5-token chunk, so that short sequences cross many chunk boundaries. What is proven:

* every non-final chunk on the state equals upstream's re-run
  ``inference(tokens[:offset + hop + 3], streaming=True, finalize=False)[..., 2 offset:]``, and
  the final chunk (token2wav's full-attention re-run) equals upstream's final pass;
* the non-final chunks equal the matching slice of ONE streaming pass over all tokens;
* the work per chunk is its new tokens only (no earlier frame goes through the network again);
* prompt state is shared read-only, states reset in place and refuse what does not fit.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from voice_out.model.checkpoint import init_random_flow_
from voice_out.model.flow import Flow
from voice_out.model.flow_dims import FlowDims, FlowPrompt, FlowStreamCache

TOL = 1e-5  # fp32: the paths differ only by matmul blocking


def tiny_dims(enc_chunk: int = 5, est_chunk: int = 10, noise_frames: int = 15000) -> FlowDims:
    return FlowDims(
        vocab_size=300,
        input_size=512,
        n_mels=80,
        spk_embed_dim=24,
        token_mel_ratio=2,
        pre_lookahead=3,
        enc_input_size=512,
        enc_dim=512,
        enc_heads=8,
        enc_ffn=32,
        enc_blocks=1,
        enc_chunk=enc_chunk,
        cfg_rate=0.7,
        est_in=320,
        est_out=80,
        est_channels=32,
        est_heads=2,
        est_head_dim=16,
        est_blocks=1,
        est_mid_blocks=1,
        est_chunk=est_chunk,
        noise_frames=noise_frames,
    )


def make_flow(dims: FlowDims, seed: int = 0) -> Flow:
    return init_random_flow_(Flow(dims), seed).eval()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def flow() -> Flow:
    return make_flow(tiny_dims())


def inputs(flow: Flow, n_prompt: int, n_tokens: int, seed: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    d = flow.dims
    gen = torch.Generator().manual_seed(seed)
    token = torch.randint(0, d.vocab_size, (1, n_tokens), generator=gen)
    prompt_token = torch.randint(0, d.vocab_size, (1, n_prompt), generator=gen)
    prompt_feat = torch.randn(1, d.token_mel_ratio * n_prompt, d.n_mels, generator=gen) - 5.0
    embedding = torch.randn(1, d.spk_embed_dim, generator=gen)
    return token, prompt_token, prompt_feat, embedding


def state_chunk(flow: Flow, cache: FlowStreamCache, tokens: Tensor) -> Tensor:
    """A non-final chunk on ``cache``: ``tokens`` ``[1, n_new + lookahead]`` -> the mel of the
    new tokens ``[1, n_mels, ratio n_new]`` (the state's first chunk also computes the
    prompt's tail, dropped here)."""
    mu, spk, cond, x0, at = flow.state_inputs(cache, tokens)
    mel = flow.state_core(mu, spk, cond, x0, at, cache)
    n_new = tokens.shape[1] - flow.dims.pre_lookahead
    return mel[:, :, mel.shape[2] - flow.dims.token_mel_ratio * n_new :]


def run_stream(
    flow: Flow,
    prompt: FlowPrompt,
    token: Tensor,
    plan: list[tuple[int, int, bool]],
    capacity: int | None = None,
    cache: FlowStreamCache | None = None,
) -> list[Tensor]:
    """The chunks of ``plan`` as token2wav makes them on a stream state: each non-final one
    on the state (``cache``, or a new one of ``capacity`` tokens, reset to ``prompt``), the
    final one by the full-attention re-run."""
    la, ratio = flow.dims.pre_lookahead, flow.dims.token_mel_ratio
    if cache is None:
        cache = flow.allocate_stream_cache(capacity or prompt.n_prompt + token.shape[1])
    flow.reset_stream_cache(cache, prompt)
    out = []
    for offset, hop, final in plan:
        if final:
            args = (prompt.prompt_token, prompt.prompt_feat, prompt.embedding)
            mel = flow.inference(token[:, : offset + hop], *args, streaming=False, finalize=True)
            out.append(mel[:, :, ratio * offset :])
        else:
            out.append(state_chunk(flow, cache, token[:, offset : offset + hop + la]))
    return out


@pytest.mark.parametrize("n_prompt", [0, 2, 13, 20, 24])
def test_state_chunks_equal_rerun_for_every_chunk(flow: Flow, n_prompt: int) -> None:
    """n_prompt 0: no prompt; 2: no prefix; 13 / 24: a prefix and a prompt tail; 20: chunk-aligned."""
    token, prompt_token, prompt_feat, embedding = inputs(flow, n_prompt, 64)
    plan = flow.dims.upstream_plan(n_prompt, 64)
    assert sum(not f for _, _, f in plan) >= 4
    ratio, la = flow.dims.token_mel_ratio, flow.dims.pre_lookahead
    with torch.no_grad():
        prompt = flow.prepare_prompt(prompt_token, prompt_feat, embedding)
        chunks = run_stream(flow, prompt, token, plan)
        for (offset, hop, final), mel in zip(plan, chunks, strict=True):
            assert mel.shape == (1, flow.dims.n_mels, ratio * hop)
            n = offset + hop + (0 if final else la)
            ref = flow.inference(
                token[:, :n], prompt_token, prompt_feat, embedding, streaming=not final, finalize=final
            )
            err = float((ref[:, :, ratio * offset :] - mel).abs().max())
            print(f"P={n_prompt} chunk at {offset} (+{hop}, final={final}): state vs re-run {err:.2g}")
            assert err <= TOL


def test_streaming_chunks_equal_one_streaming_pass(flow: Flow) -> None:
    n_prompt, n_tokens = 13, 71
    token, prompt_token, prompt_feat, embedding = inputs(flow, n_prompt, n_tokens, seed=2)
    plan = flow.dims.upstream_plan(n_prompt, n_tokens)
    ratio = flow.dims.token_mel_ratio
    last_offset = plan[-1][0]
    with torch.no_grad():
        single = flow.inference(token, prompt_token, prompt_feat, embedding, streaming=True, finalize=True)
        full = flow.inference(token, prompt_token, prompt_feat, embedding, streaming=False, finalize=True)
        prompt = flow.prepare_prompt(prompt_token, prompt_feat, embedding)
        exact = torch.cat(run_stream(flow, prompt, token, plan), dim=2)
    head = ratio * last_offset
    assert float((exact[:, :, :head] - single[:, :, :head]).abs().max()) <= TOL
    assert float((exact[:, :, head:] - full[:, :, head:]).abs().max()) <= TOL  # upstream's final pass
    # the full-attention final really differs from the streaming pass (so the test can tell them apart)
    assert float((exact[:, :, head:] - single[:, :, head:]).abs().max()) > 1e-3


def test_work_per_chunk_is_only_the_new_tokens(flow: Flow) -> None:
    """Every layer sees only the new tokens/frames of a chunk, however long the stream is."""
    n_prompt, n_tokens = 24, 160
    token, prompt_token, prompt_feat, embedding = inputs(flow, n_prompt, n_tokens, seed=3)
    plan = flow.dims.upstream_plan(n_prompt, n_tokens)
    seen: list[tuple[str, int]] = []
    pos_rows: list[int] = []
    first_pos = flow.encoder.blocks[0].self_attn.linear_pos  # type: ignore[union-attr]
    assert isinstance(first_pos, torch.nn.Linear)
    hooks = [
        flow.encoder.register_forward_hook(lambda m, a, o: seen.append(("encoder", a[0].shape[1]))),
        flow.estimator.register_forward_hook(lambda m, a, o: seen.append(("estimator", a[0].shape[2]))),
        first_pos.register_forward_hook(lambda m, a, o: pos_rows.append(a[0].shape[0])),
    ]
    try:
        with torch.no_grad():
            prompt = flow.prepare_prompt(prompt_token, prompt_feat, embedding)
            prefix = prompt.n_prefix
            seen.clear()
            pos_rows.clear()
            run_stream(flow, prompt, token, plan[:-1])  # the final chunk is the full re-run
    finally:
        for h in hooks:
            h.remove()
    ratio, steps = flow.dims.token_mel_ratio, flow.dims.n_timesteps
    expected: list[tuple[str, int]] = []
    for k, (_, hop, _) in enumerate(plan[:-1]):
        n = hop + (n_prompt - prefix if k == 0 else 0)  # the first chunk also finishes the prompt tail
        expected += [("encoder", n)] + [("estimator", ratio * n)] * steps
    assert seen == expected
    # relative-position keys: a chunk projects only its new distances, never the old ones
    assert pos_rows[1:] == [hop for _, hop, _ in plan[1:-1]]
    assert max(hop for _, hop, _ in plan) == 4 * flow.dims.enc_chunk  # long stream, bounded chunks


def test_prompt_state_is_shared_and_caches_reset_in_place(flow: Flow) -> None:
    token, prompt_token, prompt_feat, embedding = inputs(flow, 24, 40, seed=4)
    other_token, *other_prompt = inputs(flow, 13, 40, seed=5)
    plan = flow.dims.upstream_plan(24, 40)
    with torch.no_grad():
        prompt = flow.prepare_prompt(prompt_token, prompt_feat, embedding)
        other = flow.prepare_prompt(*other_prompt)
        snapshot = [t.clone() for t in (prompt.prefix.est_k, prompt.prefix.enc_v, *prompt.prefix.est_ctx)]
        first = run_stream(flow, prompt, token, plan)
        cache = flow.allocate_stream_cache(64)
        cache_id = id(cache.est_k)
        run_stream(flow, other, other_token, flow.dims.upstream_plan(13, 40), cache=cache)
        for req in range(2):  # the same cache object serves request after request
            again = run_stream(flow, prompt, token, plan, cache=cache)  # reset to the prompt first
            assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), req
        assert id(cache.est_k) == cache_id  # reset does not reallocate
    after = [prompt.prefix.est_k, prompt.prefix.enc_v, *prompt.prefix.est_ctx]
    assert all(torch.equal(a, b) for a, b in zip(snapshot, after, strict=True)), "prompt state was modified"


@pytest.mark.requires_cuda
def test_prompt_state_kept_in_host_memory_serves_a_gpu_stream() -> None:
    """A voice store may keep prompt states off the GPU: reset copies them onto the flow's device."""
    flow = make_flow(tiny_dims()).to("cuda")
    token, prompt_token, prompt_feat, embedding = inputs(flow, 24, 30, seed=11)
    plan = flow.dims.upstream_plan(24, 30)
    with torch.no_grad():
        prompt = flow.prepare_prompt(prompt_token, prompt_feat, embedding)
        stored = prompt.to("cpu")
        assert stored.prefix.est_k.device.type == "cpu" and stored.nbytes == prompt.nbytes > 0
        a = run_stream(flow, prompt, token, plan)
        b = run_stream(flow, stored, token, plan)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_state_refuses_tokens_past_its_capacity(flow: Flow) -> None:
    """A state never grows (a CUDA graph holds its buffers): room to spare gives the same
    chunks as room for exactly the utterance; a chunk past the room is refused."""
    token, prompt_token, prompt_feat, embedding = inputs(flow, 13, 50, seed=6)
    plan = flow.dims.upstream_plan(13, 50)
    with torch.no_grad():
        prompt = flow.prepare_prompt(prompt_token, prompt_feat, embedding)
        roomy = run_stream(flow, prompt, token, plan, capacity=200)
        exact = run_stream(flow, prompt, token, plan, capacity=13 + 50)
        with pytest.raises(ValueError, match="capacity"):
            run_stream(flow, prompt, token, plan, capacity=14)
    for a, b in zip(roomy, exact, strict=True):
        assert float((a - b).abs().max()) <= TOL


def test_misuse_is_refused(flow: Flow) -> None:
    token, prompt_token, prompt_feat, embedding = inputs(flow, 13, 30, seed=7)
    with torch.no_grad():
        prompt = flow.prepare_prompt(prompt_token, prompt_feat, embedding)
        cache = flow.allocate_stream_cache(64)
        with pytest.raises(ValueError, match="reset to a prompt"):
            flow.state_inputs(cache, token[:, :10])
        flow.reset_stream_cache(cache, prompt)
        with pytest.raises(ValueError, match="chunk boundary"):
            flow.state_inputs(cache, token[:, :9])  # 13 + 6 is not a multiple of 5
        with pytest.raises(ValueError, match="look-ahead"):
            flow.state_inputs(cache, token[:, :3])
        state_chunk(flow, cache, token[:, :10])  # 13 + 7 = 20
        with pytest.raises(ValueError, match="prompt_feat"):
            flow.prepare_prompt(prompt_token, prompt_feat[:, :-1], embedding)


def test_length_limit_is_the_noise_buffer() -> None:
    short = make_flow(tiny_dims(noise_frames=60))
    token, prompt_token, prompt_feat, embedding = inputs(short, 5, 40, seed=8)
    with torch.no_grad():
        prompt = short.prepare_prompt(prompt_token, prompt_feat, embedding)
        cache = short.allocate_stream_cache(100)  # capped at the noise buffer's 30 tokens
        assert cache.capacity == 30
        short.reset_stream_cache(cache, prompt)
        state_chunk(short, cache, token[:, :18])  # 5 + 15 = 20 tokens = 40 frames
        with pytest.raises(ValueError, match="exceed"):
            state_chunk(short, cache, token[:, 15:33])  # 35 tokens = 70 frames > 60
        with pytest.raises(ValueError, match="noise buffer"):
            short.inference(token, prompt_token, prompt_feat, embedding, streaming=True, finalize=True)


def test_other_chunk_geometry_and_bfloat16() -> None:
    """Estimator chunk = 2 x the upsampled encoder chunk; and the state path in bfloat16."""
    flow = make_flow(tiny_dims(enc_chunk=5, est_chunk=20), seed=9)
    token, prompt_token, prompt_feat, embedding = inputs(flow, 7, 50, seed=10)
    plan = flow.dims.upstream_plan(7, 50)
    ratio = flow.dims.token_mel_ratio
    with torch.no_grad():
        single = flow.inference(token, prompt_token, prompt_feat, embedding, streaming=True, finalize=True)
        prompt = flow.prepare_prompt(prompt_token, prompt_feat, embedding)
        head = ratio * plan[-1][0]
        exact = torch.cat(run_stream(flow, prompt, token, plan), dim=2)
        assert float((exact[:, :, :head] - single[:, :, :head]).abs().max()) <= TOL
        flow = flow.to(torch.bfloat16)
        assert flow.noise.dtype == torch.float32 and torch.equal(flow.noise, make_flow(tiny_dims()).noise)
        prompt = flow.prepare_prompt(prompt_token, prompt_feat, embedding)
        assert prompt.prefix.est_k.dtype == torch.bfloat16
        low = run_stream(flow, prompt, token, plan)
    low_head = torch.cat(low, dim=2)[:, :, :head]
    assert low_head.dtype == torch.float32
    err = float((low_head - single[:, :, :head]).abs().max())
    print(f"bfloat16 state stream vs float32 single pass: max abs {err:.3g} (mel std {float(single.std()):.3g})")
    assert err < 0.25 * float(single.std())


@pytest.mark.parametrize(("n_prompt", "n_tokens"), [(17, 6), (17, 16), (10, 13)])
def test_prefix_core_equals_the_rerun_after_the_prefix(flow: Flow, n_prompt: int, n_tokens: int) -> None:
    """A first chunk from the voice's prompt prefix (the plain estimator: the prefix copied into
    a state of the call's size) gives the re-run's frames from the prefix's end on; the prefix
    itself is left as it was. Prompts of 17 tokens (prefix 10: a tail of 7 prompt tokens goes
    through with the chunk) and 10 (prefix 5), chunks ending 1 and 3 flow chunks later."""
    d = flow.dims
    token, prompt_token, prompt_feat, embedding = inputs(flow, n_prompt, n_tokens, seed=n_tokens)
    with torch.no_grad():
        prompt = flow.prepare_prompt(prompt_token, prompt_feat, embedding)
        assert prompt.n_prefix > 0
        before = (prompt.prefix.est_k.clone(), [c.clone() for c in prompt.prefix.est_ctx])
        ref = flow.inference(token, prompt_token, prompt_feat, embedding, streaming=True, finalize=False)
        ids, emb, cond = flow.prefix_inputs(token, prompt)
        mel = flow.prefix_core(ids, emb, cond, prompt.prefix)
    f0 = d.token_mel_ratio * (prompt.n_prefix - n_prompt)  # negative: the prompt tail's frames
    assert mel.shape == (1, d.n_mels, d.token_mel_ratio * (n_prompt + n_tokens - 3 - prompt.n_prefix))
    assert float((mel[:, :, -f0:] - ref).abs().max()) <= TOL
    assert torch.equal(prompt.prefix.est_k, before[0])
    assert all(torch.equal(a, b) for a, b in zip(prompt.prefix.est_ctx, before[1], strict=True))
    with pytest.raises(ValueError, match="chunk boundary"):
        flow.prefix_inputs(token[:, :-1], prompt)
    # only the fast path's fused calls read a prefix without extending it: the eager solve
    # takes no read-only prefix at all
    with pytest.raises(TypeError, match="prefix"):
        flow.solve(mel[:, :, :4], prompt.spk, mel[:, :, :4], True, 10, prefix=prompt.prefix)  # type: ignore[call-arg]
