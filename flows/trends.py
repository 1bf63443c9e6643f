"""The reports' benchmark figures and trends (issue 30), beside flows/reports.py's tables.

    benchmark_line(entry)          # "latency 0.12 ms (p90 0.20) …, vs published: latency ×0.99"
    trend_images(store, manifest)  # per target: the trend picture of its last nights, inline
    regressions_first(rows)        # the fleet report's rows, regressed targets first

Honest numbers: every benchmark line says where it was measured (this host's CPU and its
thread count; a device differs) and flags figures whose spread (p90 / median) is above
:data:`lowering.benchmark.SPREAD_FLAG` as measured on a loaded machine.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from lowering.benchmark import SPREAD_FLAG

from .history import change_cell, read_history
from .report_pictures import INLINE_PNG_LIMIT, inline_png, png_data_uri, trend_png

logger = logging.getLogger("lowerflow.reports")

#: Nights a trend picture shows.
TREND_NIGHTS = 30


def status_word(entry: Mapping[str, Any]) -> str:
    """``ok``, ``regressed`` (a gate refused tonight's program) or ``FAILED``."""
    return "ok" if entry.get("ok") else ("regressed" if entry.get("regressed") else "FAILED")


def benchmark_line(entry: Mapping[str, Any]) -> str | None:
    """The target's benchmark in one markdown line (None: not benchmarked)."""
    bench = entry.get("benchmark")
    if not bench:
        return None
    if bench.get("skipped"):
        return f"skipped ({bench['skipped']})"
    f = bench.get("figures") or {}
    parts = [f"latency {f.get('latency_ms')} ms (p90 {f.get('p90_ms')}, {f.get('rounds')} rounds)",
             f"load {f.get('load_ms')} ms"]
    if f.get("prefill_tok_s"):
        parts.append(f"prefill {f['prefill_tok_s']} tok/s, decode {f.get('decode_tok_s')} tok/s")
    if len(bench.get("methods") or {}) > 1:  # each method timed on its own; the figures are a round of all
        parts.append("per method: " + ", ".join(
            f"{m} {(r.get('figures') or {}).get('latency_ms')} ms"
            + (f" ×{r['ratios']['latency']:.2f}" if (r.get("ratios") or {}).get("latency") else "")
            for m, r in bench["methods"].items()))
    ratios = bench.get("ratios")
    if ratios:
        parts.append("vs published: " + ", ".join(f"{k} ×{v:.2f}" for k, v in ratios.items()))
    if bench.get("not_compared"):
        parts.append(f"not compared with the published program ({bench['not_compared']})")
    host = bench.get("host") or {}
    where = (f"measured on this host's CPU ({host.get('cpu')}, {host.get('threads')} threads, "
             f"load average {bench.get('load_average')}); a device's latency differs")
    if (f.get("spread") or 0) > SPREAD_FLAG:
        where += f"; **spread {f['spread']:.2f} (p90/median): a loaded machine, read the ratios, not the times**"
    line = "; ".join(parts) + f" — {where}"
    if entry.get("regressed") or entry.get("accepted_regressions"):
        line += f"; **change: {change_cell(entry)}**" + (" (published: accepted)" if entry.get("ok") else "")
    return line


def trend_images(store: Any, manifest: Mapping[str, Any], inline_limit: int = INLINE_PNG_LIMIT) -> dict[str, str]:
    """Per target with two nights or more in ``outputs/<model>/history.jsonl``: its trend
    picture as a ``data:`` URI (never fails the report: a picture that cannot be made is left out)."""
    name = str(manifest.get("name") or "model")
    try:
        history = read_history(store, name)
    except Exception:
        return {}
    images = {}
    for target in manifest.get("targets") or {}:
        lines = [line for line in history if line.get("target") == target][-TREND_NIGHTS:]
        if len(lines) < 2:
            continue
        try:
            small = inline_png(trend_png(lines, title=f"{name} / {target}"), limit=inline_limit)
        except Exception as exc:
            logger.warning("no trend picture for %s/%s: %s: %s", name, target, type(exc).__name__, exc)
            continue
        if small is not None:
            images[target] = png_data_uri(small)
    return images


def regressions_first(rows: list[dict]) -> list[dict]:
    """Fleet rows with the regressed ones first (stable otherwise)."""
    return sorted(rows, key=lambda r: r.get("ok") != "regressed")
