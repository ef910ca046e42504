"""Who is looking at the dashboard, and what they may do.

The keys are serve's: ``[serve] api_keys`` read (and submit, on the API), ``admin_api_keys`` also change things
here (replay, discard, cancel). A caller proves a key two ways:

- ``Authorization: Bearer <key>`` (scripts, tests): no cookie, so no CSRF token is needed;
- the sign-in form, which stores a session in Redis (``Keys.dashboard_session``: the SHA-256 of a random token ->
  the key's account and the session's CSRF token) and sets the token as an HttpOnly, SameSite=Strict cookie, so
  every replica knows the session. Its role is looked up from the keys configured now, on every request: a key
  removed from the settings ends its sessions. A change sent with the cookie must carry the session's CSRF token
  (``X-CSRF-Token`` header or ``csrf`` form field: the synchronizer token pattern).

Without any key configured (serve's "no authentication"), everyone is an admin, as on the API; changes still need the
CSRF token of a ``tm_csrf`` cookie (double submit), so another site cannot make a browser send them. With
``dashboard_public`` everyone may read, and only a key may change anything.

Imports fastapi and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from typing import Literal, cast

from fastapi import Request

from tokenmill.protocol.config import ServeConfig
from tokenmill.serve.dashboard.state import DashboardState, dashboard_of
from tokenmill.serve.guard import ANONYMOUS, account_of_key

SESSION_COOKIE = "tm_session"
CSRF_COOKIE = "tm_csrf"
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf"
COOKIE_PATH = "/dashboard"

Role = Literal["admin", "read"]
Via = Literal["bearer", "session", "open", "public"]


@dataclass(frozen=True)
class Viewer:
    """The caller: its role, the account (hash of its key) it acts as, how it proved it, and its CSRF token."""

    role: Role
    account: str
    via: Via
    csrf: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def actor(self) -> str:
        """How the change log names the caller: a prefix of its account (never the key)."""
        return self.account[:12] if self.via in ("bearer", "session") else self.via


class NotAllowed(Exception):
    """A change the caller may not make: 403 (a read-only key, or a missing CSRF token)."""


def role_of_key(config: ServeConfig, key: str) -> Role | None:
    """The role ``key`` gives; None when it is no configured key.

    NOTE: compare_digest against every key, not a set lookup: the time taken says nothing of a key.
    """
    is_admin = any(hmac.compare_digest(key, admin) for admin in config.admin_api_keys)
    is_reader = any(hmac.compare_digest(key, reader) for reader in config.api_keys)
    return "admin" if is_admin else "read" if is_reader else None


def role_of_account(config: ServeConfig, account: str) -> Role | None:
    if any(account_of_key(key) == account for key in config.admin_api_keys):
        return "admin"
    return "read" if any(account_of_key(key) == account for key in config.api_keys) else None


def has_keys(config: ServeConfig) -> bool:
    return bool(config.api_keys or config.admin_api_keys)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


async def viewer_of(request: Request) -> Viewer | None:
    """The caller, or None (answer 401). A wrong Bearer key is None even on a public dashboard."""
    state = dashboard_of(request)
    config = state.settings.serve
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme:
        role = role_of_key(config, given.strip()) if scheme.lower() == "bearer" else None
        return None if role is None else Viewer(role, account_of_key(given.strip()), "bearer")
    token = request.cookies.get(SESSION_COOKIE)
    if token and has_keys(config):
        session = await _session(state, token)
        if session is not None:
            role = role_of_account(config, session["account"])
            if role is not None:
                return Viewer(role, session["account"], "session", session["csrf"])
    if not has_keys(config):
        return Viewer("admin", ANONYMOUS, "open", request.cookies.get(CSRF_COOKIE))
    if config.dashboard_public:
        return Viewer("read", "public", "public")
    return None


async def _session(state: DashboardState, token: str) -> dict[str, str] | None:
    raw = await state.client.get(state.layout.home.dashboard_session(_digest(token)))
    try:
        session = json.loads(raw) if raw is not None else None
    except ValueError:  # anyone may write to Redis: a garbled session is no session
        return None
    if not isinstance(session, dict) or not isinstance(session.get("account"), str):
        return None
    return cast("dict[str, str]", session)


async def sign_in(state: DashboardState, key: str) -> str | None:
    """A new session for ``key``: its cookie token, or None when the key is none of the configured ones."""
    if role_of_key(state.settings.serve, key) is None:
        return None
    token = secrets.token_urlsafe(32)
    session = {"account": account_of_key(key), "csrf": secrets.token_urlsafe(24)}
    ttl_s = int(state.settings.serve.dashboard_session_ttl_s)
    await state.client.set(state.layout.home.dashboard_session(_digest(token)), json.dumps(session), ex=ttl_s)
    return token


async def sign_out(state: DashboardState, token: str | None) -> None:
    if token:
        await state.client.delete(state.layout.home.dashboard_session(_digest(token)))


def check_change(viewer: Viewer, request: Request, form_token: str | None = None) -> None:
    """Refuse a change the caller may not make.

    Raises:
        NotAllowed: not an admin, or a cookie (or open) caller without the matching CSRF token.
    """
    if not viewer.is_admin:
        raise NotAllowed("this needs a key with the admin role ([serve] admin_api_keys)")
    if viewer.via == "bearer":
        return
    given = request.headers.get(CSRF_HEADER) or form_token or ""
    if not viewer.csrf or not hmac.compare_digest(given, viewer.csrf):
        raise NotAllowed("missing or wrong CSRF token (reload the page)")


def is_secure(request: Request) -> bool:
    return request.url.scheme == "https"
