"""The text tables benchmarks/run.py prints: one row per point, and the maintenance comparison."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PERCENTILES = (50, 95, 99)
LATENCY_OPS = ("push", "pop", "ack")


def maintenance_table(r: dict[str, Any]) -> str:
    """The latency comparison of :func:`measure_maintenance_point` as a text table."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    head = ["op", "calls off/on"]
    for pct in PERCENTILES:
        head += [f"p{pct} off", f"p{pct} on", "ratio"]
    rows = [head]
    for op in LATENCY_OPS:
        if not r[f"{op}_calls_off"] and not r[f"{op}_calls_on"]:
            continue
        row = [f"{op} ms", f"{r[f'{op}_calls_off']}/{r[f'{op}_calls_on']}"]
        for pct in PERCENTILES:
            row += [ms(r[f"{op}_p{pct}_ms_off"]), ms(r[f"{op}_p{pct}_ms_on"]), ratio(r[f"{op}_p{pct}_ratio"])]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]
    m = r["maintenance"]
    lines.append(
        f"cycles/s: off {r['cycles_per_s_off']:,.0f}, on {r['cycles_per_s_on']:,.0f} "
        f"(ratio {ratio(r['cycles_ratio'])})"
    )
    lines.append(
        f"hot tables (meta, data, done) after the drain: off {r['hot_bytes_off'] / 1e6:.1f} MB, "
        f"on {r['hot_bytes_on'] / 1e6:.1f} MB; all tables: off {r['table_bytes_off'] / 1e6:.1f} MB, "
        f"on {r['table_bytes_on'] / 1e6:.1f} MB"
    )
    lines.append(
        f"maintenance: {m.get('runs', 0)} runs, {m.get('archived', 0):,} messages archived, "
        f"{m.get('reindexed', 0)} indexes rebuilt online ({m.get('failed_reindexes', 0)} failed), "
        f"busy {m.get('busy_s', 0):.1f}s | lost {r['lost']}, duplicated {r['duplicated']}, "
        f"{'ok' if r['valid'] else 'INVALID'}"
    )
    return "\n".join(lines)


def rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits) if isinstance(x, float) else x


COLUMNS: tuple[tuple[str, int, Callable[[dict[str, Any]], str]], ...] = (
    ("design", 6, lambda r: r["design"]),
    ("P", 2, lambda r: str(r["producers"])),
    ("C", 2, lambda r: str(r["consumers"])),
    ("batch", 5, lambda r: str(r["batch"])),
    ("cycles/s", 9, lambda r: f"{r['cycles_per_s']:,.0f}"),
    ("naive/s", 9, lambda r: f"{r['baseline_cycles_per_s']:,.0f}"),
    ("ratio", 6, lambda r: "-" if r["ratio"] is None else f"{r['ratio']:.2f}"),
    ("pgmq/s", 9, lambda r: _fmt_opt(r.get("pgmq_cycles_per_s"))),
    ("vs pgmq", 7, lambda r: "-" if r.get("pgmq_ratio") is None else f"{r['pgmq_ratio']:.2f}"),
    ("lost", 4, lambda r: str(r["lost"] + r["baseline_lost"] + r.get("pgmq_lost", 0))),
    ("dup", 4, lambda r: str(r["duplicated"] + r["baseline_duplicated"] + r.get("pgmq_duplicated", 0))),
    ("table MB", 11, lambda r: f"{r['table_bytes_start'] / 1e6:.0f}>{r['table_bytes'] / 1e6:.0f}"),
    ("naive MB", 8, lambda r: f"{(r['baseline_table_bytes'] or 0) / 1e6:.0f}"),
    ("dead tup", 8, lambda r: str(r["dead_tuples"])),
    ("HOT", 4, lambda r: "-" if r["hot_update_ratio"] is None else f"{r['hot_update_ratio']:.0%}"),
    ("WAL B/msg", 9, lambda r: _fmt_opt(r["wal_bytes_per_msg"])),
    ("naive WAL", 9, lambda r: _fmt_opt(r["baseline_wal_bytes_per_msg"])),
    ("ok", 7, lambda r: "ok" if r["valid"] else "INVALID"),
)


def _fmt_opt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def table_header() -> str:
    return "  ".join(name.rjust(w) if i else name.ljust(w) for i, (name, w, _) in enumerate(COLUMNS))


def table_row(r: dict[str, Any]) -> str:
    return "  ".join(f(r).rjust(w) if i else f(r).ljust(w) for i, (_, w, f) in enumerate(COLUMNS))


def also_lines(r: dict[str, Any]) -> str:
    """One line per design of ``--also`` at a point, under its row: cycles/s, against the naive queue,
    sizes, dead tuples and whether what went in came out once, unchanged; and one per ``--feature``,
    against the default queue of the same runs."""
    lines = []
    for name, f in r.get("also", {}).items():
        ratio = "-" if f["ratio"] is None else f"{f['ratio']:.2f}"
        lines.append(
            f"  also {name}: {f['cycles_per_s']:,.0f} cycles/s ({ratio}x naive), lost {f['lost']}, "
            f"dup {f['duplicated']}, corrupt {f['corrupt']}, table MB "
            f"{f['table_bytes_start'] / 1e6:.0f}>{f['table_bytes'] / 1e6:.0f}, dead tup {f['dead_tuples']}, "
            f"{'ok' if f['valid'] else 'INVALID'}"
        )
    for name, f in r.get("features", {}).items():
        ratio = "-" if f["ratio_to_table"] is None else f"{f['ratio_to_table']:.2f}"
        lines.append(
            f"  feature {name}: {f['cycles_per_s']:,.0f} cycles/s ({ratio}x the default queue), lost "
            f"{f['lost']}, dup {f['duplicated']}, corrupt {f['corrupt']}, {'ok' if f['valid'] else 'INVALID'}"
        )
    return "\n".join(lines)


def unheld_lines(r: dict[str, Any]) -> str:
    """The ``--also-unheld`` figures of a point, one line per design: its rate without the hold in the
    same rounds and what it kept under the hold (the median of the rounds' ratios, every round's)."""
    lines = []
    for name, f in r["unheld"].items():
        kept = "-" if f["kept"] is None else f"{f['kept']:.2f}"
        rounds = " / ".join(f"{k:.2f}" for k in f["kept_runs"])
        lines.append(
            f"  unheld {name}: {f['cycles_per_s']:,.0f} cycles/s, kept {kept} of it under the hold "
            f"(rounds {rounds}), {'ok' if f['valid'] else 'INVALID'}"
        )
    return "\n".join(lines)


def hold_table(r: dict[str, Any]) -> str:
    """The figures of a ``--hold-horizon`` point, one line per design measured, under its row."""
    edge = r.get("hold_edge_s") or 0

    def mb(v: int | None) -> str:
        return "-" if v is None else f"{v / 1e6:.1f}"

    head = [
        "  held",
        "cycles/s",
        f"first {edge:g}s",
        f"last {edge:g}s",
        "MB before",
        "in hold",
        "after",
        "dead in hold",
        "dead after",
        "max pop ms",
        "xid age",
    ]
    rows = [head]
    designs: list[tuple[str, dict[str, Any], str]] = [("", r, r["design"])]
    # --also: each further design's figures, under the same names without a prefix
    designs += [("", fig, name) for name, fig in r.get("also", {}).items()]
    if r["design"] != "naive":
        designs.append(("baseline_", r, "naive"))
    if "pgmq_cycles_per_s" in r:
        designs.append(("pgmq_", r, "pgmq"))
    for prefix, f, name in designs:
        rows.append(
            [
                f"  {name}",
                _fmt_opt(f[f"{prefix}cycles_per_s"]),
                _fmt_opt(f[f"{prefix}cycles_per_s_first"]),
                _fmt_opt(f[f"{prefix}cycles_per_s_last"]),
                mb(f[f"{prefix}bytes_before_hold"]),
                mb(f[f"{prefix}bytes_in_hold"]),
                mb(f[f"{prefix}bytes_after_release"]),
                _fmt_opt(f[f"{prefix}dead_tuples_in_hold"]),
                _fmt_opt(f[f"{prefix}dead_tuples_after_release"]),
                "-" if f[f"{prefix}pop_max_ms"] is None else f"{f[f'{prefix}pop_max_ms']:.1f}",
                _fmt_opt(f[f"{prefix}hold_xmin_age"]),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    )
