"""Inline-SVG charts and HTML tables for the report (no scripts, no network)."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence


def esc(value: object) -> str:
    return html.escape(str(value))


def num(value: object, digits: int = 3) -> str:
    """A number as a reader wants it: a float to ``digits`` significant digits (0.38648293963254593 -> 0.386,
    1.0 -> 1), and one of ``digits`` or more integer digits without decimals (1051.3 -> 1051), anything else as
    is."""
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.0f}" if abs(value) >= 10 ** digits else f"{value:.{digits}g}"
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An HTML table; float cells are rounded (:func:`num`), so no raw float reaches the reader."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(num(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


LOWER_IS_BETTER = "lower is better"
HIGHER_IS_BETTER = "higher is better"


def _heading(title: str, direction: str | None) -> str:
    """The chart's title line (with ``direction``, e.g. "lower is better", in parentheses)."""
    text = f"{title} ({direction})" if direction else title
    return f"<text class='chart-title' x='0' y='14' font-weight='bold'>{esc(text)}</text>"


def _svg(width: float, height: float, title: str, parts: list[str]) -> str:
    return (f"<svg width='{width:.0f}' height='{height:.0f}' role='img' aria-label='{esc(title)}'>"
            f"<title>{esc(title)}</title>{''.join(parts)}</svg>")


def bar_chart(items: list[tuple[str, float]], *, title: str, value_label: str, category_label: str,
              direction: str | None = None, unit: str = "", width: int = 640, color: str = "#4a78c2") -> str:
    """Horizontal bar chart as inline SVG, with a title and both axes named.

    Args:
        items: (label, value) pairs, drawn top to bottom.
        title: What the chart shows.
        value_label: Name of the value axis (horizontal), e.g. "seconds".
        category_label: Name of the category axis (vertical), e.g. "stage".
        direction: "lower is better" / "higher is better" where one applies (added to the title).
        unit: Suffix printed after each value.
        width: Total width in pixels.
        color: Bar colour.
    """
    if not items:
        return "<p class='muted'>nothing to plot</p>"
    label_w, row_h, top_pad = 160, 22, 40
    top = max(v for _, v in items) or 1.0
    parts = [_heading(title, direction),
             f"<text class='y-label' x='0' y='32' font-style='italic'>{esc(category_label)} \u2193</text>",
             f"<text class='x-label' x='{label_w}' y='32' font-style='italic'>{esc(value_label)} \u2192</text>"]
    for i, (label, value) in enumerate(items):
        y = top_pad + i * row_h
        w = max(1.0, (width - label_w - 90) * value / top)
        parts.append(
            f"<text x='0' y='{y + 15}'>{esc(label)}</text>"
            f"<rect x='{label_w}' y='{y + 3}' width='{w:.1f}' height='{row_h - 6}' fill='{color}'/>"
            f"<text x='{label_w + w + 6:.1f}' y='{y + 15}'>{value:.3g}{esc(unit)}</text>"
        )
    return _svg(width, top_pad + len(items) * row_h, title, parts)


def heatmap(values: list[list[float]], *, title: str, row_label: str, col_label: str,
            marked: set[tuple[int, int]] | None = None, cell: int = 22) -> str:
    """A rows x columns heatmap (white -> blue by value), with optional marked cells outlined.

    Args:
        values: values[r][c].
        title: What the colour shows.
        row_label: Name of the row axis (e.g. "layer").
        col_label: Name of the column axis (e.g. "head").
        marked: (row, col) cells drawn with a thick outline (e.g. selected heads).
        cell: Cell size in pixels.
    """
    if not values or not values[0]:
        return "<p class='muted'>nothing to plot</p>"
    flat = [v for row in values for v in row if math.isfinite(v)]
    lo, hi = (min(flat), max(flat)) if flat else (0.0, 1.0)
    span = (hi - lo) or 1.0
    left, top = 60, 44
    parts = [_heading(f"{title} (white {lo:.3g} \u2192 blue {hi:.3g})", None),
             f"<text class='y-label' x='0' y='30' font-style='italic'>{esc(row_label)} \u2193</text>",
             f"<text class='x-label' x='{left}' y='30' font-style='italic'>{esc(col_label)} \u2192</text>"]
    for c in range(len(values[0])):
        parts.append(f"<text x='{left + c * cell + 6}' y='{top - 2}'>{c}</text>")
    for r, row in enumerate(values):
        y = top + 2 + r * cell
        parts.append(f"<text x='{left - 24}' y='{y + 15}'>{r}</text>")
        for c, v in enumerate(row):
            t = (v - lo) / span if math.isfinite(v) else 0.0
            shade = f"rgb({int(255 - 180 * t)},{int(255 - 130 * t)},255)"
            stroke = "stroke='#c2184a' stroke-width='3'" if marked and (r, c) in marked else "stroke='#dde'"
            parts.append(f"<rect x='{left + c * cell}' y='{y}' width='{cell}' height='{cell}' fill='{shade}' "
                         f"{stroke}><title>{esc(row_label)} {r}, {esc(col_label)} {c}: {v:.4g}</title></rect>")
    width = max(left + len(values[0]) * cell + 10, 8 * len(title) + 120)
    height = top + 2 + len(values) * cell + 10
    return _svg(width, height, title, parts)


def scatter(points: list[tuple[float, float]], *, title: str, x_label: str, y_label: str,
            direction: str | None = None, width: int = 420, height: int = 280) -> str:
    """A scatter plot of (x, y) points with min/max axis ticks, a title and both axes named.

    Args:
        points: (x, y) pairs; non-finite ones are skipped.
        title: What the chart shows.
        x_label: Name of the horizontal axis.
        y_label: Name of the vertical axis.
        direction: "lower is better" / "higher is better" for y where one applies (added to the title).
    """
    points = [(float(x), float(y)) for x, y in points if math.isfinite(float(x)) and math.isfinite(float(y))]
    if not points:
        return "<p class='muted'>nothing to plot</p>"
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    left, bottom, pad, head = 56, 36, 12, 22

    def sx(x: float) -> float:
        return left + (width - left - pad) * ((x - x0) / (x1 - x0) if x1 > x0 else 0.5)

    def sy(y: float) -> float:
        return head + pad + (height - bottom - head - pad) * (1 - ((y - y0) / (y1 - y0) if y1 > y0 else 0.5))

    parts = [_heading(title, direction),
             f"<line x1='{left}' y1='{height - bottom}' x2='{width - pad}' y2='{height - bottom}' stroke='#889'/>",
             f"<line x1='{left}' y1='{head + pad}' x2='{left}' y2='{height - bottom}' stroke='#889'/>",
             f"<text x='{left}' y='{height - bottom + 16}'>{x0:.3g}</text>",
             f"<text x='{width - pad - 30}' y='{height - bottom + 16}'>{x1:.3g}</text>",
             f"<text class='x-label' x='{left + 60}' y='{height - 4}' font-style='italic'>{esc(x_label)} \u2192</text>",
             f"<text x='2' y='{head + pad + 10}'>{y1:.3g}</text><text x='2' y='{height - bottom}'>{y0:.3g}</text>",
             f"<text class='y-label' x='2' y='{(height - bottom + head) / 2}' font-style='italic'>{esc(y_label)} "
             "\u2191</text>"]
    for x, y in points:
        parts.append(f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='5' fill='#4a78c2' fill-opacity='0.75'>"
                     f"<title>{esc(x_label)}={x:.4g}, {esc(y_label)}={y:.4g}</title></circle>")
    return _svg(width, height, title, parts)


def histogram(groups: dict[str, list[float]], *, title: str, x_label: str, y_label: str = "rows", bins: int = 20,
              width: int = 520, height: int = 230,
              colors: tuple[str, ...] = ("#4a78c2", "#c2784a", "#3a9a5a", "#9a3a8a")) -> str:
    """Overlaid histograms of several groups of values on shared bins (e.g. weights of clean vs corrupted rows).

    Args:
        groups: name -> values; each group is one colour.
        title: What the chart shows.
        x_label: Name of the binned value (horizontal axis).
        y_label: What the bar heights count (vertical axis).
    """
    values = [v for vs in groups.values() for v in vs if math.isfinite(v)]
    if not values:
        return "<p class='muted'>nothing to plot</p>"
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    counts = {}
    for name, vs in groups.items():
        c = [0] * bins
        for v in vs:
            if math.isfinite(v):
                c[min(bins - 1, int((v - lo) / span * bins))] += 1
        counts[name] = c
    top = max(max(c) for c in counts.values()) or 1
    head, bottom = 48, 40
    plot_h, bar_w = height - head - bottom, (width - 20) / bins
    parts = [_heading(title, None),
             f"<text class='y-label' x='0' y='{head - 6}' font-style='italic'>{esc(y_label)} \u2191 (max {top})"
             "</text>",
             f"<text x='0' y='{height - 20}'>{lo:.3g}</text><text x='{width - 40}' y='{height - 20}'>{hi:.3g}</text>",
             f"<text class='x-label' x='{width / 2 - 40:.0f}' y='{height - 4}' font-style='italic'>{esc(x_label)} "
             "\u2192</text>"]
    for k, (name, c) in enumerate(counts.items()):
        color = colors[k % len(colors)]
        parts.append(f"<rect x='{10 + 110 * k}' y='20' width='10' height='10' fill='{color}'/>"
                     f"<text x='{24 + 110 * k}' y='29'>{esc(name)}</text>")
        for b, n in enumerate(c):
            h = plot_h * n / top
            parts.append(f"<rect x='{10 + b * bar_w:.1f}' y='{height - bottom - h:.1f}' width='{bar_w - 1:.1f}' "
                         f"height='{h:.1f}' fill='{color}' fill-opacity='0.5'><title>{esc(name)}: {n}</title></rect>")
    return _svg(width, height, title, parts)
