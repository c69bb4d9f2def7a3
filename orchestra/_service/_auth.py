"""Who may do what: bearer tokens with a role, checked by a FastAPI dependency.

``Depends(require("read"))`` on a route (or a router) refuses a request without a token or with
one the database does not know or has revoked (401, with ``WWW-Authenticate: Bearer``), and one
whose role does not allow the route (403); ``admin`` is allowed everything. FastAPI's `HTTPBearer`
reads the header and publishes the scheme in the OpenAPI document. A token the database found live
is trusted for a few seconds without asking it again (`_tokens.Verified`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ._errors import Refused
from ._tokens import ROLES, TokenInfo

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._state import Service

__all__ = ("bearer", "require")

bearer = HTTPBearer(
    auto_error=False,
    description="A token made with `orchestra tokens create --role ROLE`.",
)

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def require(role: str) -> Callable[..., Awaitable[TokenInfo]]:
    """A dependency that lets through only a live token whose role is `role` (or admin), and
    gives the route the token's record."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")

    async def allowed(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> TokenInfo:
        if credentials is None:
            raise Refused(
                401,
                "unauthorized",
                "this endpoint needs a bearer token: send 'Authorization: Bearer TOKEN' "
                "(make one with `orchestra tokens create --role ROLE`)",
                headers=_CHALLENGE,
            )
        service: Service = request.app.state.service
        token = await service.verified.find(credentials.credentials)
        if token is None or token.revoked is not None:
            raise Refused(
                401,
                "unauthorized",
                "the bearer token is not known to this service, or was revoked: make a new "
                "one with `orchestra tokens create --role ROLE`",
                headers=_CHALLENGE,
            )
        if not token.allows(role):
            raise Refused(
                403,
                "forbidden",
                f"token {token.id!r} has the role {token.role!r}; this endpoint needs "
                f"{role!r} (or admin)",
            )
        return token

    allowed.__name__ = f"require_{role}"
    return allowed
