"""Charts as plain SVG, drawn on the server: no charting library, no script, nothing fetched at run time. Colours
come from the page's CSS (``currentColor`` and classes), so dark mode and print follow the stylesheet.

Standard library and markupsafe (through jinja2) only.
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup, escape


def compact(value: float | None, unit: str = "") -> str:
    """``1.2k``, ``3.4M``, ``0.25``; ``-`` for None."""
    if value is None:
        return "-"
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.1f}{suffix}{unit}"
    if value == 0 or abs(value) >= 10:
        return f"{value:.0f}{unit}"
    return f"{value:.2g}{unit}"


def _points(values: Sequence[float | None], width: float, height: float, top: float,
            pad_y: float) -> list[list[tuple[float, float]]]:
    """Runs of consecutive known values as (x, y) points; a None breaks the line."""
    peak = max((v for v in values if v is not None), default=0.0) or 1.0
    step = width / max(1, len(values) - 1)
    runs: list[list[tuple[float, float]]] = [[]]
    for index, value in enumerate(values):
        if value is None:
            if runs[-1]:
                runs.append([])
            continue
        y = top + pad_y + (height - 2 * pad_y) * (1 - value / peak)
        runs[-1].append((round(index * step, 1), round(y, 1)))
    return [run for run in runs if run]


def line_chart(values: Sequence[float | None], *, title: str, unit: str, width: int = 600,
               height: int = 120) -> Markup:
    """An area chart of one value per minute (oldest first), with its peak labelled below (HTML, so the text is not
    stretched with the plot)."""
    runs = _points(values, width, height, 0.0, 4.0)
    known = [v for v in values if v is not None]
    peak = max(known, default=None)
    last = next((v for v in reversed(values) if v is not None), None)
    parts = [f'<div class="chart-box"><svg class="chart" viewBox="0 0 {width} {height}" preserveAspectRatio="none" '
             f'role="img" aria-label="{escape(title)}: latest {escape(compact(last, unit))}">',
             f'<title>{escape(title)}</title>',
             f'<line class="grid" x1="0" y1="{height}" x2="{width}" y2="{height}"/>',
             f'<line class="grid" x1="0" y1="4" x2="{width}" y2="4"/>']
    for run in runs:
        line = " ".join(f"{x},{y}" for x, y in run)
        if len(run) > 1:
            parts.append(f'<polygon class="area" points="{run[0][0]},{height} {line} {run[-1][0]},{height}"/>')
            parts.append(f'<polyline class="line" points="{line}"/>')
        else:
            x, y = run[0]
            parts.append(f'<line class="line" x1="{max(0.0, x - 4)}" y1="{y}" x2="{min(width, x + 4)}" y2="{y}"/>')
    parts.append("</svg>")
    if not runs:
        parts.append('<span class="chart-empty">no data yet</span>')
    parts.append(f'<div class="chart-axis"><span>-60 min</span><span>peak {escape(compact(peak, unit))}</span>'
                 f'<span>now {escape(compact(last, unit))}</span></div></div>')
    return Markup("".join(parts))


def sparkline(values: Sequence[float | None], *, width: int = 120, height: int = 24) -> Markup:
    """A small line of the last hour, for a table row."""
    runs = _points(values, width, height, 0.0, 2.0)
    lines = "".join(f'<polyline class="line" points="{" ".join(f"{x},{y}" for x, y in run)}"/>' for run in runs)
    return Markup(f'<svg class="spark" viewBox="0 0 {width} {height}" preserveAspectRatio="none" '
                  f'aria-hidden="true">{lines}</svg>')
