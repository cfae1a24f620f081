"""LLM parity against the reference cases of the parity directory (VOICE_OUT_PARITY_DIR).

* teacher-forced cases (``a*_llm_*``): input assembly, prefill, KV-cache decoding with forced
  tokens; hidden state and 6564-way log-probs at every step; cache length before every step.
* bistream traces (``b*_bistream_*``): the feed schedule of ``voice_out.text.bistream`` in
  upstream mode drives the model; fed rows, step modes (forced FILL where ``how == 1``), cache
  lengths, chunk pulls, emitted tokens, hidden states and log-prob statistics must match.

Every dimension comes from the parity directory. Float tolerance: max abs 1e-4 (parity README).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import parity_dir_path
from voice_out.model.checkpoint import load_llm
from voice_out.model.llm import KVCache, SpeechLM
from voice_out.text import bistream as bs
from voice_out.text import rows as llm_rows

TOL = 1e-4
TEACHER_FORCED = re.compile(r"^a\d*_llm_.*\.pt$")
BISTREAM = re.compile(r"^b\d+_bistream_.*\.pt$")


def _case_files(pattern: re.Pattern[str]) -> list[str]:
    cases = parity_dir_path() / "cases"
    names = sorted(p.name for p in cases.glob("*.pt") if pattern.match(p.name)) if cases.is_dir() else []
    return names or ["<none>"]


def _load_case(cases_dir: Path, name: str) -> dict[str, Any]:
    if name == "<none>":
        pytest.fail(f"no matching LLM case in {cases_dir}")
    case = torch.load(cases_dir / name, weights_only=True)
    assert isinstance(case, dict)
    return case


def _ids(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max().item()) if a.numel() else 0.0


@pytest.fixture(scope="module")
def lm(parity_dir: Path) -> SpeechLM:
    return load_llm(parity_dir, "cpu", torch.float32)


@pytest.mark.parametrize("name", _case_files(TEACHER_FORCED))
def test_teacher_forced(lm: SpeechLM, cases_dir: Path, name: str) -> None:
    case = _load_case(cases_dir, name)
    prompt_text, text = _ids(case["prompt_text"]), _ids(case["text"])
    prompt_speech = _ids(case["prompt_speech_token"])

    rows = llm_rows.zero_shot_rows(prompt_text, text, prompt_speech)
    assert len(rows) == case["lm_input_len"]
    assert rows == [tuple(r) for r in case["lm_input_ids"].tolist()]
    embeds = lm.embed_rows(rows)
    assert torch.equal(embeds, case["lm_input"][0]), "assembled lm_input differs"

    min_len, max_len = llm_rows.length_limits(len(text))
    assert (min_len, max_len) == (case["min_len"], case["max_len"])
    n_steps = case["hidden"].shape[0]
    assert case["eos_masked_at_step"].tolist() == [i < min_len for i in range(n_steps)]

    # Use a middle slot of a cache whose other slots hold junk: slots must not leak.
    cache = KVCache.allocate(lm.dims, n_slots=3, max_len=len(rows) + n_steps + 4)
    cache.k.normal_()
    cache.v.normal_()
    cache.lengths.fill_(5)
    cache.reset(1)
    slot = torch.tensor([1])
    forced = _ids(case["forced_tokens"])
    # The whole-text request schedule drives the steps (feeds, EOS masking, stop).
    state = bs.new_whole_text_state(tuple(rows), min_len, max_len, lm.dims.speech_token_size)
    emitted: list[int] = []
    finished: list[bs.Finished] = []
    err_hidden = err_logp = 0.0
    for i in range(n_steps):
        step = state.step
        assert step is not None, f"{name}: schedule stopped before step {i}"
        assert (step.mode is bs.StepMode.SAMPLE) == bool(case["eos_masked_at_step"][i])
        assert int(cache.lengths[1]) == int(case["cache_len_before_step"][i]) == state.cache_len, f"step {i}"
        if i == 0:
            assert list(step.feed) == rows
            hidden = lm.prefill(cache, 1, embeds)
        else:
            assert step.feed == ((llm_rows.RowKind.SPEECH, forced[i - 1]),)
            hidden = lm.decode_step(cache, slot, lm.embed_rows(step.feed))[0]
        err_hidden = max(err_hidden, _maxdiff(hidden, case["hidden"][i]))
        err_logp = max(err_logp, _maxdiff(lm.logprobs(hidden), case["logp"][i]))
        token = forced[i] if i < len(forced) else lm.dims.eos_token
        for action in bs.process(state, bs.StepDone(token)):
            if isinstance(action, bs.Emit):
                emitted.append(action.token)
            elif isinstance(action, bs.Finished):
                finished.append(action)
    assert emitted == forced and finished == [bs.Finished(bs.FinishReason.EOS)]
    print(f"\n{name}: max |hidden diff| {err_hidden:.2e}, max |logp diff| {err_logp:.2e} over {n_steps} steps")
    assert err_hidden < TOL and err_logp < TOL, f"{name}: hidden {err_hidden:.2e}, logp {err_logp:.2e}"


def test_teacher_forced_cases_batched(lm: SpeechLM, cases_dir: Path) -> None:
    """All teacher-forced cases decoded together: one decode_step call per step for every case."""
    names = [n for n in _case_files(TEACHER_FORCED) if n != "<none>"]
    if len(names) < 2:
        pytest.skip("needs two teacher-forced cases")
    cases = [_load_case(cases_dir, n) for n in names]
    steps = min(c["hidden"].shape[0] for c in cases)
    max_len = max(int(c["lm_input_len"]) for c in cases) + steps + 1
    cache = KVCache.allocate(lm.dims, n_slots=len(cases), max_len=max_len)
    for s, c in enumerate(cases):
        lm.prefill(cache, s, c["lm_input"][0])
    slots = torch.arange(len(cases))
    err = 0.0
    for i in range(1, steps):
        tokens = torch.tensor([int(c["forced_tokens"][i - 1]) for c in cases])
        hidden = lm.decode_step(cache, slots, lm.embed_speech(tokens))
        logp = lm.logprobs(hidden)
        for s, c in enumerate(cases):
            err = max(err, _maxdiff(hidden[s], c["hidden"][i]), _maxdiff(logp[s], c["logp"][i]))
    print(f"\nbatched teacher forcing of {len(cases)} cases: max abs diff {err:.2e}")
    assert err < TOL, f"batched decode differs by {err:.2e}"


def _run_bistream(lm: SpeechLM, case: dict[str, Any], name: str) -> dict[str, float]:
    cfg = bs.BistreamConfig.upstream(speech_token_size=lm.dims.speech_token_size)
    state = bs.new_state(cfg, tuple(_ids(case["prompt_text"])), tuple(_ids(case["prompt_speech_token"])))
    chunks = [tuple(_ids(c)) for c in case["text_chunks"]]
    delivered_at = _ids(case["chunk_delivered_before_step"])
    n_steps = int(case["num_steps"])
    fed_ids = [tuple(r) for r in case["fed_ids"].tolist()]
    cache = KVCache.allocate(lm.dims, n_slots=2, max_len=len(fed_ids) + 2)
    slot = 1
    errs = dict.fromkeys(("hidden", "topk", "token", "eos", "fill", "logsumexp", "full"), 0.0)
    emitted: list[int] = []
    next_chunk = 0
    offset = 0
    queue: list[bs.Action] = []
    finished: bs.Finished | None = None

    def deliver() -> list[bs.Action]:
        nonlocal next_chunk
        if next_chunk < len(chunks):
            assert state.steps == delivered_at[next_chunk], f"{name}: chunk {next_chunk} pulled at a wrong step"
            next_chunk += 1
            return bs.process(state, bs.TextReceived(chunks[next_chunk - 1]))
        return bs.process(state, bs.TextEnded())

    queue = deliver()
    while finished is None:
        if not queue:
            queue = deliver()
            continue
        action = queue.pop(0)
        if isinstance(action, bs.WaitForText):
            assert not queue
            continue
        if isinstance(action, bs.Emit):
            emitted.append(action.token)
            continue
        if isinstance(action, bs.Finished):
            finished = action
            continue
        s = state.steps
        assert s < n_steps, f"{name}: more steps than recorded"
        n_fed = int(case["fed_count"][s])
        assert list(action.feed) == fed_ids[offset : offset + n_fed], f"{name}: fed rows differ at step {s}"
        offset += n_fed
        assert int(action.mode) == int(case["how"][s]), f"{name}: step {s} mode {action.mode!r}"
        assert int(cache.lengths[slot]) == int(case["cache_len_before_step"][s]) == state.cache_len
        embeds = lm.embed_rows(action.feed)
        if len(action.feed) == 1:
            hidden = lm.decode_step(cache, torch.tensor([slot]), embeds)[0]
        else:
            hidden = lm.prefill(cache, slot, embeds)
        logits = lm.logits(hidden)
        logp = torch.log_softmax(logits, dim=-1)
        token = int(case["token"][s])
        errs["hidden"] = max(errs["hidden"], _maxdiff(hidden, case["hidden"][s]))
        errs["topk"] = max(errs["topk"], _maxdiff(logp[case["logp_topk_ids"][s]], case["logp_topk_values"][s]))
        errs["token"] = max(errs["token"], _maxdiff(logp[token], case["logp_token"][s]))
        errs["eos"] = max(errs["eos"], _maxdiff(logp[cfg.eos_token], case["logp_eos"][s]))
        errs["fill"] = max(errs["fill"], _maxdiff(logp[cfg.fill_token], case["logp_fill"][s]))
        errs["logsumexp"] = max(errs["logsumexp"], _maxdiff(torch.logsumexp(logits, -1), case["logsumexp_logits"][s]))
        if s == 0:
            errs["full"] = max(errs["full"], _maxdiff(logp, case["logp_full_first_step"]))
        if s == n_steps - 1:
            errs["full"] = max(errs["full"], _maxdiff(logp, case["logp_full_last_step"]))
        queue += bs.process(state, bs.StepDone(token))
    assert finished.reason is bs.FinishReason.EOS
    assert state.steps == n_steps and offset == len(fed_ids)
    assert next_chunk == len(chunks)
    assert emitted == _ids(case["yielded"])
    return errs


@pytest.mark.parametrize("name", _case_files(BISTREAM))
def test_bistream_trace(lm: SpeechLM, cases_dir: Path, name: str) -> None:
    case = _load_case(cases_dir, name)
    errs = _run_bistream(lm, case, name)
    worst = max(errs.values())
    print(f"\n{name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    assert worst < TOL, f"{name}: max abs diffs " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())


@pytest.mark.parametrize("name", _case_files(BISTREAM))
def test_bistream_schedule_with_all_text_queued(cases_dir: Path, name: str) -> None:
    """Text queued before the first step is pulled lazily: the same feeds, modes and pull points."""
    case = _load_case(cases_dir, name)
    cfg = bs.BistreamConfig.upstream()
    state = bs.new_state(cfg, tuple(_ids(case["prompt_text"])), tuple(_ids(case["prompt_speech_token"])))
    actions: list[bs.Action] = []
    for chunk in case["text_chunks"]:
        actions += bs.process(state, bs.TextReceived(tuple(_ids(chunk))))
    actions += bs.process(state, bs.TextEnded())
    feeds: list[tuple[int, int]] = []
    pulled_before_step: list[int] = []
    step = 0
    while True:
        steps = [a for a in actions if isinstance(a, bs.Step)]
        if not steps:
            break
        pulled_before_step.append(state.chunks_pulled)
        assert len(steps) == 1 and int(steps[0].mode) == int(case["how"][step])
        feeds += steps[0].feed
        actions = bs.process(state, bs.StepDone(int(case["token"][step])))
        step += 1
    assert step == int(case["num_steps"])
    assert feeds == [tuple(r) for r in case["fed_ids"].tolist()]
    delivered = _ids(case["chunk_delivered_before_step"])
    for k, s in enumerate(delivered):  # chunk k was pulled before step s, not earlier
        assert pulled_before_step[s] >= k + 1
        assert s == 0 or pulled_before_step[s - 1] <= k


def test_cross_lingual_and_instruct_assembly(cases_dir: Path) -> None:
    # a2 is the cross-lingual layout: no prompt transcript, no prompt speech
    case = _load_case(cases_dir, "a2_llm_teacher_forced_no_prompt.pt")
    text = _ids(case["text"])
    assert llm_rows.cross_lingual_rows(text) == [tuple(r) for r in case["lm_input_ids"].tolist()]
    # instruct: the instruct text takes the transcript's place and no prompt speech follows
    rows = llm_rows.instruct_rows([7, 8, 9], text)
    assert rows[:4] == [
        llm_rows.SOS,
        (llm_rows.RowKind.TEXT, 7),
        (llm_rows.RowKind.TEXT, 8),
        (llm_rows.RowKind.TEXT, 9),
    ]
    assert rows[-1] == llm_rows.TASK_ID and len(rows) == 1 + 3 + len(text) + 1
