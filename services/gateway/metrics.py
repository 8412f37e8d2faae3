"""Prometheus metrics of one gateway (own registry, so several apps can live in one process).

Under the supervisor's workers (``PROMETHEUS_MULTIPROC_DIR`` set) every worker writes its values to that
directory and ``/metrics`` on any worker collects all of them (counters and histograms summed; the spool's
gauges summed, maxed or minned over live workers; the router version per worker).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TRACE_BUCKETS = (1_000, 4_000, 16_000, 64_000, 256_000, 1_000_000, 4_000_000)


class GatewayMetrics:
    """Counters and histograms the gateway updates per request."""

    def __init__(self, *, multiprocess: bool = False) -> None:
        self.multiprocess = multiprocess and bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fanroute_gateway_requests", "Search requests", ["mode", "status"], registry=r)
        self.request_seconds = Histogram("fanroute_gateway_request_seconds", "End-to-end request time",
                                         ["mode"], buckets=_LATENCY_BUCKETS, registry=r)
        self.provider_calls = Counter("fanroute_provider_calls", "Provider calls by outcome",
                                      ["provider", "outcome"], registry=r)
        self.provider_seconds = Histogram("fanroute_provider_latency_seconds", "Provider call latency",
                                          ["provider"], buckets=_LATENCY_BUCKETS, registry=r)
        self.provider_cost = Counter("fanroute_provider_cost_usd", "Provider spend in USD",
                                     ["provider"], registry=r)
        self.trace_bytes = Histogram("fanroute_gateway_trace_bytes", "Encoded size of each trace sent to "
                                     "Kafka (or spooled): what the request path serialises",
                                     buckets=_TRACE_BUCKETS, registry=r)
        self.traces_published = Counter("fanroute_traces_published", "Traces acknowledged by Kafka",
                                        registry=r)
        self.traces_unpublished = Counter("fanroute_traces_unpublished",
                                          "Traces neither acknowledged by Kafka nor spooled (answered 503)",
                                          registry=r)
        self.traces_spooled = Counter("fanroute_traces_spooled", "Traces Kafka did not acknowledge within "
                                      "publish_wait_s, written to the local spool (answered 'spooled')",
                                      registry=r)
        self.spool_refused = Counter("fanroute_traces_spool_refused", "Traces the spool could not take, by "
                                     "reason (spool_full, spool_unavailable); each answered 503",
                                     ["reason"], registry=r)
        for reason in ("spool_full", "spool_unavailable"):
            self.spool_refused.labels(reason)
        self.spool_late_acks = Counter("fanroute_traces_spool_late_acks", "Spooled traces whose first send "
                                       "was acknowledged after all (no re-publish needed)", registry=r)
        self.spool_republished = Counter("fanroute_traces_spool_republished",
                                         "Spooled traces re-published from the spool and acknowledged", registry=r)
        self.spool_found_on_topic = Counter("fanroute_traces_spool_found_on_topic",
                                            "Spooled traces found already on the topic before a re-publish (a "
                                            "failed send the broker had written): acked, not written twice",
                                            registry=r)
        self.spool_damaged = Counter("fanroute_traces_spool_damaged_lines", "Spool lines skipped at start-up "
                                     "(a torn last line after a crash, or damage)", registry=r)
        self.spool_depth = Gauge("fanroute_traces_spool_depth", "Traces in the spool waiting for Kafka",
                                 registry=r, multiprocess_mode="livesum")
        self.spool_oldest_age = Gauge("fanroute_traces_spool_oldest_age_seconds",
                                      "Age of the oldest spooled trace (0 when the spool is empty)", registry=r,
                                      multiprocess_mode="livemax")
        self.spool_available = Gauge("fanroute_traces_spool_available",
                                     "1 when the spool can be written, 0 when it cannot (its directory or file)",
                                     registry=r, multiprocess_mode="livemin")
        self.contested = Counter("fanroute_traces_contested", "Traces flagged contested", registry=r)
        self.rejected = Counter("fanroute_gateway_rejected", "Requests refused with a 4xx", ["reason"],
                                registry=r)
        self.routed = Counter("fanroute_gateway_routed", "Routed requests by who picked the provider "
                              "(router = its ordering, fallback = the best single provider)", ["path"], registry=r)
        self.route_fallbacks = Counter("fanroute_gateway_route_fallbacks",
                                       "Routed requests answered by the best single provider, by reason",
                                       ["reason"], registry=r)
        self.route_failovers = Counter("fanroute_gateway_route_failovers",
                                       "Providers tried after the one before them failed", registry=r)
        self.router_seconds = Histogram("fanroute_gateway_router_seconds", "Time spent asking the router",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.router_version = Gauge("fanroute_gateway_router_version",
                                    "Promoted router version the gateway follows (0 = none)", registry=r,
                                    multiprocess_mode="liveall")

    def exposition_registry(self) -> CollectorRegistry:
        """What ``/metrics`` answers: this gateway's registry, or every worker's values collected."""
        if not self.multiprocess:
            return self.registry
        from prometheus_client import multiprocess

        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        return merged
