"""Server-rendered SVG charts for the admin's Outbox dashboard: no JavaScript, no network.

A chart is a few polylines over a time axis; the held ETAs are dots on a timeline. Every
label goes through `escape` (task names are the users' text), and the result is marked safe
only here.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Mapping, Sequence

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH = 560  # pixels of the SVG's viewBox
HEIGHT = 170
LEFT, RIGHT, TOP, BOTTOM = 52, 24, 22, 24  # margins around the plot, pixels
COLOURS = ("#417690", "#d97706", "#15803d", "#b91c1c", "#7c3aed", "#0891b2", "#6b7280")
TICKS = 4  # vertical axis: this many steps above zero


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Series:
    """One line: its name and (epoch seconds, value) points in time order."""

    name: str
    points: Sequence[tuple[float, float]]


def nice_top(value: float) -> float:
    """The smallest 1, 2, 5 or 10 times a power of ten at or above `value` (1 for nothing)."""
    if value <= 0:
        return 1.0
    base = 10.0 ** math.floor(math.log10(value))
    return next(f * base for f in (1, 2, 5, 10) if f * base >= value)


def figure(value: float) -> str:
    """An axis label: whole numbers plainly, small ones with two decimals, big ones in k/M."""
    if value >= 1_000_000:
        return f"{value / 1_000_000:g}M"
    if value >= 1_000:
        return f"{value / 1_000:g}k"
    return f"{value:g}" if value == int(value) else f"{value:.2f}"


def clock(epoch: float, *, seconds: bool = False) -> str:
    """HH:MM (UTC) of an epoch time, the time axis' label."""
    moment = dt.datetime.fromtimestamp(epoch, dt.UTC)
    return moment.strftime("%H:%M:%S" if seconds else "%H:%M")


def line_chart(
    title: str, series: Sequence[Series], *, start: float, end: float, unit: str = ""
) -> SafeString:
    """An SVG line chart of `series` between the epoch times `start` and `end`."""
    top = nice_top(max((y for s in series for _, y in s.points), default=0.0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(t: float) -> float:
        return LEFT + (t - start) / max(end - start, 1e-9) * plot_w

    def y(v: float) -> float:
        return TOP + plot_h - v / top * plot_h

    parts = [_open(title), _text(LEFT, 14, f"{title}{f' ({unit})' if unit else ''}", "title")]
    for step in range(TICKS + 1):
        value = top * step / TICKS
        parts.append(_hline(LEFT, LEFT + plot_w, y(value)))
        parts.append(_text(LEFT - 6, y(value) + 4, figure(value), "axis", anchor="end"))
    for step in range(5):
        t = start + (end - start) * step / 4
        parts.append(_text(x(t), HEIGHT - 6, clock(t), "axis", anchor="middle"))
    for n, line in enumerate(series):
        colour = COLOURS[n % len(COLOURS)]
        coords = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in line.points)
        parts.append(
            f'<polyline class="series" data-series="{escape(line.name)}" '
            f'data-points="{len(line.points)}" fill="none" stroke="{colour}" '
            f'stroke-width="1.6" points="{coords}"><title>{escape(line.name)}</title></polyline>'
        )
        legend_x = LEFT + plot_w - 110 * (len(series) - n)
        parts.append(f'<rect x="{legend_x}" y="6" width="10" height="3" fill="{colour}"/>')
        parts.append(_text(legend_x + 14, 11, line.name, "legend"))
    return mark_safe("".join(parts) + "</svg>")  # noqa: S308 - every text above is escaped


def timeline(title: str, etas: Sequence[tuple[float, str]], *, now: float) -> SafeString:
    """The held ETAs as dots on a line from now to the last one (an hour at least)."""
    end = max([now + 3600.0, *(t for t, _ in etas)])
    plot_w = WIDTH - LEFT - RIGHT
    height = 70

    def x(t: float) -> float:
        return LEFT + (t - now) / (end - now) * plot_w

    parts = [_open(title, height=height), _text(LEFT, 14, title, "title")]
    parts.append(_hline(LEFT, LEFT + plot_w, 36))
    for step in range(5):
        t = now + (end - now) * step / 4
        label = "now" if step == 0 else clock(t)
        parts.append(_text(x(t), 62, label, "axis", anchor="middle"))
    for t, name in etas:
        parts.append(
            f'<circle class="eta" cx="{x(t):.1f}" cy="36" r="4" fill="{COLOURS[1]}">'
            f"<title>{escape(name)} at {clock(t, seconds=True)} UTC</title></circle>"
        )
    return mark_safe("".join(parts) + "</svg>")  # noqa: S308 - every text above is escaped


def _open(title: str, *, height: int = HEIGHT) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="outbox-chart" role="img" '
        f'aria-label="{escape(title)}" viewBox="0 0 {WIDTH} {height}" '
        f'width="{WIDTH}" height="{height}">'
    )


def _hline(x1: float, x2: float, y: float) -> str:
    return f'<line x1="{x1:.1f}" x2="{x2:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'


def _text(x: float, y: float, text: str, css: str, *, anchor: str = "start") -> str:
    return (
        f'<text class="{css}" x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}">{escape(text)}</text>'
    )


def by_name(rows: Mapping[str, Sequence[tuple[float, float]]]) -> list[Series]:
    """Series from a mapping of name to points, in name order."""
    return [Series(name=name, points=points) for name, points in sorted(rows.items())]
