"""Who is calling: API keys, tenants and what each may use (the `[auth]` table of the config file).

    [auth]
    admin_keys = ["sk-admin-1"]          # every adapter, the base model, load / unload
    [[auth.tenants]]
    name = "acme"
    keys = ["sk-acme-1", "sk-acme-2"]
    adapters = ["acme-*", "shared-*"]    # glob patterns of adapter names this tenant may use
    base_model = false                   # may it use the base model (default true)
    max_waiting = 32                     # its own bound on queued requests (optional)
    requests_per_minute = 600            # its rate limits (optional): a minute's worth at once, then this rate;
    tokens_per_minute = 200000           # a request counts its prompt + max_tokens (or the context) x n

With auth configured (an `[auth]` table, or `--api-key`, which is one admin key) every `/v1/*` call needs
`Authorization: Bearer KEY` (a browser opening /dashboard may give the key as Basic credentials instead:
any user name, the key as password). A tenant never learns what it may not use: an adapter outside its patterns
is answered as one that does not exist. Over a rate limit a request gets a 429 whose Retry-After says when it
would be let in (the engine keeps the buckets: engine/serving/rate_limits.py).
"""
from __future__ import annotations

import base64
import binascii
import fnmatch
import hmac
from dataclasses import dataclass, field

from ipc.requests import RateLimit

ADMIN = "admin"


@dataclass(frozen=True)
class Tenant:
    name: str
    keys: tuple[str, ...]
    adapters: tuple[str, ...] = ()       # glob patterns
    base_model: bool = True
    max_waiting: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def rate(self, prompt_tokens: list[int], max_tokens: int | None, n: int, max_model_len: int) -> RateLimit | None:
        """Its limits and what one call costs against them: one request, and per prompt (a batch has several)
        its tokens and what its `n` choices may generate (max_tokens None: up to the context); None when it
        has no limit."""
        if not (self.requests_per_minute or self.tokens_per_minute):
            return None
        tokens = sum(n * (p + (max_tokens if max_tokens is not None else max_model_len - p)) for p in prompt_tokens)
        return RateLimit(self.requests_per_minute or 0, self.tokens_per_minute or 0, 1, tokens)

    def may_use(self, adapter: str | None) -> bool:
        """adapter None is the base model."""
        if adapter is None:
            return self.base_model
        return any(fnmatch.fnmatchcase(adapter, p) for p in self.adapters)


@dataclass(frozen=True)
class Caller:
    """The identity behind a request's key: an admin, or a tenant."""
    name: str                            # ADMIN or the tenant's name (the metrics label, the cache salt)
    tenant: Tenant | None = None

    @property
    def is_admin(self) -> bool:
        return self.tenant is None

    def may_use(self, adapter: str | None) -> bool:
        return self.tenant is None or self.tenant.may_use(adapter)

    def cache_salt(self, salt: str | None) -> str | None:
        """The prefix-cache salt for a request that asked for `salt`: a tenant's always begins with its
        name, so cached prefixes are never shared across tenants."""
        if self.tenant is None:
            return salt
        return f"tenant:{self.name}" + ("" if salt is None else f":{salt}")


ANONYMOUS_ADMIN = Caller(ADMIN)          # no auth configured: everyone may do everything


@dataclass
class Auth:
    admin_keys: tuple[str, ...] = ()
    tenants: tuple[Tenant, ...] = ()
    metrics_keys: tuple[str, ...] = ()   # keys that may read /metrics and nothing else (a Prometheus scraper)
    ingress_key: str | None = None       # the Ray ingress's load poll: /metrics only, and closes nothing
    _by_key: dict[str, Caller] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for k in self.admin_keys:
            self._by_key[k] = Caller(ADMIN)
        for t in self.tenants:
            for k in t.keys:
                if k in self._by_key:
                    raise ValueError(f"auth: key of tenant {t.name!r} is used twice")
                self._by_key[k] = Caller(t.name, t)

    @property
    def enabled(self) -> bool:
        return bool(self._by_key)

    def caller(self, authorization: str) -> Caller | None:
        """The caller of an `Authorization` header's key (Bearer, or Basic with the key as password); None
        when it names no known key."""
        if not self.enabled:
            return ANONYMOUS_ADMIN
        scheme, _, key = authorization.partition(" ")
        if scheme == "Basic" and key:           # a browser's credentials: the key is the password
            try:
                key = base64.b64decode(key.strip(), validate=True).decode().partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                return None
        if scheme not in ("Bearer", "Basic") or not key:
            return None
        for known, who in self._by_key.items():      # NOTE: constant-time per key, no early exit on a match
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                return who
        return None

    def metrics_access(self, authorization: str) -> int:
        """Who may read /metrics, which names adapters and tenants: everyone when no key is configured;
        else an admin key or a metrics key (200), no or an unknown key (401), a tenant's key (403). The
        ingress key is let in always, and alone closes nothing."""
        if not self.enabled and not self.metrics_keys:
            return 200
        scheme, _, key = authorization.partition(" ")
        readers = self.metrics_keys + ((self.ingress_key,) if self.ingress_key else ())
        if scheme == "Bearer" and key and any(hmac.compare_digest(k.encode(), key.strip().encode()) for k in readers):
            return 200
        caller = self.caller(authorization) if self.enabled else None
        if caller is None:
            return 401
        return 200 if caller.is_admin else 403

    def labels(self) -> list[str]:
        """Every value the `tenant` metrics label can take (bounded by the config)."""
        return [ADMIN] + [t.name for t in self.tenants]


def _strings(value, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where} must be a list of non-empty strings")
    return tuple(value)


def _positive(value, where: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{where} must be a positive integer")
    return value


def parse_auth(table: dict | None, api_key: str | None = None, ingress_key: str | None = None) -> Auth:
    """The `[auth]` table of the config file (None: absent), plus `--api-key` as one more admin key and the
    Ray ingress's metrics key (envs.ingress_metrics_key). ValueError naming the setting that is wrong."""
    table = dict(table or {})
    admin = _strings(table.pop("admin_keys", []), "auth.admin_keys")
    metrics = _strings(table.pop("metrics_keys", []), "auth.metrics_keys")
    tenants = []
    for i, t in enumerate(table.pop("tenants", [])):
        where = f"auth.tenants[{i}]"
        if not isinstance(t, dict):
            raise ValueError(f"{where} must be a table")
        t = dict(t)
        name = t.pop("name", None)
        if not isinstance(name, str) or not name or name == ADMIN:
            raise ValueError(f"{where}.name must be a non-empty string other than {ADMIN!r}")
        keys = _strings(t.pop("keys", None), f"{where}.keys")
        patterns = _strings(t.pop("adapters", []), f"{where}.adapters")
        base = t.pop("base_model", True)
        if not isinstance(base, bool):
            raise ValueError(f"{where}.base_model must be true or false")
        bounds = {k: _positive(t.pop(k, None), f"{where}.{k}")
                  for k in ("max_waiting", "requests_per_minute", "tokens_per_minute")}
        if t:
            raise ValueError(f"{where}: unknown setting(s) {', '.join(sorted(t))}")
        tenants.append(Tenant(name, keys, patterns, base, **bounds))
    if table:
        raise ValueError(f"auth: unknown setting(s) {', '.join(sorted(table))}")
    if len({t.name for t in tenants}) != len(tenants):
        raise ValueError("auth.tenants: names must be distinct")
    return Auth(admin + ((api_key,) if api_key else ()), tuple(tenants), metrics, ingress_key)
