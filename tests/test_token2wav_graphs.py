"""The token2wav fast path (graphed flow chunks, graphed vocoder) equals the eager path.

Grouped batched chunks (``FastToken2Wav.use_batch_buckets``, on with CUDA graphs): on the CPU the
batched GraphedFn runs eagerly, so the grouping by T, the bucket padding and the splitting are
checked there against ``run_chunk`` per stream (within 1e-5, tiny random models); the
``requires_cuda`` test checks the replayed graphs against the same rounds run eagerly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch

from tests.conftest import REPO_ROOT, chunk_plans, random_speech, random_voice
from voice_out.engine.chunk_schedule import ChunkPlan, HopPolicy, plan_all
from voice_out.engine.runner import stream_shapes
from voice_out.fast import flow_step, fused_flow
from voice_out.fast.flow_step import FINAL_COARSE_CHUNKS, FINAL_FINE_TOKENS, FastToken2Wav
from voice_out.fast.graphs import GraphedFn, graphs_disabled
from voice_out.model.checkpoint import random_flow, random_hift
from voice_out.model.token2wav import CHUNK_TOKENS, Token2WavStream

TINY = REPO_ROOT / "configs" / "models" / "tiny"


def _stream_all(t2w: FastToken2Wav, n_prompt: int, n_tokens: int, device: str) -> list[torch.Tensor]:
    token, feat, emb = random_voice(n_prompt, device)
    stream = t2w.open_stream(token, feat, emb)
    speech = torch.randint(0, 6561, (n_tokens,), generator=torch.Generator().manual_seed(9)).tolist()
    return [c.clone() for c in t2w.stream_all(stream, speech, chunk_plans(stream, speech))]


def test_graphs_are_a_no_op_on_cpu() -> None:
    t2w = FastToken2Wav(random_flow(TINY, "cpu"), random_hift(TINY, "cpu"))
    t2w.use_cuda_graphs(True)
    assert t2w._graph_flow is None and t2w._graph_hift is None


@pytest.mark.requires_cuda
def test_graphed_token2wav_equals_eager() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t2w = FastToken2Wav(random_flow(TINY, "cuda"), random_hift(TINY, "cuda"))
    want = _stream_all(t2w, 50, 190, "cuda")
    t2w.use_cuda_graphs(True)
    for _ in range(2):  # the second run replays graphs captured by the first
        got = _stream_all(t2w, 50, 190, "cuda")
        assert [len(c) for c in got] == [len(c) for c in want]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=0)
    assert t2w._graph_flow is not None and t2w._graph_flow.captured_keys
    assert t2w._graph_hift_cached is not None and t2w._graph_hift_cached.captured_keys


# --------------------------------------------------------------------------------------------
# First chunks from the voice's prompt prefix (FastToken2Wav.prepare_prefix)


def _prefix_stream_all(
    t2w: FastToken2Wav, n_prompt: int, seed: int, device: str, *, prefix: bool, fast_first: int = 0
) -> tuple[list[torch.Tensor], Any]:
    token, feat, emb = random_voice(n_prompt, device, seed)
    first_prefix = t2w.prepare_prefix(token, feat, emb) if prefix else None
    stream = t2w.open_stream(token, feat, emb, first_prefix=first_prefix)
    speech = random_speech(120, seed=seed + 100)
    plans = chunk_plans(stream, speech, fast_first=fast_first)
    return [c.clone() for c in t2w.stream_all(stream, speech, plans)], first_prefix


@pytest.mark.parametrize("n_prompt", [50, 60, 78])
def test_first_chunk_from_the_prompt_prefix_equals_the_rerun(cpu_t2w: FastToken2Wav, n_prompt: int) -> None:
    """A stream whose first chunk comes from its voice's prompt prefix (25, 50 and 75 tokens
    of these prompts) gives the audio of one that re-runs the prompt, chunk for chunk (the
    plain estimator on the CPU: the prefix copied into a state of the call's size)."""
    want, _ = _prefix_stream_all(cpu_t2w, n_prompt, 3, "cpu", prefix=False)
    got, prompt = _prefix_stream_all(cpu_t2w, n_prompt, 3, "cpu", prefix=True)
    assert prompt is not None and prompt.n_prefix == 25 * ((n_prompt - 3) // 25)
    assert [len(c) for c in got] == [len(c) for c in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_no_prefix_for_a_short_prompt_and_none_for_a_fast_first_chunk(cpu_t2w: FastToken2Wav) -> None:
    """A prompt with no whole chunk before its last 3 tokens has no prefix; a fast first chunk
    (ending off a chunk boundary) re-runs the prompt even when the stream has one."""
    assert cpu_t2w.prepare_prefix(*random_voice(27, "cpu", 4)) is None
    assert cpu_t2w.prepare_prefix(*random_voice(28, "cpu", 4)) is not None
    want, _ = _prefix_stream_all(cpu_t2w, 60, 5, "cpu", prefix=False, fast_first=12)
    got, _ = _prefix_stream_all(cpu_t2w, 60, 5, "cpu", prefix=True, fast_first=12)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.requires_cuda
def test_graphed_first_chunks_from_prefixes_equal_eager_across_voices() -> None:
    """Under CUDA graphs a first chunk from a prefix replays its prefix length's graph, whose
    buffers take each voice's prefix in turn: voices A, B (same prompt length) and A again each
    give their own eager audio; a voice of another length has a slot of its own."""
    flow = random_flow(TINY, "cuda", torch.bfloat16)
    assert fused_flow.use_kernels(flow, True)
    t2w = FastToken2Wav(flow, random_hift(TINY, "cuda"))
    voices = [(60, 11), (60, 12), (60, 11), (80, 13)]
    want = [_prefix_stream_all(t2w, n, seed, "cuda", prefix=True)[0] for n, seed in voices]
    t2w.use_cuda_graphs(True, first_lane=True)
    for (n, seed), ref in zip(voices, want, strict=True):
        got, _ = _prefix_stream_all(t2w, n, seed, "cuda", prefix=True)
        assert [len(c) for c in got] == [len(c) for c in ref]
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=0)
    assert sorted(t2w._prefix_slots) == [50, 75]
    assert all(slot.graph.captured_keys for slot in t2w._prefix_slots.values())


# --------------------------------------------------------------------------------------------
# Grouped batched chunks (FastToken2Wav.use_batch_buckets): one pass per T, padded to a bucket


def _open(t2w: FastToken2Wav, n_prompt: int, seed: int, device: str = "cpu") -> Token2WavStream:
    return t2w.open_stream(*random_voice(n_prompt, device, seed))


def _fork(t2w: FastToken2Wav, stream: Token2WavStream) -> Token2WavStream:
    """A second stream in exactly ``stream``'s state (voice, progress, vocoder cache)."""
    twin = t2w.open_stream(stream.prompt_token, stream.prompt_feat, stream.embedding)
    twin.chunks_done, twin.token_offset, twin.finished = stream.chunks_done, stream.token_offset, stream.finished
    for name in ("mel", "source", "speech"):
        getattr(twin.hift_cache, name).copy_(getattr(stream.hift_cache, name))
    twin.hift_cache.valid = stream.hift_cache.valid
    return twin


def _total(stream: Token2WavStream, plan: ChunkPlan) -> int:
    return stream.flow_end(plan)


# (prompt tokens, chunk index) of each stream, grouped by T = prompt + real tokens of that
# chunk (25-token flow chunks: T0 = P rounded up to 25, + 25; T1 = T0 + 50): groups of 1, 2,
# 3 (padded to 4), 5 (padded to 8) and 9 (8 + one alone)
GROUPS: dict[int, list[tuple[int, int]]] = {
    50: [(10, 0)],
    75: [(30, 0), (0, 1)],
    100: [(60, 0), (15, 1), (75, 0)],
    125: [(80, 0), (40, 1), (100, 0), (26, 1), (90, 0)],
    150: [(101, 0), (55, 1), (105, 0), (70, 1), (110, 0), (51, 1), (120, 0), (75, 1), (125, 0)],
}


@pytest.fixture(scope="module")
def cpu_t2w(one_torch_thread: None) -> FastToken2Wav:
    return FastToken2Wav(random_flow(TINY, "cpu"), random_hift(TINY, "cpu"))


@pytest.fixture
def grouped_t2w(cpu_t2w: FastToken2Wav) -> Iterator[FastToken2Wav]:
    """``cpu_t2w`` with grouped batching on (buckets 2, 4, 8) for one test, off again after."""
    cpu_t2w.use_batch_buckets((2, 4, 8))
    try:
        yield cpu_t2w
    finally:
        cpu_t2w.use_batch_buckets(())


def _mixed_chunks(t2w: FastToken2Wav) -> tuple[list[tuple[Token2WavStream, ChunkPlan, list[int]]], list[torch.Tensor]]:
    """One ready chunk per stream of GROUPS (streams advanced alone to their chunk), and each
    chunk's audio made by ``run_chunk`` on a twin stream in the same state (the reference)."""
    pairs: list[tuple[Token2WavStream, ChunkPlan, list[int]]] = []
    want: list[torch.Tensor] = []
    for total, members in GROUPS.items():
        for k, (n_prompt, index) in enumerate(members):
            stream = _open(t2w, n_prompt, seed=total + k)
            schedule = HopPolicy().schedule(n_prompt)
            tokens = random_speech(200, seed=1000 + total + k)
            for _ in range(index):  # earlier chunks, alone
                plan = schedule.ready(len(tokens), llm_finished=False)
                assert plan is not None
                stream.run_chunk(plan, tokens)
                schedule.commit(plan)
            plan = schedule.ready(len(tokens), llm_finished=False)
            assert plan is not None and plan.index == index and _total(stream, plan) == total
            want.append(_fork(t2w, stream).run_chunk(plan, tokens))
            pairs.append((stream, plan, tokens))
    return pairs, want


def test_grouped_batched_chunks_equal_run_chunk_on_cpu(
    grouped_t2w: FastToken2Wav, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixed prompt lengths and chunk positions, group sizes 1, 2, 3, 5, 9: one padded pass per
    group (split at bucket 8), the rest alone; every chunk's audio equals ``run_chunk``'s."""
    t2w = grouped_t2w
    pairs, want = _mixed_chunks(t2w)
    graph = t2w._graph_flow_batch
    assert graph is not None
    passes: list[tuple[int, int]] = []  # (rows, T) of each batched pass
    core = graph.fn

    def spy(ids: torch.Tensor, embedding: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        passes.append((int(ids.shape[0]), int(ids.shape[1]) - 3))
        return core(ids, embedding, cond)

    monkeypatch.setattr(graph, "fn", spy)
    got = t2w.run_chunks(pairs)
    assert sorted(passes) == [(2, 75), (4, 100), (8, 125), (8, 150)]
    errs = [float((a - b).abs().max()) for a, b in zip(got, want, strict=True)]
    print("grouped batched chunks vs run_chunk, max abs pcm:", f"{max(errs):.2g}")
    assert [len(a) for a in got] == [len(b) for b in want]
    assert max(errs) <= 1e-5
    assert all(stream.chunks_done == plan.index + 1 for stream, plan, _ in pairs)


def test_uncaptured_groups_run_eagerly(grouped_t2w: FastToken2Wav, monkeypatch: pytest.MonkeyPatch) -> None:
    """A (bucket, T) key not captured yet (as on CUDA mid-stream) is never captured by
    ``run_chunks``: chunks whose single-chunk graph replays (here: first chunks) leave the
    group, the rest run in one eager ``inference_batch`` per group; the audio is the same."""
    t2w = grouped_t2w  # requested before monkeypatch: the patches are undone before grouping is off
    pairs, want = _mixed_chunks(t2w)
    graph = t2w._graph_flow_batch
    assert graph is not None
    single = GraphedFn(lambda *a: t2w.flow.inference(*a, streaming=True, finalize=False), name="single")  # type: ignore[misc]
    monkeypatch.setattr(graph, "would_capture", lambda key, *args: True)
    monkeypatch.setattr(graph, "fn", lambda *a: pytest.fail("an uncaptured batched key ran"))
    monkeypatch.setattr(t2w, "_single_graph", lambda stream, plan, token: single if plan.index == 0 else None)
    rows: list[list[int]] = []
    real = t2w.flow.inference_batch  # type: ignore[attr-defined]

    def spy(items: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        rows.append([int(it[1].shape[1]) for it in items])  # each row's prompt length
        return real(items)

    monkeypatch.setattr(t2w.flow, "inference_batch", spy)
    got = t2w.run_chunks(pairs)
    # T = 125: the two second chunks (P 40, 26); T = 150: the four second chunks (P 55, 70, 51, 75)
    assert sorted(sorted(r) for r in rows) == [[26, 40], [51, 55, 70, 75]]
    assert max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)) <= 1e-5


def test_batch_keys_for_start_up_capture(grouped_t2w: FastToken2Wav) -> None:
    """75-token prompt, 500 tokens: non-final chunks end at T = 100, 150, 250 ... 550 (six
    lengths), each captured for buckets 2, 4, 8; a max batch of 3 needs buckets 2 and 4."""
    t2w = grouped_t2w
    plans = plan_all(500, 75)
    keys = t2w.batch_keys(plans, 75, 8)
    assert keys == [(False, b, t) for t in (100, 150, 250, 350, 450, 550) for b in (2, 4, 8)]
    assert t2w.batch_keys(plans, 75, 3) == [(False, b, t) for t in (100, 150, 250, 350, 450, 550) for b in (2, 4)]
    assert t2w.batch_keys(plans, 75, 1) == []
    # a fast first chunk (off a chunk boundary) is never batched: its T is not captured
    assert t2w.batch_keys(plan_all(100, 75, fast_first=10), 75, 2) == [(False, 2, 125)]  # the realigned second chunk
    t2w.use_batch_buckets(())
    assert t2w.batch_keys(plans, 75, 8) == []  # grouping off: nothing to capture
    with pytest.raises(ValueError, match="batch buckets"):
        t2w.use_batch_buckets((1, 2))


@pytest.mark.requires_cuda
@pytest.mark.parametrize(
    ("dtype", "lane"),
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "bf16", "fp32-first-lane"],
)
def test_graphed_batched_chunks_equal_eager(dtype: torch.dtype, lane: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams of captured and uncaptured prompt lengths joining at different rounds: the
    chunks of each round (graphed batched groups, eager groups, single graphs) equal the same
    rounds run eagerly (graphs disabled); float32 also equals each stream alone. With the
    first-chunk lane, the first chunks' keys (T = 75) are that lane's graphs, the rest not."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t2w = FastToken2Wav(random_flow(TINY, "cuda", dtype), random_hift(TINY, "cuda"))
    t2w.use_cuda_graphs(True, first_lane=lane)
    assert t2w.batch_buckets == (2, 4, 8) and t2w.has_first_lane == lane
    voice = _open(t2w, 50, seed=1, device="cuda")
    n = t2w.capture_stream_shapes(
        voice.prompt_token, voice.prompt_feat, voice.embedding, 190, stream_shapes(HopPolicy(), 50), max_batch=8
    )
    graph = t2w._graph_flow_batch
    assert graph is not None
    captured = set(cast("list[tuple[int, int]]", graph.captured_keys))
    if lane:
        first = t2w._first_lane
        assert first is not None and first.batch is not None
        assert set(first.batch.captured_keys) == {(b, 75) for b in (2, 4, 8)}
        assert set(first.flow.captured_keys) == {(50, 28)} and first.hift.captured_keys == [50]
        assert (50, 28) not in set(t2w._graph_flow.captured_keys)  # type: ignore[union-attr]
        captured |= {(b, 75) for b in (2, 4, 8)}
    assert captured == {(b, t) for t in (75, 125, 225) for b in (2, 4, 8)} and n > len(captured)
    # P 50 and 40 share T = 75, 125, 225 (captured); P 60's T = 100, 150, 250 are not
    prompts = [50, 50, 40, 50, 60, 40, 60, 50, 40, 50]
    starts = [0, 0, 0, 0, 0, 1, 0, 1, 2, 2]  # the two P 60 streams move in step
    replays: list[tuple[str, object]] = []
    call = GraphedFn.__call__

    def spy(self: GraphedFn, key: object, *args: torch.Tensor) -> object:
        replays.append((self.name, key))
        return call(self, key, *args)

    def rounds() -> list[list[torch.Tensor]]:
        streams = [_open(t2w, p, seed=20 + k, device="cuda") for k, p in enumerate(prompts)]
        schedules = [HopPolicy().schedule(p) for p in prompts]
        tokens = [random_speech(150 + 7 * k, seed=40 + k) for k in range(len(prompts))]
        out: list[list[torch.Tensor]] = [[] for _ in prompts]
        for rnd in range(50):
            ready = []
            for k in range(len(streams)):
                plan = schedules[k].ready(len(tokens[k]), llm_finished=True) if rnd >= starts[k] else None
                if plan is not None:
                    ready.append((k, plan))
            if not ready:
                break
            audio = t2w.run_chunks([(streams[k], plan, tokens[k]) for k, plan in ready])
            for (k, plan), pcm in zip(ready, audio, strict=True):
                out[k].append(pcm.clone())
                schedules[k].commit(plan)
        assert all(s.finished for s in streams)
        return out

    eager_rows: list[int] = []
    real = t2w.flow.inference_batch  # type: ignore[attr-defined]

    def eager_spy(items: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        eager_rows.extend(int(it[1].shape[1]) for it in items)
        return real(items)

    monkeypatch.setattr(GraphedFn, "__call__", spy)
    monkeypatch.setattr(t2w.flow, "inference_batch", eager_spy)
    got = rounds()
    monkeypatch.undo()
    batched = [
        cast("tuple[int, int]", key)
        for name, key in replays
        if name in ("flow.batch_chunks", "flow.batch_first_chunks")
    ]
    assert batched and set(batched) <= captured  # replayed, and nothing captured mid-stream
    assert set(graph.captured_keys) == {k for k in captured if not (lane and k[1] == 75)}
    if lane:  # every first chunk on the lane's graphs, and nothing else
        lane_batched = {key for name, key in replays if name == "flow.batch_first_chunks"}
        assert lane_batched and lane_batched == {key for key in batched if key[1] == 75}
        firsts = {cast("tuple[int, int]", key) for name, key in replays if name == "flow.first_chunk"}
        assert firsts and all(t == 25 + (-p % 25) + 3 for p, t in firsts)
        assert not firsts & {key for name, key in replays if name == "flow.rerun_chunk"}
    assert eager_rows and set(eager_rows) == {60}  # P 60's second chunks: uncaptured, eager batch
    with graphs_disabled():
        want = rounds()
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    err = 0.0
    for g, w in zip(got, want, strict=True):
        assert [len(c) for c in g] == [len(c) for c in w]
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b, atol=tol, rtol=0)
            err = max(err, float((a - b).abs().max()))
    print(f"{dtype}: graphed vs eager rounds, max abs pcm {err:.2g}")
    if dtype == torch.float32:
        err = 0.0
        with graphs_disabled():
            for k, p in enumerate(prompts):
                stream = _open(t2w, p, seed=20 + k, device="cuda")
                speech = random_speech(150 + 7 * k, seed=40 + k)
                alone = list(t2w.stream_all(stream, speech, chunk_plans(stream, speech)))
                for a, b in zip(got[k], alone, strict=True):
                    torch.testing.assert_close(a, b, atol=tol, rtol=0)
                    err = max(err, float((a - b).abs().max()))
        print(f"{dtype}: graphed rounds vs each stream alone, max abs pcm {err:.2g}")


def test_final_total_keys() -> None:
    """A final chunk's padded length: a whole flow chunk (25) up to FINAL_FINE_TOKENS, then a
    multiple of FINAL_COARSE_CHUNKS chunks (100)."""
    t2w = FastToken2Wav(random_flow(TINY, "cpu"), random_hift(TINY, "cpu"))
    assert CHUNK_TOKENS == 25 and FINAL_FINE_TOKENS == 500 and FINAL_COARSE_CHUNKS == 4
    got = {n: t2w.final_total(n) for n in (1, 25, 26, 476, 500, 501, 525, 526, 600, 601, 1650)}
    assert got == {
        1: 25,
        25: 25,
        26: 50,
        476: 500,
        500: 500,
        501: 600,
        525: 600,
        526: 600,
        600: 600,
        601: 700,
        1650: 1700,
    }


@pytest.mark.requires_cuda
def test_graphed_final_chunks_equal_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The final chunk (full attention) replays a start-up graph over tokens padded to the
    next multiple of 25 (masked), beyond 500 tokens of 100: utterances of any length within
    the captured range. Batched-chunk graphs only within ``batch_tokens``."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t2w = FastToken2Wav(random_flow(TINY, "cuda"), random_hift(TINY, "cuda"))
    wants = {n: _stream_all(t2w, 50, n, "cuda") for n in (20, 31, 77, 140, 480)}
    t2w.use_cuda_graphs(True)
    token, feat, emb = random_voice(50, "cuda")
    # the dummy stream runs 250 tokens (upstream's hops: chunks at 28, 78, 178 tokens); the
    # single-chunk graphs past them (278 .. 578 tokens) are captured directly, without warm-up
    monkeypatch.setattr(flow_step, "STREAM_CAPTURE_TOKENS", 250)
    t2w.capture_stream_shapes(token, feat, emb, 600, stream_shapes(HopPolicy(), 50), max_batch=2, batch_tokens=100)
    single = t2w._graph_flow
    assert single is not None and {(50, 278), (50, 378), (50, 478), (50, 578)} <= set(single.captured_keys)
    final, batched = t2w._graph_flow_final, t2w._graph_flow_batch
    assert final is not None and batched is not None
    assert sorted(final.captured_keys) == [*range(75, 501, 25), 600, 700]  # type: ignore[type-var]
    assert batched.captured_keys == [key[1:] for key in t2w.batch_keys(plan_all(100, 50), 50, 2)] == [(2, 75), (2, 125)]
    # the final vocoder too: every length a final chunk can have (fresh: shorter than the
    # first chunk, 1..27 tokens; after a cached chunk: 0..102 new tokens)
    fresh, cached = t2w._graph_hift, t2w._graph_hift_cached
    assert fresh is not None and cached is not None
    assert {2 * k for k in range(1, 28)} <= set(fresh.captured_keys)
    assert {t2w.cache_frames + 2 * k for k in range(103)} <= set(cached.captured_keys)
    eager_hift: list[int] = []
    forward = t2w.hift.forward

    def counting_forward(mel: torch.Tensor, *a: Any) -> tuple[torch.Tensor, torch.Tensor]:
        eager_hift.append(int(mel.shape[2]))
        return forward(mel, *a)

    t2w.hift.forward = counting_forward  # type: ignore[method-assign, assignment]
    replays: list[tuple[str, object]] = []
    call = GraphedFn.__call__

    def spy(self: GraphedFn, key: object, *args: torch.Tensor) -> object:
        replays.append((self.name, key))
        return call(self, key, *args)

    captured_single = set(single.captured_keys)
    monkeypatch.setattr(GraphedFn, "__call__", spy)
    eager_flow = t2w.flow.inference
    eager_calls: list[int] = []

    def counting_inference(token: torch.Tensor, *a: object, **k: object) -> torch.Tensor:
        eager_calls.append(int(token.shape[1]))
        return eager_flow(token, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(t2w.flow, "inference", counting_inference)
    for n, want in wants.items():
        got = _stream_all(t2w, 50, n, "cuda")
        assert [len(c) for c in got] == [len(c) for c in want]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=0)
    assert eager_hift == []  # every vocoder call, the final ones included, replayed a graph
    assert eager_calls == []  # every flow call too: 480 tokens' chunks and its final (530 -> 600)
    assert ("flow.final_chunk", 600) in replays and ("flow.rerun_chunk", (50, 378)) in replays
    assert set(single.captured_keys) == captured_single  # nothing captured mid-stream
