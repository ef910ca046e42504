"""The dashboard's routes under ``/dashboard``: pages (server-rendered, refreshed in place by the script), their
data as JSON under ``/dashboard/api`` (scripts and tests), the sign-in form, and the changes (replay, discard,
cancel: POST, admin role, CSRF-safe). Without a key, every page and data route answers 401, the pages with the
sign-in form: no data, not even a lane's name.

Imports fastapi and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from tokenmill.protocol.connection import REDIS_ERRORS
from tokenmill.serve.dashboard import actions, reads
from tokenmill.serve.dashboard.auth import (
    COOKIE_PATH,
    CSRF_COOKIE,
    CSRF_FIELD,
    SESSION_COOKIE,
    NotAllowed,
    Viewer,
    check_change,
    is_secure,
    sign_in,
    sign_out,
    viewer_of,
)
from tokenmill.serve.dashboard.state import DashboardState, dashboard_of
from tokenmill.serve.dashboard.views import error_json, error_page, page, secured, sign_in_page

log = logging.getLogger("tokenmill.serve.dashboard")
router = APIRouter(prefix="/dashboard")
Read = Callable[[], Awaitable[dict[str, Any] | None]]


async def _viewer_with_csrf(request: Request) -> Viewer | None:
    viewer = await viewer_of(request)
    if viewer is not None and viewer.via == "open" and not viewer.csrf:
        viewer = Viewer(viewer.role, viewer.account, viewer.via, secrets.token_urlsafe(24))
    return viewer


def _with_csrf_cookie(request: Request, viewer: Viewer, response: Response) -> Response:
    """Open dashboards (no keys configured) keep their CSRF token in a cookie (double submit)."""
    if viewer.via == "open" and viewer.csrf and request.cookies.get(CSRF_COOKIE) != viewer.csrf:
        response.set_cookie(CSRF_COOKIE, viewer.csrf, httponly=True, samesite="strict", path=COOKIE_PATH,
                            secure=is_secure(request))
    return response


async def _show(request: Request, template: str, read: Read, *, refresh_s: float = 3.0,
                missing: str = "not found") -> Response:
    viewer = await _viewer_with_csrf(request)
    if viewer is None:
        return sign_in_page(request, status_code=401)
    try:
        data = await read()
    except REDIS_ERRORS as exc:
        return error_page(request, viewer, 503, f"Redis did not answer: {exc}")
    if data is None:
        return error_page(request, viewer, 404, missing)
    return _with_csrf_cookie(request, viewer, page(request, template, viewer, data, refresh_s=refresh_s))


async def _data(request: Request, read: Read, *, missing: str = "not found") -> Response:
    if await viewer_of(request) is None:
        return error_json(401, "a key is needed: Authorization: Bearer <key>, or sign in", "invalid_api_key")
    try:
        data = await read()
    except REDIS_ERRORS as exc:
        return error_json(503, f"Redis did not answer: {exc}", "redis_unavailable")
    if data is None:
        return error_json(404, missing, "not_found")
    return secured(JSONResponse(data))


# -- pages and their data ----------------------------------------------------------------------------------------

# What a page shows, read from Redis: from the dashboard's state and the request (its path and query parameters);
# None: nothing by that name.
View = Callable[[DashboardState, Request], Awaitable[dict[str, Any] | None]]


def _route_view(pages: tuple[str, ...], data: str, template: str, view: View, *, refresh_s: float = 3.0,
                missing: str = "not found") -> None:
    """Serve ``view`` at each of ``pages`` as a page (``template``, refreshed in place every ``refresh_s``) and at
    ``data`` as JSON. ``missing`` (the 404's message) is formatted with the path's parameters."""

    async def show_page(request: Request) -> Response:
        state = dashboard_of(request)
        return await _show(request, template, lambda: view(state, request), refresh_s=refresh_s,
                           missing=missing.format(**request.path_params))

    async def show_data(request: Request) -> Response:
        state = dashboard_of(request)
        return await _data(request, lambda: view(state, request), missing=missing.format(**request.path_params))

    for path in pages:
        router.add_api_route(path, show_page, methods=["GET"])
    router.add_api_route(data, show_data, methods=["GET"])


def _dead_letters(state: DashboardState, request: Request) -> Awaitable[dict[str, Any]]:
    query = request.query_params
    return reads.dead_page(state, reason=query.get("reason") or None, before=query.get("before") or None)


_route_view(("", "/"), "/api/overview", "overview.html", lambda state, _: reads.overview(state))
_route_view(("/workers",), "/api/workers", "workers.html", lambda state, _: reads.workers(state))
_route_view(("/workers/{name:path}",), "/api/workers/{name:path}", "worker.html",
            lambda state, request: reads.worker(state, request.path_params["name"]), missing="no worker {name!r}")
_route_view(("/jobs",), "/api/jobs", "jobs.html", lambda state, _: reads.jobs(state))
_route_view(("/jobs/{job_id:path}",), "/api/jobs/{job_id:path}", "job.html",
            lambda state, request: reads.job(state, request.path_params["job_id"]), refresh_s=1.0,
            missing="no job {job_id!r}")


@router.get("/requests")
async def find_request(request: Request) -> Response:
    """The search box: ``?id=...`` goes to that request's page."""
    request_id = (request.query_params.get("id") or "").strip()
    target = f"/dashboard/requests/{quote(request_id, safe='')}" if request_id else "/dashboard"
    return secured(RedirectResponse(target, status_code=303))


_route_view(("/requests/{request_id:path}",), "/api/requests/{request_id:path}", "request.html",
            lambda state, request: reads.request_info(state, request.path_params["request_id"],
                                                      deep=request.query_params.get("deep") == "1"), refresh_s=1.0)


@router.get("/dead")
async def dead_page(request: Request) -> Response:
    state = dashboard_of(request)

    async def read() -> dict[str, Any]:
        return {**await _dead_letters(state, request), "changes": await actions.recent(state)}

    return await _show(request, "dead.html", read, refresh_s=5.0)


@router.get("/api/dead")
async def dead_data(request: Request) -> Response:
    state = dashboard_of(request)
    return await _data(request, lambda: _dead_letters(state, request))


# -- signing in --------------------------------------------------------------------------------------------------

@router.get("/login")
async def login_form(request: Request) -> Response:
    return sign_in_page(request, status_code=200)


@router.post("/login")
async def login(request: Request) -> Response:
    form = await request.form()
    key, target = str(form.get("key") or "").strip(), str(form.get("next") or "/dashboard")
    state = dashboard_of(request)
    token = await sign_in(state, key) if key else None
    if token is None:
        log.warning("dashboard sign-in refused", extra={"event": "dashboard_sign_in_refused",
                                                         "client": request.client.host if request.client else None})
        return sign_in_page(request, status_code=401, error="That key is not accepted here.")
    response = RedirectResponse(target if target.startswith("/dashboard") else "/dashboard", status_code=303)
    response.set_cookie(SESSION_COOKIE, token, max_age=int(state.settings.serve.dashboard_session_ttl_s),
                        httponly=True, samesite="strict", path=COOKIE_PATH, secure=is_secure(request))
    log.info("dashboard sign-in", extra={"event": "dashboard_sign_in"})
    return secured(response)


@router.post("/logout")
async def logout(request: Request) -> Response:
    viewer = await viewer_of(request)
    form = await request.form()
    if viewer is not None and viewer.via == "session":
        try:
            check_change(Viewer("admin", viewer.account, viewer.via, viewer.csrf), request, str(form.get(CSRF_FIELD)))
        except NotAllowed as exc:
            return error_json(403, str(exc), "csrf")
        await sign_out(dashboard_of(request), request.cookies.get(SESSION_COOKIE))
    response = RedirectResponse("/dashboard/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH)
    return secured(response)


# -- changes -----------------------------------------------------------------------------------------------------

Change = Callable[[Viewer, dict[str, Any]], Awaitable[dict[str, Any]]]


async def _change(request: Request, change: Change) -> Response:
    """Run ``change`` for an admin caller whose request is CSRF-safe; the body is a JSON object."""
    viewer = await viewer_of(request)
    if viewer is None:
        return error_json(401, "a key is needed: Authorization: Bearer <key>, or sign in", "invalid_api_key")
    try:
        body = await request.json() if await request.body() else {}
    except ValueError:
        return error_json(400, "the body must be a JSON object", "invalid_body")
    if not isinstance(body, dict):
        return error_json(400, "the body must be a JSON object", "invalid_body")
    try:
        check_change(viewer, request, body.get(CSRF_FIELD))
    except NotAllowed as exc:
        return error_json(403, str(exc), "forbidden")
    try:
        return secured(JSONResponse(await change(viewer, body)))
    except REDIS_ERRORS as exc:
        return error_json(503, f"Redis did not answer: {exc}", "redis_unavailable")


def _dead_selection(body: dict[str, Any]) -> tuple[list[str], str | None] | None:
    ids, reason = body.get("ids"), body.get("reason")
    if reason is not None and not isinstance(reason, str):
        return None
    if reason is None and not (isinstance(ids, list) and ids and all(isinstance(i, str) for i in ids)):
        return None
    return (list(ids) if isinstance(ids, list) else []), reason


def _where(request: Request) -> str:
    return request.client.host if request.client else "-"


@router.post("/api/dead/replay")
async def replay(request: Request) -> Response:
    return await _change_dead_letters(request, actions.replay)


@router.post("/api/dead/discard")
async def discard(request: Request) -> Response:
    return await _change_dead_letters(request, actions.discard)


async def _change_dead_letters(request: Request, action: Any) -> Response:
    """Replay or discard (``action``) the dead letters the body names, by ids or by reason."""
    state = dashboard_of(request)

    async def change(viewer: Viewer, body: dict[str, Any]) -> dict[str, Any]:
        selection = _dead_selection(body)
        if selection is None:
            return {"error": "name the dead letters: {\"ids\": [...]} or {\"reason\": \"...\"}"}
        result: dict[str, Any] = await action(state, viewer, *selection, where=_where(request))
        return result

    return await _change(request, change)


@router.post("/api/requests/{request_id:path}/cancel")
async def cancel(request: Request, request_id: str) -> Response:
    state = dashboard_of(request)
    return await _change(request, lambda viewer, _: actions.cancel(state, viewer, request_id, where=_where(request)))
