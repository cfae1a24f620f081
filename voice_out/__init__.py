"""voice_out: the real-time mouth of a conversational agent (streaming CosyVoice2 over WebRTC)."""

__version__ = "0.1.0"
