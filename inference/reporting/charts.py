"""Small inline SVG charts for the admin's reports, drawn on the server (no script, nothing fetched).

Every data point is an element carrying ``data-series``, ``data-label`` and ``data-value`` and a
``<title>`` tooltip, so the numbers behind a chart can be read (and tested) from the page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

WIDTH = 640
HEIGHT = 240
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 28, 30
MAX_X_LABELS = 8


@dataclass(frozen=True, slots=True)
class Series:
    key: str
    label: str
    color: str
    values: Sequence[float | None]


def short_number(value: float) -> str:
    """1234 → 1.2k, 5600000 → 5.6M: axis labels that fit."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.1f}".rstrip("0").rstrip(".") + suffix
    return f"{value:.1f}".rstrip("0").rstrip(".") if value % 1 else str(int(value))


def _nice_step(maximum: float, ticks: int = 4) -> float:
    raw = maximum / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 2.5, 5, 10):
        if factor * magnitude >= raw:
            return factor * magnitude
    return 10 * magnitude


def _axes(labels: Sequence[str], maximum: float, unit: str) -> tuple[float, list[SafeString]]:
    """The y scale's top and the grid, y tick labels and thinned x labels."""
    step = _nice_step(maximum) if maximum > 0 else 1.0
    top = step * math.ceil(maximum / step) if maximum > 0 else 4.0
    plot_h = HEIGHT - TOP - BOTTOM
    parts: list[SafeString] = []
    value = 0.0
    while value <= top + 1e-9:
        y = TOP + plot_h - plot_h * value / top
        parts.append(
            format_html(
                '<line class="grid" x1="{}" x2="{}" y1="{}" y2="{}"/>'
                '<text class="tick" x="{}" y="{}" text-anchor="end">{}</text>',
                LEFT, WIDTH - RIGHT, f"{y:.1f}", f"{y:.1f}", LEFT - 6, f"{y + 4:.1f}", short_number(value) + unit,
            )
        )
        value += step
    every = max(1, math.ceil(len(labels) / MAX_X_LABELS))
    slot = (WIDTH - LEFT - RIGHT) / max(len(labels), 1)
    for index, label in enumerate(labels):
        if index % every == 0:
            x = LEFT + slot * (index + 0.5)
            tick = '<text class="tick" x="{}" y="{}" text-anchor="middle">{}</text>'
            parts.append(format_html(tick, f"{x:.1f}", HEIGHT - 10, label))
    return top, parts


def _legend(series: Sequence[Series]) -> SafeString:
    items = []
    x = LEFT
    for s in series:
        items.append(
            format_html(
                '<rect x="{}" y="8" width="10" height="10" fill="{}"/><text class="legend" x="{}" y="17">{}</text>',
                x, s.color, x + 14, s.label,
            )
        )
        x += 24 + 7 * len(s.label)
    return mark_safe("".join(items))


def _svg(kind: str, title: str, body: Sequence[SafeString]) -> SafeString:
    return format_html(
        '<svg class="chart chart-{}" role="img" aria-label="{}" viewBox="0 0 {} {}" '
        'preserveAspectRatio="xMidYMid meet">'
        "<title>{}</title>{}</svg>",
        kind, title, WIDTH, HEIGHT, title, mark_safe("".join(body)),
    )


def stacked_bars(
    *, title: str, labels: Sequence[str], series: Sequence[Series], ticks: Sequence[str] | None = None, unit: str = ""
) -> SafeString:
    """Bars per label, the series stacked bottom-up in order; ``ticks`` are the x axis' texts (default: labels)."""
    totals = [sum(s.values[i] or 0 for s in series) for i in range(len(labels))]
    top, parts = _axes(ticks or labels, max(totals, default=0), unit)
    plot_h = HEIGHT - TOP - BOTTOM
    slot = (WIDTH - LEFT - RIGHT) / max(len(labels), 1)
    bar_w = max(slot * 0.7, 1.0)
    for i, label in enumerate(labels):
        base = 0.0
        x = LEFT + slot * i + (slot - bar_w) / 2
        for s in series:
            value = s.values[i] or 0
            h = plot_h * value / top
            y = TOP + plot_h - plot_h * base / top - h
            parts.append(
                format_html(
                    '<rect class="point" data-series="{}" data-label="{}" data-value="{}" x="{}" y="{}" width="{}" '
                    'height="{}" fill="{}"><title>{}: {} {}</title></rect>',
                    s.key, label, f"{value:g}", f"{x:.1f}", f"{y:.1f}", f"{bar_w:.1f}", f"{h:.1f}", s.color,
                    label, f"{value:,.0f}", s.label,
                )
            )
            base += value
    return _svg("bars", title, [*parts, _legend(series)])


def lines(
    *, title: str, labels: Sequence[str], series: Sequence[Series], ticks: Sequence[str] | None = None, unit: str = ""
) -> SafeString:
    """A line per series with a dot per known value, skipping unknown (None) values."""
    known = [v for s in series for v in s.values if v is not None]
    top, parts = _axes(ticks or labels, max(known, default=0), unit)
    plot_h = HEIGHT - TOP - BOTTOM
    slot = (WIDTH - LEFT - RIGHT) / max(len(labels), 1)
    for s in series:
        points = [
            (LEFT + slot * (i + 0.5), TOP + plot_h - plot_h * v / top, labels[i], v)
            for i, v in enumerate(s.values)
            if v is not None
        ]
        if len(points) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _, _ in points)
            parts.append(format_html('<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>', path, s.color))
        parts.append(
            format_html_join(
                "",
                '<circle class="point" data-series="{}" data-label="{}" data-value="{}" cx="{}" cy="{}" r="3.5" '
                'fill="{}">'
                "<title>{}: {} {}{}</title></circle>",
                (
                    (s.key, label, f"{v:g}", f"{x:.1f}", f"{y:.1f}", s.color, label, s.label, f"{v:,.0f}", unit)
                    for x, y, label, v in points
                ),
            )
        )
    return _svg("lines", title, [*parts, _legend(series)])
