"""Prompt audio and the voice store.

* ``audio``: decode any common format to float32 mono; the reference sinc resampler.
* ``features``: Whisper log-mel, Kaldi fbank, the 24 kHz prompt mel, token/mel alignment.
* ``onnx``: runners for ``speech_tokenizer_v2.onnx`` and ``campplus.onnx``.
* ``prompt``: ``PromptExtractor`` / ``extract_prompt``: audio -> ``ExtractedPrompt``.
* ``store``: ``VoiceStore``, the persistent named voices (``Voice``, ``VoiceInfo``).
* ``errors``: ``VoiceError`` and its subclasses, each with a stable ``code``.
* ``cli``: ``voice-out voices add | list | rm``.

Submodules are imported on demand; importing this package loads nothing heavy.
"""
