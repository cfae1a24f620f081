"""``Flow.inference_batch``: several streams' non-final chunks in one right-padded pass.

Same small random flow as tests/test_flow_streaming.py (5-token encoder chunk), so short
sequences cross many chunk boundaries. What is proven:

* every row of a batch mixing prompt lengths (none, short, long, chunk-aligned), token lengths
  and voices equals its own ``inference(..., streaming=True, finalize=False)`` within 1e-5 in
  float32, and a batch of one equals it bit for bit;
* it really is ONE pass: one encoder call over B padded rows, 10 estimator calls over 2B rows;
* a row does not depend on its neighbours (it is the same next to short or long rows);
* the same with an estimator chunk of two encoder chunks, and in bfloat16 (sanity bound);
* calls that are not batchable (not on a chunk boundary, no look-ahead) raise.

``Token2Wav.run_chunks`` (tiny random flow + HiFT, 25-token chunks): streams at different
chunks, with different prompts, run together round by round, give the audio each gives alone
(within 1e-5), with their re-run non-final chunks really batched and the rest (the later chunks
of a stream on a flow state, fast first chunk, final chunks) run as ``run_chunk``; a bad pair
fails before any stream moves; a chunk failing after the flow pass fails alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from tests.conftest import REPO_ROOT, chunk_plans, random_speech, random_voice
from tests.test_flow_streaming import inputs, make_flow, tiny_dims
from voice_out.engine.chunk_schedule import ChunkPlan, ChunkSchedule, HopPolicy
from voice_out.fast.flow_step import FastToken2Wav
from voice_out.model.checkpoint import random_flow, random_hift
from voice_out.model.flow import Flow
from voice_out.model.token2wav import ChunkBatchError, Token2Wav, Token2WavStream

TOL = 1e-5  # fp32: the batched pass differs from the single one only by matmul blocking

Item = tuple[Tensor, Tensor, Tensor, Tensor]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def flow() -> Flow:
    return make_flow(tiny_dims())


def item(flow: Flow, n_prompt: int, n_real: int, seed: int) -> Item:
    """A non-final call: ``n_real`` generated tokens (prompt + n_real on a chunk boundary) + 3
    look-ahead tokens, in the voice drawn from ``seed``."""
    assert flow.dims.chunk_aligned(n_prompt + n_real)
    return inputs(flow, n_prompt, n_real + flow.dims.pre_lookahead, seed=seed)


def single(flow: Flow, it: Item) -> Tensor:
    return flow.inference(*it, streaming=True, finalize=False)


def max_err(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
    return float((a - b).abs().max())


# (prompt tokens, generated tokens before the look-ahead): prompt + generated on a boundary
MIXED = [(0, 5), (2, 13), (13, 7), (20, 25), (24, 1), (7, 38), (13, 2)]


def test_every_row_equals_its_single_call(flow: Flow) -> None:
    items = [item(flow, p, n, seed=10 + k) for k, (p, n) in enumerate(MIXED)]
    with torch.no_grad():
        got = flow.inference_batch(items)
        want = [single(flow, it) for it in items]
    errs = [max_err(g, w) for g, w in zip(got, want, strict=True)]
    print("batched vs single, max abs per row:", ", ".join(f"{e:.2g}" for e in errs))
    assert max(errs) <= TOL
    ratio = flow.dims.token_mel_ratio
    assert [g.shape[2] for g in got] == [ratio * n for _, n in MIXED]
    # the rows are different streams (different voices and tokens): nothing trivially equal
    assert float((want[2][:, :, :4] - want[6]).abs().max()) > 1e-2


def test_a_batch_of_one_is_the_single_call_bit_for_bit(flow: Flow) -> None:
    it = item(flow, 13, 12, seed=3)
    with torch.no_grad():
        (got,) = flow.inference_batch([it])
        assert torch.equal(got, single(flow, it))
        assert flow.inference_batch([]) == []


def test_one_pass_over_padded_rows(flow: Flow) -> None:
    items = [item(flow, p, n, seed=20 + k) for k, (p, n) in enumerate(MIXED[:4])]
    longest = max(p + n for p, n in MIXED[:4])
    seen: list[tuple[str, tuple[int, ...]]] = []
    hooks = [
        flow.encoder.register_forward_hook(lambda m, a, o: seen.append(("encoder", tuple(a[0].shape[:2])))),
        flow.estimator.register_forward_hook(lambda m, a, o: seen.append(("estimator", tuple(a[0].shape[::2])))),
    ]
    try:
        with torch.no_grad():
            flow.inference_batch(items)
    finally:
        for h in hooks:
            h.remove()
    ratio, steps = flow.dims.token_mel_ratio, flow.dims.n_timesteps
    assert seen == [("encoder", (4, longest))] + [("estimator", (8, ratio * longest))] * steps


def test_a_row_does_not_depend_on_its_neighbours(flow: Flow) -> None:
    it = item(flow, 13, 12, seed=4)
    with torch.no_grad():
        alone = single(flow, it)
        short = flow.inference_batch([it, item(flow, 0, 5, seed=5)])[0]
        long = flow.inference_batch([item(flow, 24, 56, seed=6), it, item(flow, 2, 3, seed=7)])[1]
        same = flow.inference_batch([it, it])
    assert max_err(short, alone) <= TOL and max_err(long, alone) <= TOL
    assert torch.equal(same[0], same[1])  # identical rows stay identical


def test_other_chunk_geometry_and_bfloat16() -> None:
    """Estimator chunk = 2 x the upsampled encoder chunk (boundaries every 10 tokens)."""
    flow = make_flow(tiny_dims(enc_chunk=5, est_chunk=20), seed=9)
    shapes = [(7, 3), (0, 20), (13, 27), (5, 5)]
    items = [item(flow, p, n, seed=30 + k) for k, (p, n) in enumerate(shapes)]
    with torch.no_grad():
        want = [single(flow, it) for it in items]
        got = flow.inference_batch(items)
        assert max(max_err(g, w) for g, w in zip(got, want, strict=True)) <= TOL
        low = flow.to(torch.bfloat16)
        low_single = [single(low, it) for it in items]
        low_batch = low.inference_batch(items)
    err = max(max_err(g, w) for g, w in zip(low_batch, low_single, strict=True))
    drift = max(max_err(g, w) for g, w in zip(low_single, want, strict=True))
    print(f"bfloat16 batched vs bfloat16 single: {err:.3g}; bfloat16 single vs float32: {drift:.3g}")
    assert err <= max(drift, 1e-3)  # batching costs no more than bfloat16 itself


def test_calls_that_cannot_be_batched_raise(flow: Flow) -> None:
    good = item(flow, 13, 12, seed=8)
    off_boundary = inputs(flow, 13, 11 + 3, seed=8)  # 13 + 11 = 24: not a chunk boundary
    with torch.no_grad(), pytest.raises(ValueError, match="chunk boundary"):
        flow.inference_batch([good, off_boundary])
    token, prompt_token, prompt_feat, embedding = inputs(flow, 5, 2, seed=8)
    with torch.no_grad(), pytest.raises(ValueError, match="look-ahead"):
        flow.inference_batch([good, (token, prompt_token, prompt_feat, embedding)])
    with torch.no_grad(), pytest.raises(ValueError, match="prompt_feat"):
        flow.inference_batch([good, (token, prompt_token, prompt_feat[:, 1:], embedding)])


# --------------------------------------------------------------------------------------------
# Token2Wav.run_chunks: the flow of several streams' chunks in one call, the rest as run_chunk


TINY = REPO_ROOT / "configs" / "models" / "tiny"


@pytest.fixture(scope="module")
def t2w() -> FastToken2Wav:
    """Eager (no graphs, no batch buckets), with one flow state for a stream of STREAMS."""
    t2w = FastToken2Wav(random_flow(TINY, "cpu"), random_hift(TINY, "cpu"))
    t2w.use_state_slots(1, 37 + 95)
    return t2w


class BatchSpy:
    """Records the rows of every ``inference_batch`` call of a flow (and still runs it)."""

    def __init__(self, t2w: Token2Wav, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[list[int]] = []  # per call: each row's token count
        self.prompts: list[list[Tensor]] = []  # per call: each row's prompt_token (the stream's own)
        flow = t2w.flow
        real = flow.inference_batch  # type: ignore[attr-defined]

        def spy(items: list[Item]) -> list[Tensor]:
            self.rows.append([int(it[0].shape[1]) for it in items])
            self.prompts.append([it[1] for it in items])
            return real(items)

        monkeypatch.setattr(flow, "inference_batch", spy)

    def batched(self, stream: Token2WavStream) -> list[int]:
        """Token counts of the rows that came from ``stream``."""
        out = []
        for rows, prompts in zip(self.rows, self.prompts, strict=True):
            out += [n for n, p in zip(rows, prompts, strict=True) if p is stream.prompt_token]
        return out


def open_stream(t2w: Token2Wav, n_prompt: int, seed: int, **kw: Any) -> Token2WavStream:
    token, feat, emb = random_voice(n_prompt, seed=seed)
    if not kw.get("state"):  # fast_first is the schedule's (schedule_of)
        return t2w.open_stream(token, feat, emb)
    stream = t2w.open_stream(token, feat, emb, first_prefix=t2w.prepare_prefix(token, feat, emb))
    assert stream.state_slot is not None  # its later chunks extend a flow state of its own
    return stream


def schedule_of(n_prompt: int, **kw: Any) -> ChunkSchedule:
    """The engine's schedule of a stream opened with ``kw`` (its ``fast_first``)."""
    return HopPolicy().schedule(n_prompt, kw.get("fast_first", 0))


# (prompt tokens, speech tokens, stream options): prompts with a pad, none, aligned, long
STREAMS: list[tuple[int, int, dict[str, Any]]] = [
    (10, 120, {}),
    (37, 90, {}),
    (25, 140, {}),
    (0, 60, {}),
    (37, 95, {"state": True}),  # its later chunks not batched: they extend its flow state
    (10, 70, {"fast_first": 8}),  # its first chunk is not batched (off a boundary)
]


def run_together(t2w: Token2Wav, starts: list[int]) -> tuple[list[list[Tensor]], list[Token2WavStream]]:
    """Stream k joins at round ``starts[k]``; each round runs every ready chunk in one call."""
    streams = [open_stream(t2w, p, 40 + k, **kw) for k, (p, _, kw) in enumerate(STREAMS)]
    schedules = [schedule_of(p, **kw) for p, _, kw in STREAMS]
    tokens = [random_speech(n, 60 + k) for k, (_, n, _) in enumerate(STREAMS)]
    out: list[list[Tensor]] = [[] for _ in STREAMS]
    for rnd in range(100):
        ready = []
        for k in range(len(streams)):
            plan = schedules[k].ready(len(tokens[k]), llm_finished=True) if rnd >= starts[k] else None
            if plan is not None:
                ready.append((k, plan))
        if not ready and all(s.finished for s in streams):
            break
        audio = t2w.run_chunks([(streams[k], plan, tokens[k]) for k, plan in ready])
        for (k, plan), pcm in zip(ready, audio, strict=True):
            out[k].append(pcm.clone())
            schedules[k].commit(plan)
    return out, streams


def run_alone(t2w: Token2Wav) -> list[list[Tensor]]:
    out = []
    for k, (p, n, kw) in enumerate(STREAMS):
        stream = open_stream(t2w, p, 40 + k, **kw)
        speech = random_speech(n, 60 + k)
        plans = chunk_plans(stream, speech, fast_first=kw.get("fast_first", 0))
        out.append([c.clone() for c in t2w.stream_all(stream, speech, plans)])
    return out


def test_run_chunks_equals_each_stream_alone(t2w: Token2Wav, monkeypatch: pytest.MonkeyPatch) -> None:
    alone = run_alone(t2w)
    spy = BatchSpy(t2w, monkeypatch)
    together, streams = run_together(t2w, starts=[0, 0, 1, 2, 0, 1])
    errs = []
    for k, (got, want) in enumerate(zip(together, alone, strict=True)):
        assert [len(c) for c in got] == [len(c) for c in want], k
        assert streams[k].finished and sum(len(c) for c in got) == 960 * STREAMS[k][1]
        errs.append(max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)))
    print("run_chunks vs alone, max abs pcm per stream:", ", ".join(f"{e:.2g}" for e in errs))
    assert max(errs) <= TOL
    # batching really happened, over rows of different lengths (streams at different chunks)
    assert max(len(r) for r in spy.rows) >= 3
    assert any(len(set(r)) > 1 for r in spy.rows)
    # ... and only for batchable chunks: non-final re-run chunks, not the fast first chunk
    for k, stream in enumerate(streams):
        rows = spy.batched(stream)
        allowed = [p.token_len for p in stream.chunk_log if not p.finalize and not (k == 5 and p.index == 0)]
        assert len(set(rows)) == len(rows) and set(rows) <= set(allowed), k
        if k == 4:  # on a flow state: at most its first chunk (a re-run) was batched, never a later one
            assert set(rows) <= {stream.chunk_log[0].token_len}, k
        else:
            assert rows, k  # every re-run stream was batched


def test_one_batchable_chunk_runs_alone_bit_for_bit(t2w: Token2Wav, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = BatchSpy(t2w, monkeypatch)
    a, b = open_stream(t2w, 10, 1), open_stream(t2w, 10, 1)
    tokens = random_speech(60, 2)
    plan = schedule_of(10).ready(len(tokens), False)
    assert plan is not None and t2w.batchable(a, plan)
    (got,) = t2w.run_chunks([(a, plan, tokens)])
    assert spy.rows == [] and torch.equal(got, b.run_chunk(plan, tokens))


def test_a_bad_pair_fails_before_any_stream_moves(t2w: Token2Wav) -> None:
    a, b = open_stream(t2w, 10, 3), open_stream(t2w, 37, 4)
    tokens = random_speech(60, 5)
    pa, pb = schedule_of(10).ready(60, False), schedule_of(37).ready(60, False)
    assert pa is not None and pb is not None
    with pytest.raises(ValueError, match="needs"):
        t2w.run_chunks([(a, pa, tokens), (b, pb, tokens[:20])])
    with pytest.raises(ValueError, match="twice"):
        t2w.run_chunks([(a, pa, tokens), (a, pa, tokens)])
    assert a.chunks_done == b.chunks_done == 0 and not a.hift_cache.valid
    assert len(t2w.run_chunks([(a, pa, tokens), (b, pb, tokens)])) == 2  # both can still run


def test_a_chunk_failing_after_the_flow_pass_fails_alone(t2w: Token2Wav, monkeypatch: pytest.MonkeyPatch) -> None:
    streams = [open_stream(t2w, p, 7 + k) for k, p in enumerate([10, 37, 0])]
    refs = [open_stream(t2w, p, 7 + k) for k, p in enumerate([10, 37, 0])]
    tokens = random_speech(80, 6)
    plans = [schedule_of(p).ready(80, False) for p in [10, 37, 0]]
    finish = t2w._finish_chunk

    def flaky(stream: Token2WavStream, plan: ChunkPlan, mel: Tensor) -> Tensor:
        if stream is streams[1]:
            raise RuntimeError("vocoder down (injected)")
        return finish(stream, plan, mel)

    monkeypatch.setattr(t2w, "_finish_chunk", flaky)
    with pytest.raises(ChunkBatchError) as info:
        t2w.run_chunks([(s, p, tokens) for s, p in zip(streams, plans, strict=True) if p is not None])
    monkeypatch.undo()
    err = info.value
    assert list(err.errors) == [1] and "injected" in str(err.errors[1]) and err.results[1] is None
    for k in (0, 2):
        plan = plans[k]
        assert plan is not None
        want = refs[k].run_chunk(plan, tokens)
        got = err.results[k]
        assert got is not None and float((got - want).abs().max()) <= TOL
        assert streams[k].chunks_done == 1
    assert streams[1].chunks_done == 0
