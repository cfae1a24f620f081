"""Voice name -> :class:`~voice_out.engine.request.VoicePrompt`: the engine's view of voices.

Token ids for the scheduler (prompt transcript, prompt speech tokens) and the runner's
token2wav conditioning, from the voice store or the built-in voices of random models.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

from voice_out.engine.api import BadOptionError, NoVoiceError, UnknownVoiceError
from voice_out.engine.request import FlowVoice, VoicePrompt

#: Ends CosyVoice2's instruction (spec 2.4, 6.8); one special token of the tokenizer.
END_OF_PROMPT = "<|endofprompt|>"
#: Characters of an instruction: every one is LLM prompt, KV-cache rows held for the stream.
MAX_INSTRUCTION_CHARS = 500

ADD_VOICE_HINT = 'add one with `voice-out voices add NAME prompt.wav "what is said in it"`'
#: How to get past ``no_voice``: name a voice, or give the server a default one.
NO_VOICE_HINT = (
    'name one ("voice" on an utterance\'s first text.delta, or open_stream(voice=...)) or set a default: '
    "`voice-out serve --voice NAME`, or server.default_voice in the config file "
    "(VOICE_OUT_SERVER_DEFAULT_VOICE=NAME)"
)


class VoiceBook:
    """Voice name -> :class:`VoicePrompt` (token ids for the scheduler, tensors for the runner).

    Looks in the voice store, then in the built-in voices (``noise`` for random models).
    ``default``: the voice used when none is named. Any thread.
    """

    def __init__(
        self,
        store: Any | None,
        encode: Callable[[str], list[int]],
        *,
        builtin: Mapping[str, VoicePrompt] | None = None,
        default: str | None = None,
    ) -> None:
        self.store = store
        self.encode = encode
        self.builtin = dict(builtin or {})
        self.default = default
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[object, VoicePrompt]] = {}

    def names(self) -> list[str]:
        stored = list(self.store.names()) if self.store is not None else []
        return sorted(set(stored) | set(self.builtin))

    def resolve(self, name: str | None) -> VoicePrompt:
        chosen = name if name is not None else self.default
        if chosen is None:
            known = ", ".join(self.names())
            fix = (
                f"(voices here: {known}) {NO_VOICE_HINT}; or {ADD_VOICE_HINT}"
                if known
                else f"{ADD_VOICE_HINT}, then {NO_VOICE_HINT}"
            )
            raise NoVoiceError(f"no voice was named and no default voice is configured: {fix}")
        if chosen in self.builtin and (self.store is None or chosen not in self.store):
            return self.builtin[chosen]
        if self.store is None:
            known = ", ".join(self.names()) or "none"
            raise UnknownVoiceError(f"unknown voice {chosen!r} (known: {known}); {ADD_VOICE_HINT}")
        voice = self.store.get(chosen)  # raises UnknownVoiceError with the store's own hint
        with self._lock:
            hit = self._cache.get(chosen)
            if hit is not None and hit[0] is voice:
                return hit[1]
        prompt = self._from_store_voice(voice)
        with self._lock:
            self._cache[chosen] = (voice, prompt)
        return prompt

    def _from_store_voice(self, voice: Any) -> VoicePrompt:
        flow_tokens = voice.flow_prompt_tokens
        return VoicePrompt(
            name=voice.name,
            prompt_text_ids=tuple(self.encode(voice.prompt_text)),
            prompt_speech_ids=tuple(int(t) for t in voice.llm_prompt_tokens.tolist()),
            flow_prompt_tokens=int(flow_tokens.shape[0]),
            flow=FlowVoice(flow_tokens, voice.prompt_mel, voice.embedding),
        )


def instruct_prompt(voice: VoicePrompt, instructions: str, encode: Callable[[str], list[int]]) -> VoicePrompt:
    """``voice`` in CosyVoice2's instruct mode (``inference_instruct2``; spec 2.4, 6.8): the
    instruction, NOT normalized, ending in ``<|endofprompt|>`` (appended unless it is there),
    tokenized, takes the place of the prompt transcript, and the LLM gets no prompt speech;
    the flow keeps the voice's prompt tokens, mel and x-vector (the timbre). The bistream
    feed then starts ``[SOS, instruction + text interleaved 5 : 15 with speech, ...,
    TASK_ID]``; the whole-text layout is ``voice_out.text.rows.instruct_rows``. Raises
    :class:`BadOptionError` for an empty or too long instruction. Any thread."""
    text = instructions.strip()
    if not text or text == END_OF_PROMPT:
        raise BadOptionError("instructions must not be empty")
    if len(text) > MAX_INSTRUCTION_CHARS:
        raise BadOptionError(f"instructions are {len(text)} characters; at most {MAX_INSTRUCTION_CHARS}")
    if not text.endswith(END_OF_PROMPT):
        text += END_OF_PROMPT
    return dataclasses.replace(voice, prompt_text_ids=tuple(encode(text)), prompt_speech_ids=())
