"""A target's record over the methods of a model of several methods: each method's quantize,
memory plan, delegation and verify records summed or combined into the target's own
(:func:`flows.lower_model.lower_target_methods`)."""

from __future__ import annotations


def total_quantize(recipe: dict, entries: list[dict]) -> dict:
    """The target's ``quantize`` record over its methods (nodes and weight bytes summed)."""
    return {"recipe": recipe, "calibration": None,
            "quantized_nodes": sum(e["quantized_nodes"] for e in entries),
            "weight_bytes": {k: sum(e["weight_bytes"][k] for e in entries) for k in ("fp32", "quantized")}}


def total_plan(plans: list[dict]) -> dict:
    """The methods' memory plans summed (each method has its own arena; shared state,
    in every method's plan, is counted once)."""
    shared = max((int(p.get("shared_state_bytes", 0)) for p in plans), default=0)
    return {
        "arena_bytes": sum(int(p["arena_bytes"]) for p in plans) - shared * max(len(plans) - 1, 0),
        "lower_bound": sum(int(p["lower_bound"]) for p in plans),
        "algorithm": ",".join(sorted({str(p["algorithm"]) for p in plans})),
    }


def total_delegation(summaries: list[dict]) -> dict:
    return {k: sum(int(s[k]) for s in summaries) for k in ("partitions", "delegated_nodes", "total_nodes")}


def combined_verify(reports: dict[str, dict]) -> dict:
    """One verify report over the methods: each check says its ``method``; ok unless one failed."""
    checks = [{**check, "method": method} for method, report in reports.items() for check in report.get("checks", [])]
    oks = [report.get("ok") for report in reports.values()]
    ok = False if False in oks else (None if all(o is None for o in oks) else True)
    return {"ok": ok, "checks": checks}
