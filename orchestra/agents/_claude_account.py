"""`ClaudeAccount`: one API key, its client and its `ClaudeLimits` per model family, shared by every
Claude agent given it; and the refusal hold a 401 puts on the key."""

from __future__ import annotations

import hashlib
import os
import weakref
from typing import TYPE_CHECKING, Final

from anthropic import AsyncAnthropic

from .._exceptions import ConfigError
from .._failure import api_error_type
from .._limits import CLOCK_SLIP
from ._claude_limits import ClaudeLimits, model_family
from ._claude_prices import PRICES, Price, check_prices

if TYPE_CHECKING:
    from collections.abc import Mapping

    from anthropic import APIStatusError

__all__ = ("ClaudeAccount",)

_REFUSAL_HOLD: Final = 60.0  # seconds a key the API answered 401 sends nothing (`ClaudeAccount`)


class ClaudeAccount:
    """One API key: its client, with `max_retries=0` so orchestra's policy is the only retry, and
    its `ClaudeLimits` per model family, shared by every agent given this account.

    `ClaudeAccount.shared(...)` is the account of a key in this process: an agent built without
    `account=` or `client=` uses it, so every agent on one key shares one client and one budget per
    family by default; `ClaudeAccount.of(client)` is the account of one client, which agents given
    that `client=` share. (These are the registries kept per process on purpose: the API's budget
    is per key, not per orchestrator; two orchestrators on one key really do share it.)

    Args:
        api_key: the key; default: the ``ANTHROPIC_API_KEY`` environment variable.
        client: an `AsyncAnthropic` of your own (a copy with `max_retries=0` is used if it retries).
        base_url: the API's address (a proxy, a fake API in tests).
        limits: `ClaudeLimits` by model family (``"sonnet-4"``: see `model_family`; a model id
            stands for its family); families not given start at the defaults and follow the
            server's headers.
        prices: price rows that override or extend `PRICES`.
    """

    __slots__ = ("__weakref__", "_given", "_limits", "_refused", "client", "prices")

    def __init__(
        self,
        *,
        api_key: str | None = None,
        client: AsyncAnthropic | None = None,
        base_url: str | None = None,
        limits: Mapping[str, ClaudeLimits] | None = None,
        prices: Mapping[str, Price] | None = None,
    ) -> None:
        # The client it was made around (None: its own); `of` finds the account by it, and the
        # account keeps it alive so that no other object takes its id meanwhile.
        self._given = client
        if client is None:
            client = AsyncAnthropic(api_key=api_key, base_url=base_url, max_retries=0)
            if not _has_credentials(client):
                # Else the first request fails (a TypeError of the SDK), and every retry with it.
                raise ConfigError(
                    "ClaudeAccount: no API key: pass api_key= or client=, or set ANTHROPIC_API_KEY"
                )
        elif not isinstance(client, AsyncAnthropic):
            raise ConfigError(f"ClaudeAccount: client must be an AsyncAnthropic, got {client!r}")
        elif client.max_retries != 0:
            client = client.with_options(max_retries=0)  # shares the connection pool
        # Keyed by family; a model id is taken for its family (else its budget would go unused).
        self._limits: dict[str, ClaudeLimits] = {}
        named: dict[str, str] = {}
        for key, value in (limits or {}).items():
            if not isinstance(value, ClaudeLimits):
                raise ConfigError(
                    f"ClaudeAccount: limits[{key!r}] must be a ClaudeLimits, got {value!r}"
                )
            family = model_family(key)
            if family in named and self._limits[family] is not value:
                raise ConfigError(
                    f"ClaudeAccount: limits[{named[family]!r}] and limits[{key!r}]: one family"
                    f" ({family!r}) shares one budget; give one ClaudeLimits for it"
                )
            named[family] = key
            self._limits[family] = value
        check_prices("ClaudeAccount: prices", prices)
        self.client = client
        self.prices: Mapping[str, Price] = {**PRICES, **(prices or {})}
        # (when, why): the API answered 401 to this key. A 401 is about the key, not the
        # request: every other request on it would be paid for nothing (a run of 10,000 tasks
        # sent 10,000), so they fail unsent for `_REFUSAL_HOLD` seconds, then one tries again
        # (a client's credentials provider may have renewed an expired token meanwhile). One
        # seen at a time more than `CLOCK_SLIP` ahead of the asker's is another clock's (a
        # FakeClock's, of an earlier test on a shared account): it holds nothing.
        self._refused: tuple[float, str] | None = None

    def refusal(self, now: float) -> str | None:
        """Why a request on this key is not sent now: the API refused the key within the last
        `_REFUSAL_HOLD` seconds (None: send it)."""
        refused = self._refused
        if refused is None or not refused[0] - CLOCK_SLIP <= now < refused[0] + _REFUSAL_HOLD:
            return None
        return refused[1]

    def refused(self, exc: APIStatusError, now: float) -> None:
        """The API answered `exc` (a 401): hold the key's other requests."""
        self._refused = (
            now,
            f"the API refused this key ({exc.status_code} {api_error_type(exc)}, request"
            f" {exc.request_id or '?'}); requests on it are not sent for {_REFUSAL_HOLD:g}s"
            " after a refusal",
        )

    @classmethod
    def shared(cls, *, api_key: str | None = None, base_url: str | None = None) -> ClaudeAccount:
        """The account of `api_key` (default: ``ANTHROPIC_API_KEY``) at `base_url` in this process,
        made on first use. Kept while some agent holds it."""
        key = api_key if api_key is not None else os.environ.get("ANTHROPIC_API_KEY", "")
        # The registry is keyed by a digest: the key itself is never kept outside the client.
        ident = (hashlib.sha256(key.encode()).hexdigest(), base_url or "")
        account = _ACCOUNTS.get(ident)
        if account is None:
            account = _ACCOUNTS[ident] = cls(api_key=api_key, base_url=base_url)
        return account

    @classmethod
    def of(cls, client: AsyncAnthropic) -> ClaudeAccount:
        """The account of `client` in this process, made on first use: every agent given the
        same `client=` shares it (its limits, its 429 and 401 holds). Kept while some agent
        holds it."""
        account = _CLIENT_ACCOUNTS.get(id(client))
        if account is None or account._given is not client:
            account = cls(client=client)
            _CLIENT_ACCOUNTS[id(client)] = account
        return account

    def limits(self, model: str) -> ClaudeLimits:
        """The limits of `model`'s family on this key (made with the defaults on first use)."""
        family = model_family(model)
        limits = self._limits.get(family)
        if limits is None:
            limits = self._limits[family] = ClaudeLimits()
        return limits

    async def aclose(self) -> None:
        """Close the client's connections."""
        await self.client.close()

    def __repr__(self) -> str:
        return f"ClaudeAccount(families={sorted(self._limits)!r})"


def _has_credentials(client: AsyncAnthropic) -> bool:
    """Whether `client` can authenticate a request: an API key or a token in its headers (or the
    Authorization header omitted on purpose), or a credentials provider (the SDK's own test)."""
    headers = {name.lower() for name in client.default_headers}
    return bool(headers & {"x-api-key", "authorization"}) or (
        getattr(client, "_token_cache", None) is not None
    )


_ACCOUNTS: weakref.WeakValueDictionary[tuple[str, str], ClaudeAccount] = (
    weakref.WeakValueDictionary()
)
# By the id of the client an account was made around (`ClaudeAccount.of`): an entry lives as long
# as its account, which holds the client, so the id is that client's for as long.
_CLIENT_ACCOUNTS: weakref.WeakValueDictionary[int, ClaudeAccount] = weakref.WeakValueDictionary()


ClaudeAccount.__module__ = "orchestra.agents"
