"""Who may read /metrics (Auth.metrics_access): open with no key configured; with keys, admins and metrics
keys; the Ray ingress's poll key in both cases, without closing an open /metrics and without opening /v1."""
from __future__ import annotations

from frontends.auth import Tenant, parse_auth

TABLE = {"admin_keys": ["sk-admin"], "tenants": [{"name": "acme", "keys": ["sk-acme"]}]}


def bearer(key: str | None) -> str:
    return f"Bearer {key}" if key else ""


def test_metrics_with_keys_need_an_admin_metrics_or_ingress_key():
    auth = parse_auth({**TABLE, "metrics_keys": ["sk-scrape"]}, ingress_key="sk-ingress-x")
    got = {k: auth.metrics_access(bearer(k)) for k in (None, "sk-wrong", "sk-acme", "sk-admin", "sk-scrape",
                                                        "sk-ingress-x")}
    assert got == {None: 401, "sk-wrong": 401, "sk-acme": 403, "sk-admin": 200, "sk-scrape": 200,
                   "sk-ingress-x": 200}
    assert auth.caller(bearer("sk-ingress-x")) is None and auth.caller(bearer("sk-scrape")) is None  # no /v1


def test_the_ingress_key_leaves_an_open_metrics_open():
    auth = parse_auth(None, ingress_key="sk-ingress-x")
    assert not auth.enabled
    assert auth.metrics_access("") == 200 and auth.metrics_access(bearer("sk-ingress-x")) == 200
    closed = parse_auth({"metrics_keys": ["sk-scrape"]})      # a --metrics-key alone does close it
    assert closed.metrics_access("") == 401 and closed.metrics_access(bearer("sk-scrape")) == 200


def test_a_call_costs_one_request_and_each_prompts_tokens_times_its_choices():
    t = Tenant("t", ("k",), requests_per_minute=10, tokens_per_minute=1000)
    one = t.rate([5], 10, 2, 100)
    assert (one.requests, one.tokens) == (1, 2 * (5 + 10))
    batch = t.rate([5, 7, 1], None, 3, 100)                        # max_tokens None: up to the context
    assert (batch.requests, batch.tokens) == (1, 3 * 100 * 3)
    assert Tenant("free", ("k",)).rate([5], 10, 1, 100) is None
