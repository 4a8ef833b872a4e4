"""Admin authentication, adapter id validation and the adapter-source allowlist."""

from __future__ import annotations

import hmac
import re

from fastapi import Request

from loraplane_server.http.errors import ApiError
from loraplane_server.sources import AdapterSource, AdapterSourceError, is_allowed, parse_source

# a plain name: it can never name a path outside a directory
ADAPTER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_ADAPTER_ID = re.compile(ADAPTER_ID_PATTERN)


def is_valid_adapter_id(adapter_id: str) -> bool:
    return bool(_ADAPTER_ID.fullmatch(adapter_id)) and ".." not in adapter_id


def check_adapter_id(adapter_id: str, param: str) -> str:
    """The id itself, or a 400 that says what an id may hold."""
    if not is_valid_adapter_id(adapter_id):
        raise ApiError(
            400,
            f"invalid adapter id {adapter_id[:200]!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'",
            param=param,
            code="invalid_adapter_id",
        )
    return adapter_id


def check_source(uri: str, allow: list[str], param: str) -> AdapterSource:
    """Parse an adapter source (400 if malformed) and check it against the allowlist (403)."""
    try:
        source = parse_source(uri)
    except AdapterSourceError as exc:
        raise ApiError(400, str(exc), param=param, code="invalid_adapter_source") from exc
    if not is_allowed(source, allow):
        raise ApiError(
            403,
            f"adapter source {source.uri!r} is not allowed on this server (allowed: "
            f"{', '.join(allow)}; see --adapter-source-allow)",
            param=param,
            code="source_not_allowed",
        )
    if source.kind == "local" and source.path is not None and not source.path.is_dir():
        # checked after the allowlist, so nobody learns what exists outside it; a source that cannot load
        # is refused now, not turned into a failed load that a caller (or the operator) must poll for
        raise ApiError(
            400,
            f"adapter directory {source.uri} does not exist on this server",
            param=param,
            code="adapter_source_missing",
        )
    return source


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def is_admin(request: Request) -> bool:
    """Whether the caller may use the admin routes: no admin token is set, or it sent the right one."""
    expected = request.app.state.server.config.admin_token
    if expected is None:
        return True
    given = bearer_token(request)
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def can_load_adapters(request: Request) -> bool:
    """Whether the caller may register a new adapter from a generation route (LoRAX adapter_source, an
    org/repo adapter_id): an admin, or anyone under --allow-anonymous-adapter-load."""
    return is_admin(request) or request.app.state.server.config.allow_anonymous_adapter_load


def unauthorized(message: str, param: str | None = None) -> ApiError:
    return ApiError(401, message, param=param, code="unauthorized", headers={"WWW-Authenticate": "Bearer"})


def require_admin(request: Request) -> None:
    """FastAPI dependency: a valid `Authorization: Bearer <token>` when the server has an admin token."""
    if not is_admin(request):
        raise unauthorized("this route needs the admin token: Authorization: Bearer <token>")
