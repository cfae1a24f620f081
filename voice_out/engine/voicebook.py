"""Voice name -> :class:`~voice_out.engine.request.VoicePrompt`: the engine's view of voices.

Token ids for the scheduler (prompt transcript, prompt speech tokens) and the runner's
token2wav conditioning, from the voice store or the built-in voices of random models.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from voice_out.engine.api import NoVoiceError, UnknownVoiceError
from voice_out.engine.request import VoicePrompt

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
            fix = f"voices here: {known}; {NO_VOICE_HINT}" if known else f"{ADD_VOICE_HINT}, then {NO_VOICE_HINT}"
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
        from voice_out.engine.runner import FlowVoice

        flow_tokens = voice.flow_prompt_tokens
        return VoicePrompt(
            name=voice.name,
            prompt_text_ids=tuple(self.encode(voice.prompt_text)),
            prompt_speech_ids=tuple(int(t) for t in voice.llm_prompt_tokens.tolist()),
            flow_prompt_tokens=int(flow_tokens.shape[0]),
            flow=FlowVoice(flow_tokens, voice.prompt_mel, voice.embedding),
        )
