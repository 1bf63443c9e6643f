"""Each night's figures per model and target: ``outputs/<model>/history.jsonl``.

One JSON line per target lowered by a run (a target kept from an earlier run adds none)::

    {"time": "2026-11-27T22:10:03Z", "flow_run": "…", "target": "xnnpack", "ok": true,
     "sha256": "…", "pte_bytes": 145848, "arena_bytes": 147456, "latency_ms": 0.12, "p90_ms": 0.2,
     "spread": 1.6, "load_ms": 0.4, "ratios": {"latency": 0.99, …}, "change": {"latency": 0.99,
     "size": 1.0}, "max_error": 0.01, "sqnr_db": 38.2, "host": {"cpu": …, "threads": 2}}

``"regressed"`` marks a program a gate refused (flows/gates.py), ``"accepted"`` one published
despite it.  The file keeps the last :data:`HISTORY_LINES` lines; ``lowerflow gc`` keeps it
(everything under outputs/ is kept).  The model report draws it (flows/report_pictures.py:
:func:`~flows.report_pictures.trend_png`), the fleet report shows tonight's ``change``.

Also here: :func:`manifest_to_store`, the manifest a run publishes when a gate refused some
of its targets (their records stay last night's).
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping

from .gates import accuracy

#: Lines kept per model (all its targets): a year of nights for one target, a quarter for four.
HISTORY_LINES = 400


def history_name(name: str) -> str:
    return f"{name}/history.jsonl"


def history_lines(manifest: Mapping[str, Any]) -> list[dict]:
    """The history lines of the targets ``manifest``'s run lowered."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    lines = []
    for target, record in (manifest.get("targets") or {}).items():
        if record.get("kept_from") or record.get("ok") is None:
            continue
        bench = record.get("benchmark") or {}
        figures = bench.get("figures") or {}
        line = {"time": now, "flow_run": manifest.get("flow_run"), "target": target, "ok": bool(record.get("ok")),
                "sha256": (record.get("pte") or {}).get("sha256"),
                "pte_bytes": bench.get("pte_bytes") or (record.get("pte") or {}).get("size"),
                "arena_bytes": bench.get("arena_bytes") or (record.get("memory_plan") or {}).get("arena_bytes"),
                **{k: figures[k] for k in ("latency_ms", "p90_ms", "spread", "load_ms", "prefill_tok_s",
                                           "decode_tok_s") if figures.get(k) is not None},
                **({"ratios": bench["ratios"]} if bench.get("ratios") else {}),
                **({"change": record["change"]} if record.get("change") else {}),
                **accuracy(record),
                **({"host": bench["host"], "load_average": bench.get("load_average")} if bench.get("host") else {}),
                **({"regressed": True} if record.get("regressed") else {}),
                **({"accepted": record["accepted_regressions"]} if record.get("accepted_regressions") else {})}
        lines.append(line)
    return lines


def read_history(store, name: str) -> list[dict]:
    """The model's history lines, oldest first (``[]`` when it has none)."""
    try:
        text = store.get_named(history_name(name)).decode()
    except Exception:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a torn line (a writer killed mid-way): skipped
            continue
    return out


def append_history(store, manifest: Mapping[str, Any]) -> None:
    """Append the run's lines to the model's history, keeping the last :data:`HISTORY_LINES`."""
    lines = history_lines(manifest)
    if not lines or manifest.get("error"):
        return
    kept = (read_history(store, manifest["name"]) + lines)[-HISTORY_LINES:]
    text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in kept)
    store.put_named(history_name(manifest["name"]), text.encode(), "history")


def manifest_to_store(manifest: dict, publisher) -> dict | None:
    """The manifest to write to outputs/: ``manifest``, with each target a gate refused
    back to its published record (:meth:`flows.gates.Publisher.previous`); None when every
    target this run lowered was refused (last night's manifest stays byte-identical)."""
    regressed = [t for t, r in manifest["targets"].items() if r.get("regressed")]
    if not regressed:
        return manifest
    lowered = [t for t, r in manifest["targets"].items() if not r.get("kept_from")]
    if set(lowered) <= set(regressed):
        return None
    stored = {**manifest, "targets": dict(manifest["targets"])}
    for target in regressed:
        previous = publisher.previous(manifest["name"], target)
        if previous is None:
            del stored["targets"][target]
        else:
            stored["targets"][target] = previous
    return stored


def change_cell(record: Mapping[str, Any], compact: bool = False) -> str:
    """The change against the published program: ``latency ×0.97, size ×1.00`` (``—``:
    nothing to compare; a first lowering, or the same program).

    ``compact``: the fleet artifact's cell, narrow enough for its table to fit the V1 UI
    (flows/reports.py): ``lat ×0.97 · size ×1.00``, a quantized program's accuracy on a
    second line (``err ×2.00 · sqnr -2.5 dB``; the artifact breaks the cell there)."""
    change = record.get("change") or {}

    def ratio(figure: str) -> list[str]:
        name = COMPACT_FIGURES[figure] if compact else figure
        return [f"{name} ×{change[figure]:.2f}"] if change.get(figure) is not None else []

    speed = ratio("latency") + ratio("size")
    quality = ratio("error") + ([f"sqnr {-change['sqnr_drop_db']:+.1f} dB"] if change.get("sqnr_drop_db") is not None else [])
    if not compact:
        return ", ".join(speed + quality) or "—"
    return "\n".join(" · ".join(line) for line in (speed, quality) if line) or "—"


#: The figures' names in the fleet artifact's change cells (its legend spells them out).
COMPACT_FIGURES = {"latency": "lat", "size": "size", "error": "err"}
