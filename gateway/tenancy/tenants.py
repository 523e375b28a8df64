"""Tenants: who may call the gateway, with which limits, weight and cache group.

A tenants file is TOML (read with ``tomllib``)::

    [admin]                        # keys that may read every tenant's usage and flush caches
    key_sha256 = ["9f86d0..."]

    [tenants.browser]
    key_sha256 = ["5e8848..."]     # SHA-256 (hex) of each API key; keys themselves are never stored
    models = ["*"]                 # models this tenant may use: served names, aliases or globs ("*": any)
    requests_per_minute = 60
    prompt_tokens_per_minute = 200000
    completion_tokens_per_minute = 20000
    max_concurrent = 4             # requests in flight at once
    max_queued = 32                # requests waiting for admission; more get 429
    max_tokens = 2048              # largest max_tokens a request may ask for
    weight = 1.0                   # fair-share weight
    cache_group = "browser"        # prefix-cache namespace; tenants in one group share
    cache_bytes = "2G"             # byte quota of the cache group (optional)
    priority = "interactive"       # latency class: interactive, standard (default) or batch
    origins = ["chrome-extension://abcdefghijklmnopabcdefghijklmnop"]   # keys only from these Origins
    allow_no_origin = false        # with origins: also accept requests without an Origin header
    adapters = ["support", "team-*"]   # LoRA adapters it may use (names or globs; absent: as models says)
    default_adapter = "support"    # requests naming this adapter's base model (or no model) run under it
    manage_adapters = true         # may POST /v1/load_lora_adapter and /v1/unload_lora_adapter (its adapters)

Every limit is optional (absent: unlimited). ``mlx-gateway keys new TENANT`` prints a
new key and the line to paste.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from gateway.config import parse_size, read_toml
from gateway.http.origins import check_pattern, patterns_of

# A group's draft-model rows are kept under "<group>/draft" (scheduler.speculative.draft_snapshots.SUFFIX,
# not imported here: that would load MLX), so no group may be named so.
DRAFT_GROUP = "/draft"

KEY_PREFIX = "mgw-"
OPEN_TENANT = "default"

_TENANT_FIELDS = {"key_sha256", "models", "requests_per_minute", "prompt_tokens_per_minute",
                  "completion_tokens_per_minute", "max_concurrent", "max_queued", "max_tokens", "weight", "cache_group",
                  "cache_bytes", "priority", "origins", "allow_no_origin", "image_tokens_per_minute", "adapters",
                  "default_adapter", "manage_adapters"}
# Latency classes, served in this order (scheduler.admission.policy); the index is the engine's priority.
PRIORITIES = ("interactive", "standard", "batch")


class TenantsFileError(ValueError):
    """The tenants file is missing, not TOML, or has an invalid entry (the message says which)."""


@dataclass(frozen=True)
class Tenant:
    """One tenant's settings. Limits of None are unlimited.

    Attributes:
        name: the tenant's name (a metrics label: bounded, from configuration only).
        key_hashes: SHA-256 digests (32 bytes each) of its API keys.
        models: the model names it may use: served names, aliases or ``fnmatch`` globs
            (``"coder-*"``); None means any.
        requests_per_minute, prompt_tokens_per_minute, completion_tokens_per_minute:
            token-bucket rates (bucket capacity = one minute's worth).
        max_concurrent: requests in flight at once.
        max_queued: requests waiting for admission in the scheduler.
        max_tokens: the largest ``max_tokens`` a request may ask for.
        weight: fair-share weight (> 0).
        cache_group: the prefix-cache namespace.
        cache_bytes: byte quota of ``cache_group`` (None: only the global bound).
        priority: its latency class, one of :data:`PRIORITIES`; a request may ask for a
            lower one, never a higher one.
        origins: the browser origins (``Origin`` header values, e.g.
            ``chrome-extension://<id>``, or Ollama's patterns with one ``*``:
            :mod:`gateway.http.origins`) its keys are accepted from; None: any.
        allow_no_origin: with ``origins``, also accept requests that send no ``Origin``
            (programs other than browsers).
        adapters: the LoRA adapters it may use (names or globs); None: those :attr:`models`
            allows.
        default_adapter: the adapter its requests naming that adapter's base model (or no
            model) run under; None: they run on the base.
        manage_adapters: may load and unload (the adapters it may use) at run time.
        admin: may read every tenant's usage and flush cache groups.
    """

    name: str
    key_hashes: tuple[bytes, ...] = ()
    models: Optional[tuple[str, ...]] = None
    requests_per_minute: Optional[int] = None
    prompt_tokens_per_minute: Optional[int] = None
    completion_tokens_per_minute: Optional[int] = None
    image_tokens_per_minute: Optional[int] = None  # prompt tokens standing for images (docs/vision.md)
    max_concurrent: Optional[int] = None
    max_queued: Optional[int] = None
    max_tokens: Optional[int] = None
    weight: float = 1.0
    cache_group: str = OPEN_TENANT
    cache_bytes: Optional[int] = None
    priority: str = "standard"
    origins: Optional[tuple[str, ...]] = None
    allow_no_origin: bool = False
    adapters: Optional[tuple[str, ...]] = None
    default_adapter: Optional[str] = None
    manage_adapters: bool = False
    admin: bool = False

    def origin_allowed(self, origin: Optional[str]) -> bool:
        """Whether this tenant's keys are accepted from a request with ``Origin: origin``
        (None: the request sent none)."""
        if self.origins is None:
            return True
        return self.allow_no_origin if origin is None else patterns_of(frozenset(self.origins)).match(origin)

    def may_use(self, name: str) -> bool:
        """Whether this tenant may use the model name ``name`` (a served name or an alias):
        some entry of :attr:`models` is that name, or a glob matching it."""
        return self.models is None or any(fnmatch.fnmatchcase(name, p) for p in self.models)

    def may_use_adapter(self, name: str) -> bool:
        """Whether this tenant may use the LoRA adapter ``name``: its default adapter, one
        :attr:`adapters` names (or a glob of it matches), or, without :attr:`adapters`, one
        :attr:`models` allows."""
        if name == self.default_adapter:
            return True
        if self.adapters is None:
            return self.may_use(name)
        return any(fnmatch.fnmatchcase(name, p) for p in self.adapters)


@dataclass
class TenantTable:
    """All tenants, looked up by API key.

    ``open_tenant`` (when set) serves requests that carry no key, or any key: the
    gateway then runs unauthenticated. ``admin_hashes`` are keys of the admin, who is
    not a tenant and may not run completions unless the key is also a tenant's.
    """

    tenants: dict[str, Tenant] = field(default_factory=dict)
    admin_hashes: tuple[bytes, ...] = ()
    open_tenant: Optional[Tenant] = None
    source: Optional[Path] = None

    @property
    def requires_key(self) -> bool:
        return self.open_tenant is None

    def authenticate(self, key: Optional[str]) -> tuple[Optional[Tenant], bool]:
        """(tenant, is_admin) for ``key``; (None, False) for a missing or unknown key.

        The key's SHA-256 is compared with every stored digest by
        ``hmac.compare_digest`` and without early exit, so the time taken does not
        depend on which digest (if any) matched.
        """
        if self.open_tenant is not None:
            return self.open_tenant, self.open_tenant.admin
        if not key:
            return None, False
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found: Optional[Tenant] = None
        admin = False
        for tenant in self.tenants.values():
            for h in tenant.key_hashes:
                if hmac.compare_digest(digest, h):
                    found = tenant
        for h in self.admin_hashes:
            if hmac.compare_digest(digest, h):
                admin = True
        return found, admin

    def all(self) -> list[Tenant]:
        """Every tenant (the open tenant alone in open mode)."""
        return [self.open_tenant] if self.open_tenant is not None else list(self.tenants.values())

    def origins(self) -> frozenset[str]:
        """Every origin some tenant's keys are bound to (each one a CORS-allowed origin)."""
        return frozenset(o for t in self.all() for o in (t.origins or ()))

    def quotas(self) -> dict[str, int]:
        """Byte quota per cache group (groups without one are absent)."""
        return {t.cache_group: t.cache_bytes for t in self.all() if t.cache_bytes is not None}


def hash_key(key: str) -> str:
    """The SHA-256 hex digest stored for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A new random API key: ``mgw-`` and 43 URL-safe characters (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def open_table(loopback: bool) -> TenantTable:
    """One open tenant that needs no key; it is admin only when serving on loopback."""
    return TenantTable(open_tenant=Tenant(OPEN_TENANT, admin=loopback))


def single_key_table(api_key: str) -> TenantTable:
    """One tenant (``default``) with the key ``api_key``, which is also the admin key."""
    h = hashlib.sha256(api_key.encode()).digest()
    return TenantTable(tenants={OPEN_TENANT: Tenant(OPEN_TENANT, key_hashes=(h,))}, admin_hashes=(h,))


def _size(value, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError:
            pass
    raise TenantsFileError(f"{where}: expected a byte size such as 2G, got {value!r}")


def _digests(values, where: str) -> tuple[bytes, ...]:
    if not isinstance(values, list):
        raise TenantsFileError(f"{where}: key_sha256 must be a list of hex digests")
    out = []
    for v in values:
        try:
            d = bytes.fromhex(v) if isinstance(v, str) else b""
        except ValueError:
            d = b""
        if len(d) != 32:
            raise TenantsFileError(f"{where}: {v!r} is not a SHA-256 hex digest (64 hex digits)")
        out.append(d)
    return tuple(out)


def _positive(spec: dict, name: str, where: str, kind=int):
    v = spec.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)) or v <= 0:
        raise TenantsFileError(f"{where}: {name} must be a positive {kind.__name__}, got {v!r}")
    return kind(v)


def _tenant(name: str, spec, admin_hashes: tuple[bytes, ...]) -> Tenant:
    where = f"tenants.{name}"
    if not isinstance(spec, dict):
        raise TenantsFileError(f"{where}: expected a table")
    unknown = set(spec) - _TENANT_FIELDS
    if unknown:
        raise TenantsFileError(f"{where}: unknown settings {sorted(unknown)}")
    hashes = _digests(spec.get("key_sha256", []), where)
    models = spec.get("models", ["*"])
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise TenantsFileError(f"{where}: models must be a list of names")
    group = spec.get("cache_group", name)
    if not isinstance(group, str) or not group:
        raise TenantsFileError(f"{where}: cache_group must be a non-empty string")
    if group.endswith(DRAFT_GROUP):
        raise TenantsFileError(f"{where}: cache_group must not end in {DRAFT_GROUP!r} (a group's draft-model rows "
                               "are kept under that name)")
    priority = spec.get("priority", "standard")
    if priority not in PRIORITIES:
        raise TenantsFileError(f"{where}: priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    origins = spec.get("origins")
    if origins is not None and (not isinstance(origins, list) or not all(isinstance(o, str) and o for o in origins)):
        raise TenantsFileError(f"{where}: origins must be a list of origins such as 'chrome-extension://<id>'")
    try:
        origins = None if origins is None else [check_pattern(o) for o in origins]
    except ValueError as e:
        raise TenantsFileError(f"{where}: origins: {e}") from e
    allow_no_origin = spec.get("allow_no_origin", False)
    if not isinstance(allow_no_origin, bool):
        raise TenantsFileError(f"{where}: allow_no_origin must be true or false")
    adapters = spec.get("adapters")
    if adapters is not None and (not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters)):
        raise TenantsFileError(f"{where}: adapters must be a list of LoRA adapter names")
    default_adapter = spec.get("default_adapter")
    if default_adapter is not None and (not isinstance(default_adapter, str) or not default_adapter):
        raise TenantsFileError(f"{where}: default_adapter must be a LoRA adapter's name")
    manage = spec.get("manage_adapters", False)
    if not isinstance(manage, bool):
        raise TenantsFileError(f"{where}: manage_adapters must be true or false")
    counts = ("requests_per_minute", "prompt_tokens_per_minute", "completion_tokens_per_minute",
              "image_tokens_per_minute", "max_concurrent", "max_queued", "max_tokens")
    return Tenant(name=name, key_hashes=hashes, models=None if "*" in models else tuple(models),
                  **{k: _positive(spec, k, where) for k in counts},
                  weight=_positive(spec, "weight", where, float) or 1.0, cache_group=group,
                  cache_bytes=_size(spec["cache_bytes"], where) if "cache_bytes" in spec else None, priority=priority,
                  origins=tuple(o.rstrip("/") for o in origins) if origins is not None else None,
                  allow_no_origin=allow_no_origin, adapters=None if adapters is None else tuple(adapters),
                  default_adapter=default_adapter, manage_adapters=manage,
                  admin=bool(set(hashes) & set(admin_hashes)))


def load_tenants(path: str | Path) -> TenantTable:
    """Read and validate a tenants file.

    Raises:
        TenantsFileError: unreadable file, bad TOML, unknown or invalid settings, a
            key shared by two tenants, or two tenants of one cache group with
            different ``cache_bytes``.
    """
    path = Path(path)
    data = read_toml(path, TenantsFileError)
    unknown = set(data) - {"admin", "tenants"}
    if unknown:
        raise TenantsFileError(f"unknown sections {sorted(unknown)}; expected [admin] and [tenants.NAME]")
    admin = data.get("admin", {})
    admin_hashes = _digests(admin.get("key_sha256", []), "admin") if isinstance(admin, dict) else ()
    specs = data.get("tenants", {})
    if not isinstance(specs, dict) or not specs:
        raise TenantsFileError("the file defines no [tenants.NAME] table")
    tenants = {name: _tenant(name, spec, admin_hashes) for name, spec in specs.items()}
    owner: dict[bytes, str] = {}
    quota: dict[str, int] = {}
    for t in tenants.values():
        for h in t.key_hashes:
            if h in owner:
                raise TenantsFileError(f"a key of tenants.{t.name} is also a key of tenants.{owner[h]}")
            owner[h] = t.name
        if t.cache_bytes is not None:
            if quota.setdefault(t.cache_group, t.cache_bytes) != t.cache_bytes:
                raise TenantsFileError(f"cache group {t.cache_group!r} has two different cache_bytes")
    return TenantTable(tenants=tenants, admin_hashes=admin_hashes, source=path)
