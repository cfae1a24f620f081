"""The LM backbone and its static KV cache: batched decode == single-slot decode, appends, resets, dtypes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT
from voice_out.model.checkpoint import CheckpointError, llm_dims, load_llm, load_state_dict, random_llm
from voice_out.model.llm import KVCache, LLMDims, SpeechLM, apply_rope, rope_cos_sin, rope_matrices

TINY = REPO_ROOT / "configs" / "models" / "tiny"
FULL = REPO_ROOT / "configs" / "models" / "cosyvoice2-0.5b"
PROMPT_LENGTHS = (3, 17, 9, 30)


@pytest.fixture(scope="module")
def tiny() -> SpeechLM:
    return random_llm(TINY, "cpu", torch.float32, seed=1)


def prompts(lm: SpeechLM, lengths: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, lm.dims.hidden_size, generator=gen) for n in lengths]


def speech_tokens(n_streams: int, n_steps: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 6561, (n_steps, n_streams), generator=torch.Generator().manual_seed(seed))


def single_stream(lm: SpeechLM, prompt: torch.Tensor, tokens: torch.Tensor, max_len: int) -> torch.Tensor:
    """Reference: one stream alone in a one-slot cache. Returns hidden ``[1 + steps, H]``."""
    cache = KVCache.allocate(lm.dims, 1, max_len, device=prompt.device, dtype=prompt.dtype)
    out = [lm.prefill(cache, 0, prompt)]
    for tok in tokens.tolist():
        out.append(lm.decode_step(cache, torch.tensor([0], device=prompt.device), lm.embed_speech(tok_t(tok, lm)))[0])
    return torch.stack(out)


def tok_t(tok: int, lm: SpeechLM) -> torch.Tensor:
    return torch.tensor([tok], device=lm.llm_decoder.weight.device)


def test_official_dims_and_parameter_count() -> None:
    dims = llm_dims(FULL)
    assert (dims.hidden_size, dims.n_layers, dims.n_heads, dims.n_kv_heads, dims.head_dim) == (896, 24, 14, 2, 64)
    assert (dims.intermediate_size, dims.text_vocab_size, dims.speech_vocab_size) == (4864, 151936, 6564)
    assert (dims.eos_token, dims.fill_token, dims.stop_tokens) == (6561, 6563, frozenset({6561, 6562, 6563}))
    with torch.device("meta"):
        n_params = sum(p.numel() for p in SpeechLM(dims).parameters())
    assert n_params == 505_803_812  # spec 2.3: 505.8 M unique parameters (no tied lm_head)


def test_rope_matrices_rotate_like_apply_rope() -> None:
    """One batched matmul per row (the decode step's RoPE) equals the rotate-half formula."""
    pos = torch.tensor([0, 1, 17, 4095])
    x = torch.randn(4, 3, 64, dtype=torch.float64).float()
    m = rope_matrices(pos, 64, 1e6)
    cos, sin = rope_cos_sin(pos[:, None], 64, 1e6)  # [4, 1, 64]
    want = apply_rope(x[:, :, None], cos, sin)[:, :, 0]  # x as [B, H, L=1, D]
    torch.testing.assert_close(torch.bmm(x, m), want, atol=1e-6, rtol=1e-6)


def test_inactive_rows_leave_their_slots_untouched(tiny: SpeechLM) -> None:
    """Rows of a slots=None step that are not active append nothing and write nothing to their
    slot (their K/V go to the scratch slot); the active rows equal a plain step of theirs."""
    ref = KVCache.allocate(tiny.dims, 5, 30)
    fast = KVCache.allocate(tiny.dims, 5, 30)
    for s, p in enumerate(prompts(tiny, (3, 17, 9, 30))):
        tiny.prefill(ref, s, p)
        tiny.prefill(fast, s, p)
    before_k, before_v = fast.k.clone(), fast.v.clone()
    embeds = tiny.embed_speech(speech_tokens(4, 1)[0])
    active = torch.tensor([True, False, True, False])
    # slot 3 is full (30 of 30 positions): an inactive row must not write at its length
    got = tiny.decode_step(fast, None, embeds, active=active, scratch_slot=4)
    want = tiny.decode_step(ref, torch.tensor([0, 2]), embeds[[0, 2]])
    torch.testing.assert_close(got[[0, 2]], want, atol=1e-5, rtol=1e-5)
    assert fast.lengths.tolist() == [4, 17, 10, 30, 0]
    for s in (1, 3):
        assert torch.equal(fast.k[:, s], before_k[:, s]) and torch.equal(fast.v[:, s], before_v[:, s])
    for s in (0, 2):
        n = int(fast.lengths[s])
        torch.testing.assert_close(fast.k[:, s, :, :n], ref.k[:, s, :, :n], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="scratch_slot"):
        tiny.decode_step(fast, None, embeds, active=active)


def test_dims_validation() -> None:
    llm = {"llm_input_size": 64, "llm_output_size": 64, "speech_token_size": 6561}
    qwen = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 160,
        "vocab_size": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
    }
    assert LLMDims.from_configs(llm, qwen).head_dim == 16
    with pytest.raises(ValueError, match="llm_input_size"):
        LLMDims.from_configs({**llm, "llm_input_size": 32}, qwen)
    with pytest.raises(ValueError, match="multiple"):
        LLMDims.from_configs(llm, {**qwen, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="rope_theta"):
        LLMDims.from_configs(llm, {k: v for k, v in qwen.items() if k != "rope_theta"})
    with pytest.raises(ValueError, match="even"):
        LLMDims.from_configs(llm, {**qwen, "head_dim": 7})
    # An explicit head_dim need not be hidden / heads (the projections follow it).
    narrow = LLMDims.from_configs(llm, {**qwen, "head_dim": 8})
    lm = SpeechLM(narrow)
    assert lm.get_submodule("layers.0.attn.wqkv").weight.shape == ((4 + 2 * 2) * 8, 64)
    cache = KVCache.allocate(narrow, 1, 8)
    assert lm.prefill(cache, 0, torch.randn(3, 64)).shape == (64,)
    assert lm.decode_step(cache, None, torch.randn(1, 64)).shape == (1, 64)


@pytest.mark.parametrize("layout", ["slots", "permuted", "packed", "window"])
def test_batched_decode_equals_single_slot_decodes(tiny: SpeechLM, layout: str) -> None:
    steps, max_len = 6, 64
    ps = prompts(tiny, PROMPT_LENGTHS)
    tokens = speech_tokens(len(ps), steps)
    reference = [single_stream(tiny, p, tokens[:, b], max_len) for b, p in enumerate(ps)]

    cache = KVCache.allocate(tiny.dims, n_slots=6, max_len=max_len)
    cache.k.normal_()  # stale junk everywhere: masks must hide it
    cache.v.normal_()
    slot_of = {"slots": [1, 4, 0, 5], "permuted": [3, 0, 2, 1], "packed": [0, 1, 2, 3], "window": [2, 3, 4, 5]}[layout]
    got = [[tiny.prefill(cache, slot_of[b], p)] for b, p in enumerate(ps)]
    slots = None if layout == "packed" else torch.tensor(slot_of)
    kv_len = max(PROMPT_LENGTHS) + steps if layout == "window" else None
    for i in range(steps):
        hidden = tiny.decode_step(cache, slots, tiny.embed_speech(tokens[i]), kv_len=kv_len)
        for b in range(len(ps)):
            got[b].append(hidden[b])
    for b in range(len(ps)):
        torch.testing.assert_close(torch.stack(got[b]), reference[b], atol=2e-6, rtol=1e-5)
    assert [int(cache.lengths[s]) for s in slot_of] == [n + steps for n in PROMPT_LENGTHS]


def test_prefill_appends_like_one_prefill_and_like_decode(tiny: SpeechLM) -> None:
    (rows,) = prompts(tiny, (20,), seed=3)
    one = KVCache.allocate(tiny.dims, 1, 32)
    h_one = tiny.prefill(one, 0, rows)
    pieces = KVCache.allocate(tiny.dims, 1, 32)
    for a, b in ((0, 7), (7, 8), (8, 20)):
        h_pieces = tiny.prefill(pieces, 0, rows[a:b], start_pos=a)
    stepped = KVCache.allocate(tiny.dims, 1, 32)
    tiny.prefill(stepped, 0, rows[:5])
    for r in rows[5:]:
        h_step = tiny.decode_step(stepped, torch.tensor([0]), r[None])[0]
    torch.testing.assert_close(h_pieces, h_one, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(h_step, h_one, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(pieces.k[:, :, :, :20], one.k[:, :, :, :20], atol=2e-6, rtol=1e-5)
    assert int(pieces.lengths[0]) == int(stepped.lengths[0]) == 20
    with pytest.raises(ValueError, match="does not fit"):
        tiny.prefill(one, 0, torch.zeros(13, tiny.dims.hidden_size))


def test_reset_in_place_reuses_a_slot(tiny: SpeechLM) -> None:
    a, b = prompts(tiny, (25, 6), seed=4)
    tokens = speech_tokens(1, 4, seed=5)[:, 0]
    cache = KVCache.allocate(tiny.dims, 2, 40)
    k_storage = cache.k.data_ptr()
    tiny.prefill(cache, 0, a)
    tiny.decode_step(cache, torch.tensor([0]), tiny.embed_speech(tokens[:1]))
    cache.reset(0)
    assert int(cache.lengths[0]) == 0 and cache.k.data_ptr() == k_storage
    got = [tiny.prefill(cache, 0, b)]
    for t in tokens.tolist():
        got.append(tiny.decode_step(cache, torch.tensor([0]), tiny.embed_speech(tok_t(t, tiny)))[0])
    torch.testing.assert_close(torch.stack(got), single_stream(tiny, b, tokens, 40), atol=2e-6, rtol=1e-5)
    cache.reset([0, 1])
    assert cache.lengths.tolist() == [0, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_and_tracks_float32(tiny: SpeechLM, dtype: torch.dtype) -> None:
    lm = random_llm(TINY, "cpu", dtype, seed=1)
    assert lm.llm_decoder.weight.dtype == dtype
    ps = prompts(tiny, (11, 5))
    tokens = speech_tokens(2, 3)
    ref = [single_stream(tiny, p, tokens[:, b], 32) for b, p in enumerate(ps)]
    cache = KVCache.allocate(lm.dims, 2, 32, dtype=dtype)
    got = [[lm.prefill(cache, b, p.to(dtype))] for b, p in enumerate(ps)]
    for i in range(3):
        hidden = lm.decode_step(cache, torch.tensor([0, 1]), lm.embed_speech(tokens[i]))
        assert hidden.dtype == dtype
        for b in range(2):
            got[b].append(hidden[b])
    for b in range(2):
        h = torch.stack(got[b]).float()
        assert torch.isfinite(h).all()
        assert (h - ref[b]).abs().max() < 0.1  # O(1) activations, 8-10 bit mantissas
    logp = lm.logprobs(hidden)
    assert logp.dtype == torch.float32 and torch.allclose(logp.exp().sum(-1), torch.ones(2), atol=1e-4)


def test_random_weights_are_seeded_and_activations_stay_order_one(tiny: SpeechLM) -> None:
    again = random_llm(TINY, "cpu", torch.float32, seed=1)
    other = random_llm(TINY, "cpu", torch.float32, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(tiny.parameters(), again.parameters(), strict=True))
    assert not torch.equal(tiny.llm_decoder.weight, other.llm_decoder.weight)
    cache = KVCache.allocate(tiny.dims, 1, 64)
    rows = [(0, 0), *[(1, i) for i in range(40)], (0, 1), *[(2, i * 7) for i in range(10)]]
    logits = tiny.logits(tiny.prefill(cache, 0, tiny.embed_rows(rows)))
    assert 0.3 < logits.std().item() < 5.0
    assert torch.log_softmax(logits, -1).max().item() < -1.0  # no single token dominates


def _copy_configs(src: Path, dst: Path) -> None:
    (dst / "CosyVoice-BlankEN").mkdir(parents=True)
    shutil.copy(src / "cosyvoice2.yaml", dst / "cosyvoice2.yaml")
    shutil.copy(src / "CosyVoice-BlankEN" / "config.json", dst / "CosyVoice-BlankEN" / "config.json")


def test_load_llm_needs_only_llm_pt_and_reports_bad_keys(parity_dir: Path, tmp_path: Path) -> None:
    state = load_state_dict(parity_dir / "llm.pt")
    good = tmp_path / "good"
    _copy_configs(parity_dir, good)
    torch.save(state, good / "llm.pt")  # no model.safetensors next to it
    lm = load_llm(good, "cpu", torch.bfloat16)
    assert lm.llm_decoder.weight.dtype == torch.bfloat16
    assert torch.equal(lm.speech_embedding.weight.float(), state["speech_embedding.weight"].bfloat16().float())

    bad = tmp_path / "bad"
    _copy_configs(parity_dir, bad)
    broken = dict(state)
    del broken["llm.model.model.layers.1.self_attn.k_proj.bias"]
    del broken["llm_decoder.bias"]
    broken["llm.model.model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    torch.save(broken, bad / "llm.pt")
    with pytest.raises(CheckpointError) as err:
        load_llm(bad)
    msg = str(err.value)
    assert "layers.0.mlp.extra.weight" in msg and "k_proj.bias" in msg

    del broken["llm.model.model.layers.0.mlp.extra.weight"]
    broken["llm.model.model.layers.1.self_attn.k_proj.bias"] = state["llm.model.model.layers.1.self_attn.k_proj.bias"]
    torch.save(broken, bad / "llm.pt")
    with pytest.raises(CheckpointError, match="llm_decoder.bias"):
        load_llm(bad)


def _cuda_streams(dtype: torch.dtype) -> tuple[float, float]:
    """8 streams batched vs each alone on CUDA; returns (max |batched - single|, max |single - fp32|)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    lm = random_llm(TINY, "cuda", dtype, seed=1)
    lm32 = random_llm(TINY, "cuda", torch.float32, seed=1)  # same draws: the fp32 truth
    lengths = (5, 40, 12, 77, 3, 21, 60, 9)
    ps = [p.cuda() for p in prompts(lm, lengths)]
    tokens = speech_tokens(8, 5).cuda()
    ref = [single_stream(lm, p.to(dtype), tokens[:, b], 128) for b, p in enumerate(ps)]
    truth = [single_stream(lm32, p, tokens[:, b], 128) for b, p in enumerate(ps)]
    cache = KVCache.allocate(lm.dims, 8, 128, device="cuda", dtype=dtype)
    slots = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], device="cuda")
    got = [[lm.prefill(cache, int(slots[b]), p.to(dtype))] for b, p in enumerate(ps)]
    for i in range(5):
        hidden = lm.decode_step(cache, slots, lm.embed_speech(tokens[i]))
        for b in range(8):
            got[b].append(hidden[b])
    batched_vs_single = max(
        (torch.stack(g).float() - r.float()).abs().max().item() for g, r in zip(got, ref, strict=True)
    )
    single_vs_fp32 = max((r.float() - t).abs().max().item() for r, t in zip(ref, truth, strict=True))
    return batched_vs_single, single_vs_fp32


@pytest.mark.requires_cuda
def test_cuda_batched_8_streams_equal_single_streams_fp32() -> None:
    diff, _ = _cuda_streams(torch.float32)
    assert diff < 1e-4, f"fp32: batched vs single differ by {diff:.2e}"


@pytest.mark.requires_cuda
def test_cuda_batched_8_streams_equal_single_streams_bf16() -> None:
    diff, bf16_error = _cuda_streams(torch.bfloat16)
    # Batching may change bf16 rounding (other GEMM kernels), never by more than bf16 itself errs.
    assert diff <= max(2 * bf16_error, 2e-2), f"bf16: batched vs single {diff:.2e}, bf16 vs fp32 {bf16_error:.2e}"


@pytest.mark.requires_cuda
def test_cuda_graph_replay_of_decode_step_equals_eager() -> None:
    lm = random_llm(TINY, "cuda", torch.float32, seed=1)
    ps = [p.cuda() for p in prompts(lm, (4, 30, 11, 19))]
    tokens = speech_tokens(4, 6).cuda()
    caches = [KVCache.allocate(lm.dims, 4, 64, device="cuda") for _ in range(2)]
    for cache in caches:
        for b, p in enumerate(ps):
            lm.prefill(cache, b, p)
    eager, graphed = caches
    slots = torch.arange(4, device="cuda")
    static_in = torch.zeros(4, lm.dims.hidden_size, device="cuda")
    # Warm up on a side stream (as torch.cuda.graphs requires), then undo the warm-up's append.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lm.decode_step(graphed, slots, static_in)
    torch.cuda.current_stream().wait_stream(side)
    graphed.lengths -= 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = lm.decode_step(graphed, slots, static_in)
    # (capture only records kernels: the cache is not touched until the first replay)
    for i in range(6):
        emb = lm.embed_speech(tokens[i])
        ref = lm.decode_step(eager, slots, emb)
        static_in.copy_(emb)
        graph.replay()
        torch.testing.assert_close(static_out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(graphed.lengths, eager.lengths)


@pytest.mark.requires_cuda
def test_cuda_decode_step_and_sampling_never_sync_with_the_host() -> None:
    from voice_out.model.sampling import SamplingParams, mask_eos_, new_history, ras_sample_batch

    lm = random_llm(TINY, "cuda", torch.bfloat16, seed=1)
    cache = KVCache.allocate(lm.dims, 4, 64, device="cuda", dtype=torch.bfloat16)
    for s in range(4):
        lm.prefill(cache, s, torch.randn(5 + 3 * s, lm.dims.hidden_size, device="cuda"), start_pos=0)
    slots = torch.tensor([2, 0, 3, 1], device="cuda")
    embeds = lm.embed_speech(torch.tensor([1, 2, 3, 4], device="cuda"))
    params = SamplingParams()
    history = new_history(4, params, "cuda")
    uniforms = torch.rand(4, 2, device="cuda")
    eos_masked = torch.tensor([True, False, True, False], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
    try:
        lm.decode_step(cache, slots, embeds, kv_len=32)
        hidden = lm.decode_step(cache, None, embeds)
        logp = mask_eos_(lm.logprobs(hidden), eos_masked, lm.dims.eos_token)
        tokens = ras_sample_batch(logp, history, uniforms, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (4,)
    assert cache.lengths.tolist() == [7, 10, 13, 16]
