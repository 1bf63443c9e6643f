"""The text of ``lowerflow plan``: a line per model and target, every stage with ``--verbose``.

    model  target     cached  to run
    -----  ---------  ------  ------------------------------------------------------
    mlp    portable      4/4  -
    lstm   reference     0/9  export, partition, create_submodule, build_programs, ...

Stages after a target's first miss are listed once each (their count, e.g. one
preprocess per partition, is known only once the miss has run); cached repeats
are counted (``preprocess ×25``), never printed line by line.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def plan_lines(plan: dict, *, verbose: bool = False) -> list[str]:
    """The plan of a fleet: a row per model and target (stages cached, stages to run),
    with ``verbose`` every stage too (repeats of one stage, e.g. preprocess per
    partition, on one line with their count), then the totals."""
    from flows.reports import text_table

    summary, details = [], []
    total = cached_total = 0
    for name, planned in plan["models"].items():
        for target, result in planned["targets"].items():
            stages = result.get("stages") or []
            cached = sum(1 for r in stages if r.get("cached"))
            total, cached_total = total + len(stages), cached_total + cached
            if result.get("ok") is False:
                would = f"cannot run: {result.get('error') or 'failed'}"
            else:
                would = counted([_stage_label(r) for r in stages if not r.get("cached")]) or "-"
            summary.append((name, target, f"{cached}/{len(stages)}", would))
            for label, status, count in _runs((_stage_label(r), _plan_status(r)) for r in stages):
                details.append((name, target, label + (f" ×{count}" if count > 1 else ""), status))
    lines = text_table(("model", "target", "cached", "to run"), summary, right=(2,)).splitlines()
    if verbose:
        lines += ["", *text_table(("model", "target", "stage", "would"), details).splitlines()]
    lines += ["", f"{cached_total} of {total} stages cached, {total - cached_total} to run"]
    return lines


def counted(labels: Sequence[str]) -> str:
    """``"partition, preprocess ×3, emit"``: distinct labels in order, repeats counted."""
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(label + (f" ×{n}" if n > 1 else "") for label, n in counts.items())


def _stage_label(record: dict) -> str:
    return str(record.get("stage", "?")) + (f"[{record['method']}]" if record.get("method") else "")


def _plan_status(record: dict) -> str:
    if record.get("cached"):
        return "cached"
    return "FAILED" if record.get("state") == "Failed" else "run"


def _runs(items: Iterable[tuple[str, str]]) -> list[tuple[str, str, int]]:
    """Consecutive equal (label, status) pairs as (label, status, count)."""
    out: list[list] = []
    for label, status in items:
        if out and out[-1][0] == label and out[-1][1] == status:
            out[-1][2] += 1
        else:
            out.append([label, status, 1])
    return [tuple(r) for r in out]
