"""Tenants from the config file's [auth] table, against the real processes: keys, what each tenant may use
(the same 404 as for a model that does not exist), admin-only load / unload, prefix caches salted per
tenant, a bounded tenant label on the metrics, and --api-key kept as one admin key."""
from __future__ import annotations

import json
import shutil

import openai
import pytest
import requests

from tests.frontends.server_fixture import Server, metric, wait_until

CONFIG = '''
[auth]
admin_keys = ["sk-admin-1"]          # every adapter, the base model, load / unload
[[auth.tenants]]
name = "acme"
keys = ["sk-acme-1", "sk-acme-2"]
adapters = ["acme-*", "shared-*"]    # glob patterns of adapter names this tenant may use
base_model = false                   # may it use the base model (default true)
max_waiting = 32                     # its own bound on queued requests (optional)
[[auth.tenants]]
name = "beta"
keys = ["sk-beta-1"]
adapters = ["beta-*"]
[[auth.tenants]]
name = "metered"
keys = ["sk-metered-1"]
requests_per_minute = 3
tokens_per_minute = 5000
'''
LONG = "Describe the history of the city of Lyon in detail, from the Roman era to the present day. " * 3


@pytest.fixture(scope="module")
def server(served_adapters, tmp_path_factory):
    _, src = served_adapters
    d = tmp_path_factory.mktemp("tenants")
    for name in ("acme-1", "shared-1", "beta-1"):
        shutil.copytree(src / "r4-qv", d / "adapters" / name)
    (d / "loraplex.toml").write_text(CONFIG)
    s = Server("--adapter-dir", str(d / "adapters"), "--frontends", "1", "--config", str(d / "loraplex.toml"),
               "--api-key", "sk-legacy", "--lora-roots", str(src), "--metrics-key", "sk-scraper",
               "--enable-log-requests")
    yield s, src
    assert s.stop() == 0


def client(s, key):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)


def test_every_call_needs_a_known_key(server):
    s, _ = server
    assert requests.get(s.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(s, "sk-nobody").models.list()
    assert requests.get(s.url + "/health").status_code == 200


def test_a_tenant_sees_and_uses_only_its_own(server):
    s, _ = server
    acme = client(s, "sk-acme-2")
    assert {m.id for m in acme.models.list().data} == {"acme-1", "shared-1"}      # no base model, no beta-1
    assert acme.completions.create(model="acme-1", prompt="Hi", max_tokens=2).choices[0].text is not None
    messages = {}
    for model in ("beta-1", "SmolLM2-135M-Instruct", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as e:
            acme.completions.create(model=model, prompt="Hi", max_tokens=2)
        messages[model] = e.value.body["message"].replace(model, "<model>")
    assert len(set(messages.values())) == 1, messages      # nothing tells another's adapter from none
    for model in ("beta-1", "SmolLM2-135M-Instruct", "no-such-adapter"):         # nor does /tokenize
        r = requests.post(s.url + "/tokenize", json={"model": model, "prompt": "Hi"},
                          headers={"Authorization": "Bearer sk-acme-2"})
        assert r.status_code == 404 and r.json()["error"]["message"].replace(model, "<model>") == messages[model]
    assert requests.post(s.url + "/tokenize", json={"model": "acme-1", "prompt": "Hi"},
                         headers={"Authorization": "Bearer sk-acme-2"}).json()["count"] > 0
    beta = client(s, "sk-beta-1")
    assert {m.id for m in beta.models.list().data} == {"SmolLM2-135M-Instruct", "beta-1"}


def test_a_tenant_composes_only_its_own_adapters(server):
    s, _ = server
    acme = client(s, "sk-acme-1")
    out = acme.completions.create(model="acme-1", prompt="Hi", max_tokens=2,
                                  extra_body={"adapters": [{"name": "shared-1", "scale": 0.5}]})
    assert out.choices[0].text is not None
    for name in ("beta-1", "no-such-adapter"):                  # the same 404 as for a model
        with pytest.raises(openai.NotFoundError) as e:
            acme.completions.create(model="acme-1", prompt="Hi", max_tokens=2,
                                    extra_body={"adapters": [{"name": name}]})
        assert name in e.value.body["message"] and e.value.body["param"] == "adapters"
    with pytest.raises(openai.NotFoundError):                   # nor the base model, which acme may not use
        acme.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2,
                                extra_body={"adapters": [{"name": "acme-1"}]})


def test_load_and_unload_need_an_admin_key(server):
    s, src = server
    body = {"lora_name": "acme-2", "lora_path": str(src / "r8-all")}
    for key in ("sk-acme-1", "sk-beta-1"):
        r = requests.post(s.url + "/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    for key in ("sk-admin-1", "sk-legacy"):                 # --api-key is one more admin key
        r = requests.post(s.url + "/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        assert "acme-2" in {m.id for m in client(s, key).models.list().data}
        r = requests.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "acme-2"},
                          headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text


def test_the_request_log_has_a_line_per_request_with_its_tenant_tokens_and_refusal(server):
    """--enable-log-requests: one JSON line per POST /v1/* request, once its answer is sent; never its text."""
    s, src = server
    acme, beta = client(s, "sk-acme-1"), client(s, "sk-beta-1")
    acme.completions.create(model="acme-1", prompt="A secret prompt", max_tokens=3, extra_body={"ignore_eos": True},
                            extra_headers={"X-Request-Id": "log-1"})
    list(acme.completions.create(model="shared-1", prompt="Hi", max_tokens=2, stream=True,
                                 extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "log-2"}))
    with pytest.raises(openai.NotFoundError):
        beta.completions.create(model="acme-1", prompt="Hi", max_tokens=2, extra_headers={"X-Request-Id": "log-3"})
    r = requests.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "no-such"},
                      headers={"Authorization": "Bearer sk-admin-1", "X-Request-Id": "log-4"})
    assert r.status_code == 404
    with requests.post(s.url + "/v1/completions", stream=True, timeout=60,
                       headers={"Authorization": "Bearer sk-acme-1", "X-Request-Id": "log-5"},
                       json={"model": "acme-1", "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True,
                             "stream": True}) as gone:
        next(gone.iter_lines())            # the stream began; then its client leaves

    def records() -> dict[str, dict]:
        out = {}
        for line in list(s.lines):
            if '"request_id":"log-' in line:
                rec = json.loads(line[line.index("{"):])
                out[rec["request_id"]] = rec
        return out
    assert wait_until(lambda: len(records()) == 5), "".join(s.lines[-20:])
    got = records()
    assert "client_gone" in (got["log-5"]["status"], got["log-5"].get("outcome")), got["log-5"]
    assert "completion_tokens" not in got["log-5"]
    one, two, three, four = (got[f"log-{i}"] for i in range(1, 5))
    assert (one["tenant"], one["model"], one["status"], one["path"]) == ("acme", "acme-1", 200, "/v1/completions")
    assert one["prompt_tokens"] > 0 and one["completion_tokens"] == 3 and one["finish_reasons"] == ["length"]
    assert one["id"].startswith("cmpl-") and "ttft_s" not in one and one["seconds"] > 0
    assert two["completion_tokens"] == 2 and 0 < two["ttft_s"] <= two["seconds"] and "outcome" not in two
    assert (three["tenant"], three["status"]) == ("beta", 404) and "does not exist" in three["error"]
    assert (four["tenant"], four["adapter"], four["status"]) == ("admin", "no-such", 404), four
    assert not [line for line in s.lines if "secret" in line]


def test_a_tenant_over_its_rate_limits_gets_429_saying_when_to_retry(server):
    """requests_per_minute 3, tokens_per_minute 5000: a minute's worth at once, then a 429 whose Retry-After
    is the bucket's refill time; a request larger than the token limit is a 400 (it could never run); n
    choices are one request, their tokens counted n times."""
    s, _ = server
    metered = client(s, "sk-metered-1")
    out = metered.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2, n=2)
    assert len(out.choices) == 2                                   # one request (two choices)
    with pytest.raises(openai.BadRequestError,
                       match=r"more than the tokens_per_minute of tenant 'metered' \(5000\): set a lower max_tokens"):
        metered.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=3000, n=2)
    for _ in range(2):
        metered.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    r = requests.post(s.url + "/v1/completions", headers={"Authorization": "Bearer sk-metered-1"},
                      json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 429 and "requests_per_minute (3)" in r.json()["error"]["message"], r.text
    assert 1 <= int(r.headers["Retry-After"]) <= 20                # a request's refill: 60 s / 3
    text = requests.get(s.url + "/metrics", headers={"Authorization": "Bearer sk-admin-1"}).text
    assert metric(text, "loraplex_tenant_rate_limited_total", 'limit="requests_per_minute",tenant="metered"') == 1
    assert metric(text, "loraplex_tenant_rate_limited_total", 'limit="tokens_per_minute",tenant="metered"') == 1
    beta = client(s, "sk-beta-1")                                  # the others are not limited
    assert beta.completions.create(model="beta-1", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_a_batch_of_more_choices_than_the_tenants_max_waiting_is_a_400_not_an_endless_429(server):
    """acme's max_waiting is 32: 17 prompts x n 2 could never all wait at once, so retrying could never help."""
    s, _ = server
    acme = client(s, "sk-acme-1")
    with pytest.raises(openai.BadRequestError, match=r"34 choices \(17 prompts x n 2\).*'acme' may have 32 waiting"):
        acme.completions.create(model="acme-1", prompt=["Hi"] * 17, max_tokens=2, n=2)
    out = acme.completions.create(model="acme-1", prompt=["Hi"] * 16, max_tokens=2, n=2)
    assert len(out.choices) == 32


def test_prefix_cache_reuse_never_crosses_tenants(server):
    s, _ = server
    def cached(key, model):
        out = client(s, key).completions.create(model=model, prompt=LONG, max_tokens=1, temperature=0)
        details = out.usage.prompt_tokens_details
        return 0 if details is None else details.cached_tokens
    # shared-1 is usable by acme and by the admin: the same prompt on the same adapter
    cached("sk-acme-1", "shared-1")
    assert cached("sk-acme-2", "shared-1") > 0          # the same tenant (another key) reuses its blocks
    assert cached("sk-admin-1", "shared-1") == 0        # another caller does not


def test_metrics_need_an_admin_or_metrics_key(server):
    """/metrics names adapters and tenants: with keys configured, no key gets 401, a tenant's 403, an admin's
    and the scraper's (--metrics-key) 200."""
    s, _ = server
    get = lambda key=None: requests.get(s.url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})  # noqa: E731
    assert get().status_code == 401 and get("sk-wrong").status_code == 401
    assert get("sk-beta-1").status_code == 403
    assert get("sk-admin-1").status_code == 200 and get("sk-scraper").status_code == 200
    assert "loraplex_" in get("sk-scraper").text
    r = requests.post(s.url + "/v1/completions", json={"model": "beta-1", "prompt": "Hi", "max_tokens": 1},
                      headers={"Authorization": "Bearer sk-scraper"})
    assert r.status_code == 401, "a metrics key opens /metrics and nothing else"


def test_metrics_carry_a_bounded_tenant_label_and_count_each_tenants_tokens(server):
    s, _ = server

    def tokens() -> dict[str, float]:
        text = requests.get(s.url + "/metrics", headers={"Authorization": "Bearer sk-admin-1"}).text
        return {kind: metric(text, "loraplex_tenant_tokens_total", f'kind="{kind}",tenant="beta"')
                for kind in ("prompt", "completion")}
    client(s, "sk-beta-1").completions.create(model="beta-1", prompt="Hi", max_tokens=2)
    text = requests.get(s.url + "/metrics", headers={"Authorization": "Bearer sk-admin-1"}).text
    tenants = {line.split('tenant="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("loraplex_tenant_requests_total{")}
    assert "beta" in tenants and tenants <= {"admin", "acme", "beta", "metered"}
    before = tokens()
    one = client(s, "sk-beta-1").completions.create(model="beta-1", prompt="Once upon a time", max_tokens=3, n=2,
                                                    extra_body={"ignore_eos": True})
    streamed = list(client(s, "sk-beta-1").chat.completions.create(
        model="beta-1", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    two = streamed[-1].usage
    after = tokens()
    assert after["completion"] - before["completion"] == one.usage.completion_tokens + two.completion_tokens == 8
    assert after["prompt"] - before["prompt"] == one.usage.prompt_tokens + two.prompt_tokens


@pytest.mark.parametrize("table, named", [("[auth]\nadmin_keys = 'sk'\n", "auth.admin_keys"),
                                          ("[[auth.tenants]]\nname = 'x'\n", "auth.tenants[0].keys"),
                                          ("[[auth.tenants]]\nname = 'x'\nkeys = ['k']\nquota = 3\n", "quota"),
                                          ("[[auth.tenants]]\nname = 'x'\nkeys = ['k']\ntokens_per_minute = 0\n",
                                           "auth.tenants[0].tokens_per_minute")])
def test_a_bad_auth_table_is_refused_naming_the_setting(tmp_path, table, named):
    import subprocess
    import sys
    (tmp_path / "c.toml").write_text(table)
    r = subprocess.run([sys.executable, "-m", "frontends.cli", "serve", "--config", str(tmp_path / "c.toml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and named in r.stderr, r.stderr


def test_a_full_waiting_queue_answers_429_at_once(served_adapters, tmp_path):
    """--max-waiting 2 with one running place; a tenant whose own max_waiting is 1: beyond either bound a
    request is refused at once with 429 and Retry-After, and the others complete."""
    import concurrent.futures
    _, src = served_adapters
    shutil.copytree(src / "r4-qv", tmp_path / "adapters" / "small-1")
    (tmp_path / "c.toml").write_text('[auth]\nadmin_keys = ["sk-a"]\n[[auth.tenants]]\nname = "small"\n'
                                     'keys = ["sk-s"]\nadapters = ["small-*"]\nmax_waiting = 1\n')
    s = Server("--adapter-dir", str(tmp_path / "adapters"), "--frontends", "1", "--config", str(tmp_path / "c.toml"),
               "--max-waiting", "2", "--max-num-seqs", "1")
    try:
        def call(key, model, max_tokens=8):
            body = {"model": model, "prompt": "Count to a hundred:", "max_tokens": max_tokens, "ignore_eos": True}
            return requests.post(s.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                                 timeout=300)

        def burst(key, model, n):
            """One long request, once it runs, then n more at once. NOTE: all at once, none would be running
            yet and only the waiting bound would count (the step loop applies its whole inbox first)."""
            with concurrent.futures.ThreadPoolExecutor(n + 1) as pool:
                first = pool.submit(call, key, model, 64)      # still running when the rest arrive
                assert wait_until(lambda: metric(requests.get(s.url + "/metrics", timeout=10,
                                                              headers={"Authorization": "Bearer sk-a"}).text,
                                                 "loraplex_requests_running") == 1, timeout=60, every=0.05)
                rest = [pool.submit(call, key, model) for _ in range(n)]
                return [f.result() for f in [first, *rest]]
        answers = burst("sk-a", "SmolLM2-135M-Instruct", 5)
        codes = sorted(r.status_code for r in answers)
        assert codes.count(200) >= 3 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
        refused = next(r for r in answers if r.status_code == 429)
        assert refused.headers["Retry-After"] == "1" and "--max-waiting" in refused.json()["error"]["message"]
        assert refused.json()["error"]["type"] == "rate_limit_error"
        mine = burst("sk-s", "small-1", 3)
        codes = sorted(r.status_code for r in mine)
        assert codes.count(200) >= 2 and 429 in codes, codes
        assert any("max_waiting" in r.json()["error"]["message"] for r in mine if r.status_code == 429)
        assert all(len(r.json()["choices"][0]["text"]) > 0 for r in answers + mine if r.status_code == 200)
    finally:
        assert s.stop() == 0
