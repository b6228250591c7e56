"""The memory optimizer summary: one table of plans, as logged at INFO."""

from __future__ import annotations

from ortrain.capture.memory_optimizer import ALL, COMPROMISE, RECOMPUTE, MemoryReport, Plan

_MIB = 1024 * 1024


def _requested(plan: Plan) -> str:
    if plan.requested is None:
        return "-"
    return "all" if plan.requested == ALL else str(plan.requested)


def _frequency(plan: Plan) -> str:
    count = len(plan.occurrences)
    layers = plan.layers
    in_layers = sum(1 for o in plan.occurrences if o.layer)
    if not layers or in_layers % len(layers):
        return str(count)
    text = f"{count} ({in_layers // len(layers)}/layer x {len(layers)}"
    return text + (f" + {count - in_layers})" if count > in_layers else ")")


def _figure(value: float, decimals: int) -> str:
    """``value`` with ``decimals`` decimals, or two significant digits where those round a value
    above zero to zero: a 3 KB activation read "0.00" MiB beside "94 %" freed (wave 54's review)."""
    text = f"{value:.{decimals}f}"
    return f"{value:.2g}" if value > 0 and float(text) == 0 else text


def _rows(plans: list[Plan], *, compromise: bool) -> list[list[str]]:
    rows = []
    for plan in plans:
        row = [
            plan.pattern,
            f"{plan.shape} {plan.dtype}",
            _frequency(plan),
            _figure(plan.bytes_per_occurrence / _MIB, 2),
            _figure(plan.flops_per_occurrence / 1e6, 1),
            str(plan.level),
            f"{_requested(plan)}/{plan.applied}",
        ]
        if compromise:
            row.insert(4, f"{plan.saved_fraction:.0%}")
        rows.append(row)
    return rows


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows)]


def format_summary(report: MemoryReport) -> str:
    """Plans with their pattern, stashed shape, frequency, MiB freed and MFLOP recomputed each."""
    config = ",".join(str(r) for r in report.requests) or "none"
    lines = [
        f"memory optimizer summary: ORTMODULE_MEMORY_OPT_LEVEL={report.level}, "
        f"ORTMODULE_MEMORY_OPT_CONFIG={config}",
        f"stashed for backward at the captured sizes: {report.stashed_bytes / _MIB:.2f} MiB in "
        f"{report.stashed_count} tensors "
        f"(without recompute plans: {report.stashed_bytes_before / _MIB:.2f} MiB; "
        f"plans applied free {report.applied_bytes / _MIB:.2f} MiB)",
    ]
    header = ["pattern", "stashed shape", "freq", "MiB/occ", "MFLOP/occ", "level", "requested/applied"]
    exact = [p for p in report.plans if p.kind == RECOMPUTE]
    partial = [p for p in report.plans if p.kind == COMPROMISE]
    lines.append("recompute (type 1: frees the whole activation):")
    lines += _table(header, _rows(exact, compromise=False)) if exact else ["  (none found)"]
    lines.append("recompute with compromise (type 2: stashes a smaller tensor instead, frees part):")
    compromise_header = [*header[:4], "freed", *header[4:]]
    lines += _table(compromise_header, _rows(partial, compromise=True)) if partial else ["  (none found)"]
    lines.append("enable a plan with ORTMODULE_MEMORY_OPT_CONFIG=<pattern>:<type>:<count> (count -1 = all)")
    if report.unknown_patterns:
        lines.append(f"requested but not found: {', '.join(report.unknown_patterns)}")
    return "\n".join(lines)
