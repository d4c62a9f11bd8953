#!/usr/bin/env python
"""Draw the output of ``benchmarks/run.py --json`` as an SVG bar chart (standard library only).

    python benchmarks/run.py --design table --producers 2 --consumers 2 --json > points.jsonl
    python benchmarks/chart.py points.jsonl -o chart.svg
    python benchmarks/run.py ... --json | python benchmarks/chart.py -o chart.svg     # from stdin

Each input line is one JSON object that run.py printed for one point (``design``, ``semantics``,
``producers``, ``consumers``, ``batch``, ``cycles_per_s``, ``baseline_cycles_per_s``, ...). The chart
has one row of panels per design and semantics and one panel per batch size; each panel groups the
points by producers x consumers, with a bar for the design and one for the naive baseline measured in
the same run (and one for PGMQ when run.py measured it), the value on each bar and the ratio
design/baseline above each group. Every panel has its own y axis, from 0. The title carries the
run's settings as the points report them (payload, window, warm-up, archive, notify, PostgreSQL
version, cores, load average). Invalid points (something lost, duplicated or corrupted) are drawn
and marked INVALID.

Every bar carries its exact value in ``data-value`` and in a ``<title>`` (shown on hover), so the
SVG can be checked against the JSON it came from. Exit status: 0 when the chart was written, 2 for
bad input (nothing is written then).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from xml.sax.saxutils import escape, quoteattr

REQUIRED = ("design", "semantics", "producers", "consumers", "batch", "cycles_per_s", "baseline_cycles_per_s")
BASELINE = "naive"

# Series: (key in the point, legend label template, fill colour).
SERIES = (
    ("cycles_per_s", "{design}", "#2f6db5"),
    ("baseline_cycles_per_s", "naive baseline (same run)", "#a8a8a8"),
    ("pgmq_cycles_per_s", "PGMQ's statements (same run)", "#e0a040"),
)

BAR_W = 24
BAR_GAP = 2
GROUP_GAP = 26
PLOT_H = 220
PANEL_LEFT = 58  # room for the y tick labels
PANEL_TOP = 58  # room for the panel title, the ratio and the value labels
PANEL_BOTTOM = 44  # room for the x labels and the axis title
PANEL_GAP = 18
MARGIN = 20
TITLE_H = 78
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"


class ChartInputError(ValueError):
    """The input is not benchmark output that this chart can draw."""


@dataclass(frozen=True)
class Point:
    """One measured point, as run.py reported it."""

    design: str
    semantics: str
    producers: int
    consumers: int
    batch: int
    values: dict[str, float]
    ratio: float | None
    valid: bool
    raw: dict[str, Any]
    source: str

    @property
    def pc(self) -> str:
        return f"{self.producers}x{self.consumers}"


def _number(obj: dict[str, Any], key: str, where: str, *, integer: bool = False) -> Any:
    value: Any = obj.get(key)
    ok = isinstance(value, int) if integer else isinstance(value, int | float) and math.isfinite(value)
    if isinstance(value, bool) or not ok:
        raise ChartInputError(
            f"{where}: {key!r} must be a {'whole ' if integer else ''}number, got {value!r}"
        )
    if value < 0:
        raise ChartInputError(f"{where}: {key!r} must not be negative, got {value!r}")
    return value


def parse_point(obj: Any, where: str) -> Point:
    """Check one JSON object of run.py's output and return it as a :class:`Point`."""
    if not isinstance(obj, dict):
        raise ChartInputError(f"{where}: expected a JSON object per line, got {type(obj).__name__}")
    if obj.get("mode") == "maintenance":
        raise ChartInputError(
            f"{where}: this is a --maintenance point (latency percentiles); chart.py draws the "
            "throughput points of run.py --json"
        )
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise ChartInputError(
            f"{where}: missing {', '.join(map(repr, missing))}; "
            "is this the output of benchmarks/run.py --json?"
        )
    for key in ("design", "semantics"):
        if not isinstance(obj[key], str) or not obj[key]:
            raise ChartInputError(f"{where}: {key!r} must be a non-empty string, got {obj[key]!r}")
    producers = _number(obj, "producers", where, integer=True)
    consumers = _number(obj, "consumers", where, integer=True)
    batch = _number(obj, "batch", where, integer=True)
    if min(producers, consumers, batch) < 1:
        raise ChartInputError(f"{where}: producers, consumers and batch must be >= 1")
    values = {"cycles_per_s": float(_number(obj, "cycles_per_s", where))}
    if obj["design"] != BASELINE:  # a naive-only run reports its own figure as the baseline too
        values["baseline_cycles_per_s"] = float(_number(obj, "baseline_cycles_per_s", where))
    if obj.get("pgmq_cycles_per_s") is not None:
        values["pgmq_cycles_per_s"] = float(_number(obj, "pgmq_cycles_per_s", where))
    ratio = obj.get("ratio")
    if ratio is None and values.get("baseline_cycles_per_s"):
        ratio = values["cycles_per_s"] / values["baseline_cycles_per_s"]
    return Point(
        design=obj["design"],
        semantics=obj["semantics"],
        producers=producers,
        consumers=consumers,
        batch=batch,
        values=values,
        ratio=None if ratio is None or obj["design"] == BASELINE else float(ratio),
        valid=obj.get("valid", True) is True,
        raw=obj,
        source=where,
    )


def read_points(stream: TextIO, name: str) -> list[Point]:
    """Parse the JSON lines of one input (blank lines are skipped)."""
    points = []
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            shown = line.strip()[:80]
            raise ChartInputError(f"{where}: not JSON ({exc}): {shown!r}") from None
        points.append(parse_point(obj, where))
    return points


def load_points(sources: Sequence[str], stdin: TextIO | None = None) -> list[Point]:
    """Read every point of ``sources`` (file paths; ``-`` or none at all: standard input)."""
    points: list[Point] = []
    for src in sources or ["-"]:
        if src == "-":
            points += read_points(stdin if stdin is not None else sys.stdin, "<stdin>")
            continue
        try:
            with open(src, encoding="utf-8") as f:
                points += read_points(f, src)
        except OSError as exc:
            raise ChartInputError(f"cannot read {src}: {exc.strerror}") from None
    if not points:
        raise ChartInputError("no points in the input (expected the JSON lines of benchmarks/run.py --json)")
    seen: dict[tuple[str, str, int, int, int], str] = {}
    for p in points:
        key = (p.design, p.semantics, p.producers, p.consumers, p.batch)
        if key in seen:
            raise ChartInputError(
                f"{p.source}: {p.design} {p.semantics} {p.pc} batch {p.batch} was already measured at "
                f"{seen[key]}; chart one run per point (run.py --repeat gives medians)"
            )
        seen[key] = p.source
    return points


# -- drawing -----------------------------------------------------------------------------------------


def fmt(value: float) -> str:
    """A short label: 918, 1.51k, 36.8k, 1.2M (rounded first, so 9999.5 reads 10.0k, not 10.00k)."""
    if value >= 999_950:
        return f"{value / 1e6:.1f}M"
    if value >= 9_995:
        return f"{value / 1e3:.1f}k"
    if value >= 999.5:
        return f"{value / 1e3:.2f}k"
    return f"{value:.0f}"


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Ticks from 0 to at least ``top`` in steps of 1, 2 or 5 times a power of ten."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    n = math.ceil(top / step - 1e-9)
    return [i * step for i in range(n + 1)]


def _tick_label(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:g}M"
    if value >= 1e3:
        return f"{value / 1e3:g}k"
    return f"{value:g}"


def _text(x: float, y: float, s: str, *, size: int = 11, anchor: str = "middle", **attrs: str) -> str:
    extra = "".join(f" {k.rstrip('_').replace('_', '-')}={quoteattr(v)}" for k, v in attrs.items())
    return (
        f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' text-anchor='{anchor}'{extra}>{escape(s)}</text>"
    )


def _distinct(points: Iterable[Point], key: str, digits: int | None = None) -> list[Any]:
    out: list[Any] = []
    for p in points:
        v = p.raw.get(key)
        if digits is not None and isinstance(v, float):
            v = round(v, digits)
        if v is not None and v not in out:
            out.append(v)
    return out


def _one_or_range(values: list[Any], unit: str = "") -> str:
    if not values:
        return "?"
    if len(values) == 1:
        return f"{values[0]:g}{unit}" if isinstance(values[0], int | float) else f"{values[0]}{unit}"
    if all(isinstance(v, int | float) for v in values):
        return f"{min(values):g}{unit} to {max(values):g}{unit}"
    return " / ".join(map(str, values))


def settings_line(points: Sequence[Point]) -> str:
    """The run's settings as the points report them (ranges where points differ)."""
    parts = [
        f"payload {_one_or_range(_distinct(points, 'payload_bytes'), ' B')}",
        f"{_one_or_range(_distinct(points, 'seconds', 1), ' s')} per point after "
        f"{_one_or_range(_distinct(points, 'warmup_s'), ' s')} warm-up",
    ]
    runs = _distinct(points, "cycles_per_s_runs")
    if runs:
        parts.append(f"median of {_one_or_range(sorted({len(r) for r in runs}))} runs")
    archive = _distinct(points, "archive")
    if archive:
        parts.append("archive=" + "/".join("on" if a else "off" for a in archive))
    notify = _distinct(points, "notify")
    if notify:
        parts.append("notify=" + "/".join(map(str, notify)))
    return " | ".join(parts)


def machine_line(points: Sequence[Point]) -> str:
    pg = _distinct(points, "pg_version")
    cores = _distinct(points, "cores")
    load = _distinct(points, "load_avg_1m")
    parts = []
    if pg:
        parts.append("PostgreSQL " + " / ".join(map(str, pg)))
    if cores:
        parts.append(f"{_one_or_range(cores)} cores")
    if load:
        parts.append(f"1-minute load average {_one_or_range(load)} (at the end of each point)")
    return " | ".join(parts)


def render_svg(points: Sequence[Point], *, title: str | None = None, captions: Sequence[str] = ()) -> str:
    """Return the SVG document of ``points`` (see the module's docstring for the layout)."""
    rows: list[tuple[str, str]] = []
    for p in points:
        if (p.design, p.semantics) not in rows:
            rows.append((p.design, p.semantics))
    batches = sorted({p.batch for p in points})
    pcs = sorted({(p.producers, p.consumers) for p in points})
    series = [s for s in SERIES if any(s[0] in p.values for p in points)]
    by_key = {(p.design, p.semantics, p.batch, p.producers, p.consumers): p for p in points}

    group_w = len(series) * (BAR_W + BAR_GAP) - BAR_GAP
    plot_w = len(pcs) * group_w + (len(pcs) + 1) * GROUP_GAP
    panel_w = PANEL_LEFT + plot_w
    panel_h = PANEL_TOP + PLOT_H + PANEL_BOTTOM
    width = 2 * MARGIN + len(batches) * panel_w + (len(batches) - 1) * PANEL_GAP
    width = max(width, 640)
    captions = [
        line
        for caption in captions
        for line in textwrap.wrap(caption, int((width - 2 * MARGIN) / 6.2)) or [""]
    ]
    caption_h = 16 * len(captions) + (8 if captions else 0)
    height = TITLE_H + len(rows) * (panel_h + PANEL_GAP) + caption_h + MARGIN

    designs = sorted({d for d, _ in rows})
    heading = title or (
        f"Full push-pop cycles per second: {', '.join(designs)} vs the naive baseline"
        if designs != [BASELINE]
        else "Full push-pop cycles per second: the naive baseline"
    )
    out = [
        "<?xml version='1.0' encoding='UTF-8'?>",
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' {FONT}>",
        f"<title>{escape(heading)}</title>",
        f"<desc>{escape(settings_line(points) + ' | ' + machine_line(points))}</desc>",
        f"<rect width='{width}' height='{height}' fill='white'/>",
        _text(MARGIN, 26, heading, size=16, anchor="start", font_weight="bold"),
        _text(MARGIN, 46, settings_line(points), size=11, anchor="start", fill="#333"),
        _text(MARGIN, 62, machine_line(points), size=11, anchor="start", fill="#333"),
    ]
    # Legend, top right.
    lx = width - MARGIN
    for _key, label, colour in reversed(series):
        text = label.format(design=" / ".join(d for d in designs if d != BASELINE) or BASELINE)
        lx -= 7 * len(text) + 30
        out.append(f"<rect x='{lx:.1f}' y='15' width='12' height='12' fill='{colour}'/>")
        out.append(_text(lx + 17, 25, text, anchor="start"))
    out.append(
        _text(
            width - MARGIN,
            44,
            "above each group: \u00d7 design / naive baseline",
            size=10,
            anchor="end",
            fill="#333",
        )
    )

    for r, (design, semantics) in enumerate(rows):
        top = TITLE_H + r * (panel_h + PANEL_GAP)
        for c, batch in enumerate(batches):
            left = MARGIN + c * (panel_w + PANEL_GAP)
            here = [by_key.get((design, semantics, batch, pp, cc)) for pp, cc in pcs]
            out += _panel(
                left=left,
                top=top,
                design=design,
                semantics=semantics,
                batch=batch,
                pcs=pcs,
                here=here,
                series=series,
            )

    y = TITLE_H + len(rows) * (panel_h + PANEL_GAP) + 6
    for line in captions:
        out.append(_text(MARGIN, y, line, size=11, anchor="start", fill="#333"))
        y += 16
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _panel(
    *,
    left: float,
    top: float,
    design: str,
    semantics: str,
    batch: int,
    pcs: Sequence[tuple[int, int]],
    here: Sequence[Point | None],
    series: Sequence[tuple[str, str, str]],
) -> list[str]:
    out = [
        f"<g class='panel' data-design={quoteattr(design)} data-semantics={quoteattr(semantics)} "
        f"data-batch='{batch}'>"
    ]
    x0 = left + PANEL_LEFT
    y0 = top + PANEL_TOP + PLOT_H  # the baseline of the bars
    out.append(
        _text(
            x0, top + 14, f"{design}, {semantics}, batch {batch}", size=12, anchor="start", font_weight="bold"
        )
    )
    present = [p for p in here if p is not None]
    top_value = max((v for p in present for v in p.values.values()), default=0.0)
    ticks = nice_ticks(top_value)
    scale = PLOT_H / ticks[-1]
    plot_w = len(pcs) * (len(series) * (BAR_W + BAR_GAP) - BAR_GAP) + (len(pcs) + 1) * GROUP_GAP
    for t in ticks:
        ty = y0 - t * scale
        out.append(
            f"<line x1='{x0:.1f}' y1='{ty:.1f}' x2='{x0 + plot_w:.1f}' y2='{ty:.1f}' "
            f"stroke='{'#444' if t == 0 else '#e4e4e4'}' stroke-width='1'/>"
        )
        out.append(_text(x0 - 6, ty + 4, _tick_label(t), size=10, anchor="end", fill="#444"))
    out.append(f"<line x1='{x0:.1f}' y1='{y0 - PLOT_H:.1f}' x2='{x0:.1f}' y2='{y0:.1f}' stroke='#444'/>")
    cy = y0 - PLOT_H / 2
    out.append(_text(left + 14, cy, "cycles/s", size=11, transform=f"rotate(-90 {left + 14:.1f} {cy:.1f})"))
    out.append(_text(x0 + plot_w / 2, y0 + 36, "producers x consumers", size=11))

    gx = x0 + GROUP_GAP
    group_w = len(series) * (BAR_W + BAR_GAP) - BAR_GAP
    for (pp, cc), p in zip(pcs, here, strict=True):
        out.append(_text(gx + group_w / 2, y0 + 16, f"{pp}x{cc}", size=11))
        if p is None:
            out.append(_text(gx + group_w / 2, y0 - 6, "not run", size=10, fill="#888"))
            gx += group_w + GROUP_GAP
            continue
        highest = y0
        for i, (key, label, colour) in enumerate(series):
            value = p.values.get(key)
            bx = gx + i * (BAR_W + BAR_GAP)
            if value is None:
                continue
            h = value * scale
            name = label.format(design=design)
            out.append(
                f"<rect class='bar' x='{bx:.1f}' y='{y0 - h:.1f}' width='{BAR_W}' height='{h:.1f}' "
                f"fill='{colour}' data-series='{key}' data-design={quoteattr(design)} "
                f"data-semantics={quoteattr(semantics)} data-producers='{pp}' data-consumers='{cc}' "
                f"data-batch='{batch}' data-value='{value!r}'>"
                f"<title>{escape(f'{name}, {semantics}, {pp}x{cc}, batch {batch}: {value:,.1f} cycles/s')}"
                "</title></rect>"
            )
            out.append(_text(bx + BAR_W / 2, y0 - h - 4, fmt(value), size=9, fill="#222"))
            highest = min(highest, y0 - h - 4)
        if not p.valid:
            out.append(
                _text(gx + group_w / 2, highest - 14, "INVALID", size=11, fill="#c00000", font_weight="bold")
            )
        elif p.ratio is not None:
            out.append(
                _text(
                    gx + group_w / 2,
                    highest - 14,
                    f"\u00d7{p.ratio:.2f}",
                    size=11,
                    font_weight="bold",
                    class_="ratio",
                    data_ratio=repr(p.ratio),
                )
            )
        gx += group_w + GROUP_GAP
    out.append("</g>")
    return out


# -- command line ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="chart.py",
        description="Draw the JSON lines of benchmarks/run.py --json as an SVG bar chart.",
    )
    ap.add_argument("inputs", nargs="*", help="files of JSON lines (default, or '-': standard input)")
    ap.add_argument("-o", "--output", help="the SVG file to write (default: standard output)")
    ap.add_argument("--title", help="the chart's title (default: names the designs)")
    ap.add_argument(
        "--caption",
        action="append",
        default=[],
        help="a line of text under the chart, e.g. the command line and date (repeatable)",
    )
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        points = load_points(args.inputs)
    except ChartInputError as exc:
        print(f"chart.py: {exc}", file=sys.stderr)
        return 2
    svg = render_svg(points, title=args.title, captions=args.caption)
    if args.output:
        Path(args.output).write_text(svg, encoding="utf-8")
        print(f"chart.py: wrote {len(points)} point(s) to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(svg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
