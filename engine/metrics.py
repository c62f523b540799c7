"""Prometheus metrics shared by the engine and frontend processes.

The launcher points PROMETHEUS_MULTIPROC_DIR at one directory for all processes, so a scrape of any
frontend aggregates every process's figures (prometheus_client's multiprocess mode).
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# engine process
RUNNING = Gauge("loraplex_requests_running", "Requests running in the engine", multiprocess_mode="mostrecent")
WAITING = Gauge("loraplex_requests_waiting", "Requests waiting in the engine", multiprocess_mode="mostrecent")
POOL_PAGES = Gauge("loraplex_pool_pages", "Pages of the unified pool by kind", ["kind"],
                   multiprocess_mode="mostrecent")
ADAPTERS = Gauge("loraplex_adapters", "Adapters per tier: resident, loading, host, registered, listed (in "
                 "--adapter-dir, not read yet or read)", ["tier"], multiprocess_mode="mostrecent")
ADAPTER_BYTES = Gauge("loraplex_adapter_bytes", "Adapter bytes per tier: pool (pages held), host (packed copies), "
                      "disk (weight files of the registered adapters)", ["tier"], multiprocess_mode="mostrecent")
ADAPTER_LOADS_IN_FLIGHT = Gauge("loraplex_adapter_loads_in_flight", "Adapter loads started and not finished",
                                multiprocess_mode="mostrecent")
ADAPTER_LOAD_SECONDS = Histogram("loraplex_adapter_load_seconds", "An adapter load, from its start to its pages "
                                 "being ready", buckets=_LAT)
ADAPTER_LOAD_WAIT = Histogram("loraplex_adapter_load_wait_seconds", "Time a request waited for its adapter's load "
                              "(cold starts only)", buckets=_LAT)
ADAPTER_FAILED_LOADS = Counter("loraplex_adapter_failed_loads", "Adapter loads that failed (their requests fail)")
ADAPTER_LOADS = Counter("loraplex_adapter_loads", "Adapter loads into the pool")
ADAPTER_EVICTIONS = Counter("loraplex_adapter_evictions", "Adapters evicted from the pool")
ADAPTER_COLD_STARTS = Counter("loraplex_adapter_cold_starts", "Requests that waited for their adapter to load")
ADAPTER_HIT_RATE = Gauge("loraplex_adapter_hit_rate", "Share of adapter requests whose adapter was resident",
                         multiprocess_mode="mostrecent")
RATE_LIMITED = Counter("loraplex_tenant_rate_limited", "Requests refused by their tenant's rate limit (429, or 400 "
                       "for one larger than tokens_per_minute), by tenant and limit", ["tenant", "limit"])
PREEMPTIONS = Counter("loraplex_preemptions", "Requests preempted when the pool ran out")
FAILED_STEPS = Counter("loraplex_failed_steps", "Model steps that raised (their requests are then run one by one "
                       "to find the one that causes it)")
ADAPTER_FETCHES = Counter("loraplex_adapter_fetches", "Adapters fetched from --adapter-source, by outcome",
                          ["outcome"])
ADAPTER_FETCH_SECONDS = Histogram("loraplex_adapter_fetch_seconds", "One adapter's fetch from --adapter-source",
                                  buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
ADAPTER_FETCH_BYTES = Counter("loraplex_adapter_fetch_bytes", "Bytes of adapters fetched from --adapter-source")
GRAMMAR_COMPILES = Counter("loraplex_grammar_compiles", "Structured-output constraints compiled (in the compile "
                           "worker) by outcome: 'ok', 'error' (a 400 naming what is wrong), 'timeout' (a 400; the "
                           "worker killed)", ["outcome"])
GRAMMAR_COMPILE_SECONDS = Histogram("loraplex_grammar_compile_seconds", "A constraint's compile, the worker's start "
                                    "included when it started one", buckets=_LAT)
GENERATED_TOKENS = Counter("loraplex_generation_tokens", "Tokens generated")

# frontend processes
TTFT = Histogram("loraplex_time_to_first_token_seconds", "Time to first token", buckets=_LAT)
ITL = Histogram("loraplex_inter_token_latency_seconds", "Time between streamed tokens", buckets=_LAT)
E2E = Histogram("loraplex_e2e_request_latency_seconds", "End-to-end request latency", buckets=_LAT)
REQUESTS = Counter("loraplex_requests", "Finished requests by adapter (top adapters by name, the rest 'other')",
                   ["adapter", "finish_reason"])

SLOW_READERS = Counter("loraplex_slow_reader_aborts", "Streams aborted because their client stopped reading: "
                       "'buffer' (MAX_BUFFERED outputs behind) or 'timeout' (nothing taken for --stream-timeout)",
                       ["cause"])
TENANT_REQUESTS = Counter("loraplex_tenant_requests", "Requests answered in full, by tenant (the configured tenants "
                          "and 'admin': a bounded label), counted once the answer's last byte was written; one per "
                          "choice", ["tenant", "finish_reason"])
TENANT_TOKENS = Counter("loraplex_tenant_tokens", "Tokens of the answers loraplex_tenant_requests counts, by tenant "
                        "and kind: 'prompt' (once per request), 'completion' (summed over its choices), 'cached' "
                        "(prompt tokens found in the prefix cache): what a platform bills each tenant for",
                        ["tenant", "kind"])

TOP_ADAPTER_LABELS = 20


class AdapterLabels:
    """Bounded label values: the first TOP_ADAPTER_LABELS adapter names get their own label."""

    def __init__(self, limit: int = TOP_ADAPTER_LABELS):
        self.limit = limit
        self.known: set[str] = set()

    def __call__(self, name: str | None) -> str:
        if name is None:
            return "base"
        if name in self.known or len(self.known) < self.limit:
            self.known.add(name)
            return name
        return "other"
