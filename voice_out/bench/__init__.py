"""The benchmark suite, ``voice-out bench`` (see docs/benchmarks.md)."""
