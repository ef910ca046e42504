"""Rendering the dashboard's pages: the Jinja2 templates and the filters they use, the sign-in page, and the headers
every dashboard answer carries (no caching, a strict Content-Security-Policy: the page runs only the package's own
script and styles, loads nothing from elsewhere, and cannot be framed).

Imports fastapi (starlette's Jinja2Templates); never torch, the engine or the worker.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.templating import Jinja2Templates

from tokenmill.serve.dashboard import charts
from tokenmill.serve.dashboard.auth import Viewer

HERE = Path(__file__).resolve().parent
SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
}


def duration(seconds: float | None) -> str:
    """``45s``, ``3m 05s``, ``2h 04m``, ``3d 1h``; ``-`` for None."""
    if seconds is None:
        return "-"
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    if seconds < 86_400:
        return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    return f"{seconds // 86_400}d {seconds % 86_400 // 3600}h"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def clock(unix_s: float | None) -> str:
    return "-" if unix_s is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_s))


templates = Jinja2Templates(directory=HERE / "templates")
templates.env.filters.update(compact=charts.compact, duration=duration, percent=percent, clock=clock)
templates.env.globals.update(line_chart=charts.line_chart, sparkline=charts.sparkline)


def secured(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response


def page(request: Request, template: str, viewer: Viewer, context: dict[str, Any], *, refresh_s: float = 3.0,
         status_code: int = 200) -> Response:
    """A page, or with ``?partial=1`` only its live part (what the script swaps in on each refresh)."""
    is_partial = request.query_params.get("partial") == "1"
    response = templates.TemplateResponse(request, template, {
        **context, "viewer": viewer, "partial": is_partial, "refresh_s": refresh_s,
        "queue": context.get("queue") or request.app.state.dashboard.layout.home.base}, status_code=status_code)
    return secured(response)


def sign_in_page(request: Request, *, status_code: int, error: str | None = None) -> Response:
    target = request.query_params.get("next") or request.url.path
    if target.startswith("/dashboard/login") or target.startswith("/dashboard/logout"):
        target = "/dashboard"
    return secured(templates.TemplateResponse(request, "login.html", {
        "error": error, "next": target if target.startswith("/dashboard") else "/dashboard"},
        status_code=status_code))


def error_json(status_code: int, message: str, code: str) -> Response:
    return secured(JSONResponse({"error": {"message": message, "type": "dashboard_error", "code": code}},
                                status_code=status_code))


def error_page(request: Request, viewer: Viewer, status_code: int, message: str) -> Response:
    return page(request, "error.html", viewer, {"message": message, "title": str(status_code)},
                refresh_s=0, status_code=status_code)


def html(text: str, status_code: int = 200) -> Response:
    return secured(HTMLResponse(text, status_code=status_code))
