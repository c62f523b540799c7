"""The adapter figures the engine publishes: adapters and bytes per tier, loads in flight, the load-time
and load-wait histograms, cold starts, failed loads."""
from __future__ import annotations

from engine import metrics
from engine.llm import LLM
from engine.serving.engine_stats import EngineStatsPublisher
from ipc.requests import GenerateRequest
from ipc.sampling_params import SamplingParams


def sample(metric, name: str, **labels) -> float:
    for m in metric.collect():
        for s in m.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_adapter_tiers_bytes_and_load_times_are_published(adapter_dir):
    d, _ = adapter_dir
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20)
    core = llm.engine
    pub = EngineStatsPublisher(core, listed=lambda: 7)
    hist_before = sample(metrics.ADAPTER_LOAD_SECONDS, "loraplex_adapter_load_seconds_count")
    wait_before = sample(metrics.ADAPTER_LOAD_WAIT, "loraplex_adapter_load_wait_seconds_count")
    llm.register_adapter("a", str(d / "r8-all"))
    core.adapters.loader.pause()                      # a slow disk: the load stays in flight
    core.add_request(GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=2), adapter="a"))
    core.step()
    pub.publish(force=True)
    assert sample(metrics.ADAPTER_LOADS_IN_FLIGHT, "loraplex_adapter_loads_in_flight") == 1
    assert sample(metrics.ADAPTERS, "loraplex_adapters", tier="listed") == 7
    core.adapters.loader.resume()
    while core.has_unfinished():
        core.step()
    core.settle()                                     # as the engine does once idle: the host copy is taken
    pub.publish(force=True)
    a = core.adapters.lookup("a")
    page_bytes = core.adapters.page_elems * 4
    assert sample(metrics.ADAPTER_BYTES, "loraplex_adapter_bytes", tier="pool") == len(a.pages) * page_bytes
    assert sample(metrics.ADAPTER_BYTES, "loraplex_adapter_bytes", tier="host") == len(a.pages) * page_bytes
    assert sample(metrics.ADAPTER_BYTES, "loraplex_adapter_bytes", tier="disk") == a.files.nbytes > 0
    assert sample(metrics.ADAPTER_LOADS_IN_FLIGHT, "loraplex_adapter_loads_in_flight") == 0
    assert sample(metrics.ADAPTER_LOAD_SECONDS, "loraplex_adapter_load_seconds_count") == hist_before + 1
    assert sample(metrics.ADAPTER_LOAD_WAIT, "loraplex_adapter_load_wait_seconds_count") == wait_before + 1
    assert not core.adapters.load_seconds and not core.adapters.load_waits      # taken by the publisher
