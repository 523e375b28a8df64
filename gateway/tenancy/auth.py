"""Authentication: API keys from ``Authorization: Bearer`` or ``x-api-key``."""

from __future__ import annotations

from typing import Optional

from starlette.requests import Request

from gateway.http.errors import APIError
from gateway.tenancy.tenants import Tenant, TenantTable


def api_key(request: Request) -> Optional[str]:
    """The key the client sent: ``Authorization: Bearer KEY``, else ``x-api-key: KEY``."""
    auth = request.headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    key = request.headers.get("x-api-key", "").strip()
    return key or None


def _unauthorized(key: Optional[str]) -> APIError:
    msg = ("no API key given: send 'Authorization: Bearer KEY'" if key is None else "the API key is not valid")
    return APIError(401, msg, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def identify(table: TenantTable, request: Request) -> tuple[Optional[Tenant], bool]:
    """(tenant, is_admin) of the caller; the tenant, when there is one, is recorded in
    ``request.state.tenant`` for metrics and logs.

    Raises:
        APIError: 401 for a missing key, or a key that is neither a tenant's nor an admin's;
            403 ``origin_not_allowed`` for a tenant's valid key sent from a browser origin
            its ``origins`` do not list (or with no ``Origin`` unless ``allow_no_origin``).
    """
    key = api_key(request)
    tenant, admin = table.authenticate(key)
    if tenant is not None:
        request.state.tenant = tenant
        admin = admin or tenant.admin
        origin = request.headers.get("origin")
        if not tenant.origin_allowed(origin.rstrip("/") if origin else None):
            raise APIError(403, f"this key may not be used from the origin {origin!r}" if origin else
                           "this key may only be used from the browser origins it is bound to",
                           code="origin_not_allowed")
    elif not admin:
        raise _unauthorized(key)
    return tenant, admin


def authenticate(table: TenantTable, request: Request) -> Tenant:
    """The calling tenant (see :func:`identify`).

    Raises:
        APIError: 401 for a missing or unknown key, or an admin key that is no tenant's
            (its message says so: admin keys may not generate).
    """
    tenant, _ = identify(table, request)
    if tenant is None:  # an admin key that is no tenant's (identify refused every other key)
        raise APIError(401, f"this is an admin key: it may use /admin/... and /v1/usage but not "
                       f"{request.url.path}: use a tenant's key to generate",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return tenant


def authenticate_admin(table: TenantTable, request: Request) -> Optional[Tenant]:
    """Check that the caller holds an admin key; returns its tenant, if the key is also one.

    Raises:
        APIError: 401 for a missing or unknown key, 403 for a tenant key without admin rights.
    """
    tenant, admin = identify(table, request)
    if not admin:
        raise APIError(403, "this key may not use the admin API", code="permission_denied")
    return tenant
