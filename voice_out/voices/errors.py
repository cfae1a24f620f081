"""Errors of prompt-audio handling and the voice store.

Every class carries a stable ``code`` (the protocol / HTTP error code) and a message that says
what is wrong and how to fix it. Unknown and missing voices use the engine's
:class:`~voice_out.engine.api.UnknownVoiceError` / :class:`~voice_out.engine.api.NoVoiceError`
so that a transport maps them the same way wherever they come from.
"""

from __future__ import annotations

from voice_out.errors import VoiceOutError


class VoiceError(VoiceOutError):
    """Base of voice and prompt-audio errors. ``code`` is stable; the message is for people."""

    code = "voice_error"


class InvalidVoiceNameError(VoiceError):
    code = "invalid_voice_name"


class VoiceExistsError(VoiceError):
    code = "voice_exists"


class EmptyTranscriptError(VoiceError):
    code = "transcript_empty"


class TranscriptTooLongError(VoiceError):
    code = "transcript_too_long"


class AudioError(VoiceError):
    """Base of errors about the prompt audio itself."""

    code = "audio_invalid"


class EmptyAudioError(AudioError):
    """No bytes, or a file that decodes to zero samples."""

    code = "audio_empty"


class CorruptAudioError(AudioError):
    """A known container or codec whose data cannot be decoded."""

    code = "audio_corrupt"


class UnsupportedAudioError(AudioError):
    """Not an audio format this build can read (or a file without an audio stream)."""

    code = "audio_unsupported"


class SampleRateTooLowError(AudioError):
    code = "audio_sample_rate_too_low"


class AudioTooShortError(AudioError):
    code = "audio_too_short"


class AudioTooLongError(AudioError):
    code = "audio_too_long"


class SilentAudioError(AudioError):
    code = "audio_silent"


class PromptModelUnavailableError(VoiceError):
    """The configured model has no prompt networks (e.g. ``random:*`` models)."""

    code = "prompt_model_unavailable"


class PromptModelError(VoiceError):
    """A prompt network file is missing or does not have the expected interface."""

    code = "prompt_model_invalid"


class VoiceStoreCorruptError(VoiceError):
    """A stored voice cannot be read back (edited or damaged files)."""

    code = "voice_corrupt"


class VoiceStoreWriteError(VoiceError):
    """The store directory could not be written (disk full, permissions, I/O error)."""

    code = "voice_store_write_failed"


class IncompatibleVoiceError(VoiceError):
    """The voice was extracted with other prompt networks than the loaded model's."""

    code = "voice_incompatible"
