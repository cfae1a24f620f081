"""Prometheus instruments of one server, in a registry of its own (two apps in one process,
as in tests, never share counters). Updated on the asyncio thread; scraped at ``GET /metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

LATENCY_BUCKETS_S = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
BARGE_IN_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5)
LATE_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


class Metrics:
    """The server's instruments. ``render()`` gives the text exposition format."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # process_* (CPU seconds, resident memory, open fds, threads on Linux), python_gc_*
        # and python_info, as prometheus_client's default registry has them
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        PlatformCollector(registry=r)
        self.ttfa = Histogram(
            "voice_out_ttfa_seconds",
            "First text.delta of an utterance to its first audio frame on the track",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.barge_in = Histogram(
            "voice_out_barge_in_seconds",
            "cancel received to the last audible sample sent (end of the fade-out)",
            buckets=BARGE_IN_BUCKETS_S,
            registry=r,
        )
        self.rtf = Histogram(
            "voice_out_rtf",
            "Per utterance: seconds spent waiting on the engine per second of audio",
            buckets=RTF_BUCKETS,
            registry=r,
        )
        self.late_frames = Histogram(
            "voice_out_late_frame_seconds",
            "Audio frames built at least 5 ms after their time, by how late (the event loop was busy)",
            buckets=LATE_BUCKETS_S,
            registry=r,
        )
        self.active_sessions = Gauge("voice_out_active_sessions", "Open sessions", registry=r)
        self.active_streams = Gauge("voice_out_active_streams", "Utterances being synthesized or played", registry=r)
        self.underruns = Counter(
            "voice_out_underruns", "Times a playing utterance ran dry before its audio was complete", registry=r
        )
        self.cancels = Counter("voice_out_cancelled_utterances", "Utterances cut by a cancel (barge-in)", registry=r)
        self.utterances = Counter("voice_out_utterances", "Utterances started", registry=r)
        self.errors = Counter("voice_out_errors", "error messages sent, by code", ["code"], registry=r)
        self.sessions_rejected = Counter(
            "voice_out_sessions_rejected", "Offers refused by admission control", registry=r
        )

        self.api_requests = Counter(
            "voice_out_api_requests",
            "Requests of the compatibility APIs, by api (openai, ...) and HTTP status (499: the client left)",
            ["api", "status"],
            registry=r,
        )
        self.api_first_audio = Histogram(
            "voice_out_api_first_audio_seconds",
            "Compatibility APIs: request received to its first audio bytes written, by api",
            ["api"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )

    def watch_engines(self, reports: Callable[[], Sequence[Any]], label: str = "gpu") -> None:
        """Report each engine at every scrape, labelled ``label``: ``gpu`` for the engines of a
        placement, ``replica`` for the Ray Serve replicas of a ``RayEngine``. ``reports()``
        gives :class:`~voice_out.engine.placement.EngineReport` s (any thread that scrapes)."""
        self.registry.register(_EngineCollector(reports, label))

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


class _EngineCollector(Collector):
    def __init__(self, reports: Callable[[], Sequence[Any]], label: str) -> None:
        self._reports = reports
        self._label = label

    def describe(self) -> list[Metric]:
        return []  # read at every scrape; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        reports = self._reports()
        key = self._label
        up = GaugeMetricFamily("voice_out_engine_up", "1 while the engine takes new utterances", labels=[key])
        state = GaugeMetricFamily(
            "voice_out_engine_state", "The engine's state (1 for the current one)", labels=[key, "state"]
        )
        streams = GaugeMetricFamily("voice_out_engine_streams", "Utterances in flight on the engine", labels=[key])
        capacity = GaugeMetricFamily(
            "voice_out_engine_capacity", "Utterances the engine is planned to hold", labels=[key]
        )
        placed = CounterMetricFamily("voice_out_engine_utterances", "Utterances placed on the engine", labels=[key])
        failed = CounterMetricFamily(
            "voice_out_engine_failed_utterances", "Utterances ended by the engine's failure", labels=[key]
        )
        for r in reports:
            up.add_metric([r.label], 1.0 if r.state.value == "ready" else 0.0)
            state.add_metric([r.label, r.state.value], 1.0)
            streams.add_metric([r.label], float(r.in_flight))
            capacity.add_metric([r.label], float(r.capacity))
            placed.add_metric([r.label], float(r.placed))
            failed.add_metric([r.label], float(r.failed_streams))
        yield from (up, state, streams, capacity, placed, failed)
