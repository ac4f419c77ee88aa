"""Number formatting for the usage report."""

from __future__ import annotations

from django import template

register = template.Library()


@register.filter
def num(value: int | float | None) -> str:
    """12345 → 12,345; None → —."""
    if value is None:
        return "—"
    return f"{value:,.0f}"


@register.filter
def ms(value: int | float | None) -> str:
    """Milliseconds, as seconds once they pass one."""
    if value is None:
        return "—"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"


@register.filter
def percent(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value * 100:.1f}%" if value else "0%"
