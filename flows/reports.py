"""Reports of lowering runs: markdown tables, text tables, and their publishing.

Everything here is a pure function of the manifests the flows return (see
``flows.lower_model``), except the two ``publish_*`` functions, which create
Prefect markdown artifacts and write memory-plan PNGs into the artifact store::

    model_report_markdown(model_manifest)   # per target: stages, delegation, memory, verify
    fleet_report_markdown(fleet_summary)    # one row per model x target
    fleet_rows(fleet_summary)               # the same rows as dicts (the CLI prints them)

The memory-plan pictures themselves (drawing, palette PNGs, inlining) are
:mod:`flows.report_pictures`'::

    memory_plan_png(plan, title="mlp")      # palette PNG bytes, identical for identical plans
    inline_png(png)                         # a PNG small enough for an artifact (or None)

A model manifest is ``{"model", "name", "targets": {target: {"ok", "pte", "error",
"stages", "memory_plan", "delegation", "verify"}}}``; a fleet summary is
``{"store", "models": {name: model manifest}, "ok", "failed"}``; a published
model's manifest also has ``"report": {"key", "artifact_id"}``.

In the Prefect UI a model artifact shows each target's memory-plan picture
inlined as a ``data:image/png;base64,...`` URI (a browser showing the UI cannot
load the store's ``file://`` or ``s3://`` URIs): the picture is a 256-colour
palette PNG of ~7 kB, inlined when at most
:data:`~flows.report_pictures.INLINE_PNG_LIMIT` bytes (see
:func:`~flows.report_pictures.inline_png`); the same PNG is in the store.  The fleet artifact links each model to its
artifact and shows per target the delegation coverage and the verify result.

The manifest's ``memory_plan`` entry is a summary (arena bytes, lower bound,
algorithm).  The picture needs the placements: :func:`publish_model_report`
takes them from its ``plans`` argument, or from the entry itself when it holds
the whole plan (``"allocations"``) or a ref to the plan's JSON (``"ref"``).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Mapping

from lowering.memory_plan import ARENA_MEM_ID, MemoryPlan

from .report_text import (  # noqa: F401 - format_seconds, first_line: the reports' API
    EMPHASIS_UNDERSCORE, first_line, format_bytes, format_seconds, markdown_table, md_cell, text_table,
)
from . import weights_only
from .history import change_cell
from .trends import benchmark_line, regressions_first, status_word, trend_images
from .report_pictures import (
    INLINE_PNG_LIMIT,
    as_memory_plan,
    inline_png,
    is_palette_png,
    memory_plan_png,
    plan_ratio,
    png_data_uri,
)

#: The stages of a target, in pipeline order (rows of unknown stages keep their order after these).
STAGE_ORDER = (
    "export",
    "partition",
    "create_submodule",
    "build_programs",
    "preprocess",
    "adjust",
    "lower_control_flow",
    "memory_plan",
    "emit",
    "verify",
    "benchmark",
)

#: Columns of :func:`fleet_rows` / the fleet tables.
FLEET_COLUMNS = ("model", "target", "ok", "pte bytes", "arena bytes", "cached", "seconds", "delegated", "verify",
                 "change", "error")

#: Key prefix of the Prefect artifacts this module creates.
ARTIFACT_PREFIX = "lowerflow"


logger = logging.getLogger("lowerflow.reports")



# --------------------------------------------------------------------------- formatting


# --------------------------------------------------------------------------- model report


def ordered_stages(stages: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Stage records in pipeline order (a stable sort: repeated stages keep their order)."""
    rank = {name: i for i, name in enumerate(STAGE_ORDER)}
    return sorted(stages, key=lambda r: rank.get(r.get("stage"), len(STAGE_ORDER)))


def stage_table(stages: Iterable[Mapping[str, Any]]) -> str:
    """Markdown table stage | cached? | seconds | bytes, with a total row."""
    records = ordered_stages(stages)
    rows = [
        (r.get("stage", "?"), _cached_cell(r), format_seconds(r.get("seconds")), format_bytes(r.get("bytes")))
        for r in records
    ]
    cached, total = count_cached(records), len(records)
    seconds = sum(float(r.get("seconds") or 0.0) for r in records)
    rows.append(("**total**", f"{cached}/{total} cached", format_seconds(seconds), ""))
    return markdown_table(("stage", "cached?", "seconds", "bytes"), rows, right=(2, 3))


def _cached_cell(record: Mapping[str, Any]) -> str:
    if record.get("state") == "Failed":
        return "failed"
    return "yes" if record.get("cached") else "no"


def count_cached(stages: Iterable[Mapping[str, Any]]) -> int:
    """How many stage records were cache hits."""
    return sum(1 for r in stages if r.get("cached"))


def delegation_line(delegation: Mapping[str, Any] | None) -> str:
    """``"12/20 nodes delegated (60.0%) in 2 partitions"``; None -> nothing delegated."""
    if not delegation:
        return "nothing delegated"
    done, total = int(delegation.get("delegated_nodes", 0)), int(delegation.get("total_nodes", 0))
    parts = int(delegation.get("partitions", 0))
    share = f" ({100.0 * done / total:.1f}%)" if total else ""
    line = f"{done}/{total} nodes delegated{share} in {parts} partition{'' if parts == 1 else 's'}"
    steps = delegation.get("backends")  # a chain: what each backend took, in order
    if steps:
        line += "; " + ", ".join(
            f"{backend}: {int(s.get('delegated_nodes', 0))} nodes in {_tags(s)}" for backend, s in steps.items())
    if delegation.get("compile_seconds") is not None:
        line += f"; vendor compile {float(delegation['compile_seconds']):.2f} s"
    return line


def _tags(step: Mapping[str, Any]) -> str:
    """``"2 partitions (VulkanBackend_tag0, VulkanBackend_tag1)"``."""
    parts, tags = int(step.get("partitions", 0)), step.get("partition_tags") or []
    return f"{parts} partition{'' if parts == 1 else 's'}" + (f" ({', '.join(tags)})" if tags else "")


def memory_line(summary: Mapping[str, Any] | None) -> str:
    """``"arena 131,072 B, lower bound 131,072 B (ratio 1.000, greedy_by_breadth)"``."""
    if not summary:
        return "no memory plan"
    arena, bound = arena_bytes(summary), summary.get("lower_bound")
    ratio = plan_ratio(arena, bound)
    algorithm = summary.get("algorithm")
    details = ", ".join(x for x in (f"ratio {ratio:.3f}" if ratio is not None else "", algorithm or "") if x)
    return f"arena {format_bytes(arena)} B, lower bound {format_bytes(bound)} B" + (f" ({details})" if details else "")


def arena_bytes(summary: Mapping[str, Any] | None) -> int | None:
    """Arena bytes of a plan summary (``arena_bytes``) or a whole plan dict (``arena_sizes``)."""
    if not summary:
        return None
    if summary.get("arena_bytes") is not None:
        return int(summary["arena_bytes"])
    sizes = summary.get("arena_sizes")
    if sizes is None:
        return None
    return int(sizes[ARENA_MEM_ID]) if len(sizes) > ARENA_MEM_ID else 0



def verify_table(verify: Mapping[str, Any] | None) -> str:
    """Markdown table runtime | ok | max abs diff | error, from ``VerifyReport.to_dict()``.

    A skipped runtime (``ok`` None) shows ``skipped`` and its reason; a report
    skipped as a whole (``{"ok": None, "skipped": reason}``) is one line.
    """
    if not verify:
        return "not verified"
    checks = verify.get("checks") or []
    if not checks:
        if verify.get("ok") is None:
            return f"skipped: {first_line(verify.get('skipped')) or 'no runtime ran'}"
        return "verified: " + ("ok" if verify.get("ok") else "FAILED")
    rows = [
        (
            _check_label(c),
            check_status(c.get("ok")),
            "—" if c.get("max_abs_diff") is None else f"{float(c['max_abs_diff']):.3g}",
            first_line(c.get("error") or c.get("skipped")),
        )
        for c in checks
    ]
    return markdown_table(("runtime", "ok", "max abs diff", "error"), rows, right=(2,))


def _check_label(check: dict) -> str:
    """The runtime, its method if the program has several, and for a dynamic program the
    sizes it ran at (``lowerflow (decode) @ seq=16``)."""
    runtime = str(check.get("runtime", "?")) + (f" ({check['method']})" if check.get("method") else "")
    inputs = check.get("inputs", "example")
    return runtime if inputs in (None, "example") else f"{runtime} @ {inputs}"


def check_status(ok: bool | None) -> str:
    """``ok`` / ``FAILED`` / ``skipped`` (None) for a verify check."""
    return "skipped" if ok is None else ("ok" if ok else "FAILED")


def update_line(update: Mapping[str, Any]) -> str:
    """What a device downloads for this run's update, against shipping the whole program."""
    what = ".ptd only (the program is unchanged)" if update.get("program") == "unchanged" else \
        f".pte + .ptd (the program is {update.get('program')})"
    return (f"{format_bytes(update.get('download_bytes'))} B to download, {what}, "
            f"of {format_bytes(update.get('whole_bytes'))} B for the whole program")


def target_section(target: str, entry: Mapping[str, Any], image: str | None = None, note: str | None = None,
                   trend: str | None = None) -> str:
    """The markdown of one target: status, .pte, stages, delegation, memory, verify.

    ``image`` is the URL (a ``data:`` URI in published reports) of the memory-plan
    picture, ``note`` a line under it (where the full-size PNG is, or why no picture).
    """
    lines = [f"## {_md_text(target)} — {status_word(entry)}", ""]
    if entry.get("error"):
        lines += [f"**error:** `{first_line(entry['error'], 400)}`", ""]
    pte = entry.get("pte")
    if pte:
        lines += [f"**.pte:** {format_bytes(pte.get('size'))} B, sha256 `{str(pte.get('sha256', ''))[:16]}`, `{pte.get('uri')}`", ""]
    if entry.get("ptd"):
        lines += [f"**.ptd** (the weights the .pte needs): {format_bytes(entry['ptd'].get('size'))} B, sha256 "
                  f"`{str(entry['ptd'].get('sha256', ''))[:16]}`, `{entry['ptd'].get('uri')}`", ""]
    if entry.get("update"):
        lines += [f"**device update:** {update_line(entry['update'])}", ""]
    if entry.get("weights_only"):
        lines += [f"**weights-only:** {weights_only.report_line(entry['weights_only'])}", ""]
    lines += [stage_table(entry.get("stages") or []), ""]
    lines += [f"**delegation:** {delegation_line(entry.get('delegation'))}", ""]
    if entry.get("quantize"):
        lines += [f"**quantized:** {quantize_line(entry['quantize'], entry.get('verify'))}", ""]
    lines += [f"**memory plan:** {memory_line(entry.get('memory_plan'))}", ""]
    if entry.get("methods"):
        lines += [methods_table(entry["methods"]), ""]
    if image:
        lines += [f"![memory plan of {target}]({image})", ""]
    if note:
        lines += [note, ""]
    lines += ["**verify:**", "", verify_table(entry.get("verify")), ""]
    lines += [f"**benchmark:** {benchmark_line(entry)}", ""] if benchmark_line(entry) else []
    lines += [f"![trend of {target}]({trend})", ""] if trend else []
    return "\n".join(lines)


def quantize_line(quantize: Mapping[str, Any], verify: Mapping[str, Any] | None) -> str:
    """The recipe, the weights' bytes against fp32, and the error against fp32 eager
    (of the program as run, and of its quantized eager reference)."""
    recipe = dict(quantize.get("recipe") or {})
    name = recipe.pop("recipe", "?")
    extra = ", ".join(f"{k} {v}" for k, v in recipe.items() if v not in ([], None))
    parts = [f"`{name}`" + (f" ({extra})" if extra else "")]
    weights = quantize.get("weight_bytes") or {}
    if weights.get("fp32"):
        parts.append(f"weights {format_bytes(weights.get('quantized'))} B of fp32's {format_bytes(weights['fp32'])} B "
                     f"({weights.get('quantized', 0) / weights['fp32']:.2f}×)")
    accuracy = next((c["accuracy"] for c in ((verify or {}).get("checks") or []) if c.get("accuracy")), None)
    if accuracy:
        parts.append(f"against fp32 eager: {_accuracy_text(accuracy)}")
    reference = (verify or {}).get("reference_accuracy")
    if reference:
        parts.append(f"quantized eager reference: {_accuracy_text(reference)}")
    return "; ".join(parts)


def _accuracy_text(accuracy: Mapping[str, Any]) -> str:
    sqnr = accuracy.get("sqnr_db")
    error = accuracy.get("max_error")
    return (f"SQNR {'∞' if sqnr is None else f'{float(sqnr):.1f}'} dB, max error "
            f"{'—' if error is None else f'{100 * float(error):.2f}%'}")


def methods_table(methods: Mapping[str, Any]) -> str:
    """Markdown table method | delegation | memory plan | verify, for a target of several methods."""
    rows = [
        (name, delegation_cell(m.get("delegation")), memory_line(m.get("memory_plan")), verify_cell(m.get("verify")))
        for name, m in methods.items()
    ]
    return markdown_table(("method", "delegated", "memory plan", "verify"), rows)


def model_report_markdown(
    model_manifest: Mapping[str, Any],
    *,
    images: Mapping[str, str] | None = None,
    notes: Mapping[str, str] | None = None,
    trends: Mapping[str, str] | None = None,
) -> str:
    """The report of one model: a section per target (see :func:`target_section`).

    ``images`` maps a target to the URL of its memory-plan picture, shown in its
    section; ``notes`` maps a target to a line shown under it.
    """
    name = model_manifest.get("name") or "?"
    targets = model_manifest.get("targets") or {}
    spec = model_manifest.get("model")
    lines = [f"# lowerflow: {_md_text(name)}", ""]
    if spec:
        lines += [f"model `{spec}`", ""]
    if model_manifest.get("trust_pickle"):
        lines += ["**trust_pickle:** its pickles were loaded (code in the file may have run: the entry trusts it)", ""]
    if model_manifest.get("error"):  # one cause for every target (flows/outages.py)
        lines += [f"**error:** `{first_line(model_manifest['error'], 400)}`", ""]
    if not targets:
        lines += ["no targets", ""]
    for target, entry in targets.items():
        lines.append(target_section(target, entry, (images or {}).get(target), (notes or {}).get(target),
                                    (trends or {}).get(target)))
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------- fleet report


def fleet_rows(fleet_summary: Mapping[str, Any], *, compact: bool = False) -> list[dict[str, Any]]:
    """One row per model x target (keys :data:`FLEET_COLUMNS`, display strings).

    A failed model without a manifest (it failed before any target ran) gets one
    row with target ``—``.  ``compact``: the fleet artifact's cells, short enough for
    the table to fit the V1 UI's content area at 1400 px (whole percentages, the
    verify runtimes as :data:`RUNTIME_ABBREVIATIONS`).
    """
    return regressions_first([
        _target_row(name, target, entry, compact) if entry is not None else _missing_row(name, error)
        for name, target, entry, error in _fleet_entries(fleet_summary)
    ])


def fleet_errors(fleet_summary: Mapping[str, Any], limit: int = 400) -> list[tuple[str, str, str]]:
    """(model, target, first line of the error) of each failed row of :func:`fleet_rows`;
    one row (target ``"all"``) for a model whose manifest has one error for every target."""
    errors, told = [], set()
    for name, target, _, error in _fleet_entries(fleet_summary):
        whole = ((fleet_summary.get("models") or {}).get(name) or {}).get("error")
        if whole and name not in told:
            told.add(name)
            errors.append((name, "all", first_line(whole, limit)))
        elif error and not whole:
            errors.append((name, target, first_line(error, limit)))
    return errors


def _fleet_entries(fleet_summary: Mapping[str, Any]):
    """(model, target, target entry or None, error) for each row of the fleet tables."""
    models = fleet_summary.get("models") or {}
    for name, manifest in models.items():
        targets = (manifest or {}).get("targets") or {}
        if not targets:
            yield name, "—", None, (manifest or {}).get("error") or "no targets ran"
        for target, entry in targets.items():
            yield name, target, entry, entry.get("error")
    for name in fleet_summary.get("failed") or []:
        if name not in models:
            yield name, "—", None, "failed before producing a manifest"


def _target_row(name: str, target: str, entry: Mapping[str, Any], compact: bool = False) -> dict[str, Any]:
    stages = entry.get("stages") or []
    plan = entry.get("memory_plan") or {}
    pte = entry.get("pte") or {}
    return {
        "model": name,
        "target": target,
        "ok": status_word(entry),
        "pte bytes": format_bytes(pte.get("size")),
        "arena bytes": format_bytes(arena_bytes(plan)),
        "cached": f"{count_cached(stages)}/{len(stages)}",
        "seconds": format_seconds(sum(float(r.get("seconds") or 0.0) for r in stages)),
        "delegated": delegation_cell(entry.get("delegation"), digits=0 if compact else 1),
        "verify": verify_cell(entry.get("verify"), short=compact),
        "change": change_cell(entry, compact=compact),
        "error": first_line(entry.get("error"), 100),
    }


def _missing_row(name: str, error: str) -> dict[str, Any]:
    return {"model": name, "target": "—", "ok": "FAILED", "pte bytes": "—", "arena bytes": "—",
            "cached": "0/0", "seconds": "—", "delegated": "—", "verify": "—", "change": "—",
            "error": first_line(error, 100)}


def delegation_cell(delegation: Mapping[str, Any] | None, digits: int = 1) -> str:
    """``"15/20 (75.0%)"`` delegated nodes of all nodes (``digits`` after the point);
    ``"—"`` without delegation (portable)."""
    if not delegation:
        return "—"
    done, total = int(delegation.get("delegated_nodes", 0)), int(delegation.get("total_nodes", 0))
    return f"{done}/{total}" + (f" ({100.0 * done / total:.{digits}f}%)" if total else "")


#: The verify runtimes as the fleet artifact's table names them (its legend spells them out).
RUNTIME_ABBREVIATIONS = {"lowerflow": "lf", "executorch": "et"}


def verify_cell(verify: Mapping[str, Any] | None, short: bool = False) -> str:
    """The verify result in a word, with the runtimes it rests on.

    ``"ok (lowerflow, executorch)"``: the runtimes that matched eager (skipped
    ones are not named); ``"FAILED (executorch)"``: the ones that did not;
    ``"skipped"``: no runtime ran; ``"—"``: not verified (or failed before).
    ``short``: the runtimes as :data:`RUNTIME_ABBREVIATIONS` (``"ok (lf, et)"``).
    """
    if not verify:
        return "—"
    checks = verify.get("checks") or []
    ok = verify.get("ok")
    if ok is None:
        return "skipped"
    named = list(dict.fromkeys(str(c.get("runtime", "?")) for c in checks if c.get("ok") is bool(ok)))
    if short:
        named = [RUNTIME_ABBREVIATIONS.get(n, n) for n in named]
    return ("ok" if ok else "FAILED") + (f" ({', '.join(named)})" if named else "")


#: Right-aligned columns of the fleet tables (indices into FLEET_COLUMNS).
_FLEET_RIGHT = (3, 4, 5, 6)


def fleet_text_table(fleet_summary: Mapping[str, Any]) -> str:
    """The fleet rows as a plain-text table (what the CLI and the demo print)."""
    rows = [[r[c] for c in FLEET_COLUMNS] for r in fleet_rows(fleet_summary)]
    return text_table(FLEET_COLUMNS, rows, right=_FLEET_RIGHT)


def fleet_report_markdown(fleet_summary: Mapping[str, Any]) -> str:
    """The fleet report: a status line, one table row per model x target (regressions
    first), then the errors.

    A model whose report was published (its manifest's ``"report"``, see
    :func:`publish_model_report`) links to its artifact (:func:`model_report_link`).
    The table must fit the Prefect V1 UI's content area (830 px at a 1400 px window; its
    cells do not wrap, a wider table is cut at the right): errors are listed under the
    table, not in a column; the cells are :func:`fleet_rows`'s compact ones (a quantized
    program's change on two lines); the artifact's columns are :data:`FLEET_ARTIFACT_COLUMNS`.  The demo fleet
    with a change on every target and a regression: 781 px wide in V1 (measured in Chromium).
    """
    rows = fleet_rows(fleet_summary, compact=True)
    models = fleet_summary.get("models") or {}
    failed = list(fleet_summary.get("failed") or [])
    status = "all models lowered" if fleet_summary.get("ok") and not failed else f"FAILED: {', '.join(_md_text(n) for n in failed) or '?'}"
    columns = FLEET_ARTIFACT_COLUMNS
    body = []
    for r in rows:
        cells = [md_cell(r[c]) if c != "change" else "<br>".join(map(md_cell, r[c].split("\n"))) for c in columns]
        link = model_report_link((models.get(r["model"]) or {}).get("report"))
        if link:
            cells[0] = _md_link(r["model"], link)
        body.append("| " + " | ".join(cells) + " |")
    rule = "|" + "|".join("---:" if FLEET_COLUMNS.index(c) in _FLEET_RIGHT else "---" for c in columns) + "|"
    lines = [
        "# lowerflow fleet",
        "",
        f"store `{fleet_summary.get('store', '?')}` · {len(models)} models · {stages_line(fleet_summary)} · {status}",
        "",
        "| " + " | ".join(columns) + " |",
        rule,
        *body,
        "",
        f"change: tonight's program against the published one — {FLEET_CHANGE_LEGEND}",
        "",
        f"verify: the runtimes whose outputs matched eager — {FLEET_RUNTIME_LEGEND}",
    ]
    errors = fleet_errors(fleet_summary)
    if errors:
        lines += ["", "**errors**", ""]
        lines += [f"- {_md_text(model)} / {_md_text(target)}: {_md_text(error)}" for model, target, error in errors]
    return "\n".join(lines) + "\n"


#: The fleet artifact's columns: :data:`FLEET_COLUMNS` without the error (listed under the
#: table), the stages' cache hits and seconds (totalled in the status line) and the arena
#: bytes (in each model's report), which would widen the table past the V1 UI.
FLEET_ARTIFACT_COLUMNS = ("model", "target", "ok", "change", "pte bytes", "delegated", "verify")


def stages_line(fleet_summary: Mapping[str, Any]) -> str:
    """``"98/140 stages cached, 212.4 s"``: the stage records of every target of the fleet."""
    stages = [r for m in (fleet_summary.get("models") or {}).values()
              for e in ((m or {}).get("targets") or {}).values() for r in (e.get("stages") or [])]
    seconds = sum(float(r.get("seconds") or 0.0) for r in stages)
    return f"{count_cached(stages)}/{len(stages)} stages cached, {seconds:.1f} s"


#: The legend of :func:`~flows.history.change_cell`'s compact cells under the fleet artifact's table.
FLEET_CHANGE_LEGEND = ("lat: median latency, new/old, both run interleaved on this host; size: .pte bytes; "
                       "err: max error; sqnr: SQNR change (quantized programs); —: nothing to compare")


#: The legend of :data:`RUNTIME_ABBREVIATIONS` under the fleet artifact's table.
FLEET_RUNTIME_LEGEND = "lf: lowerflow's own runtime, et: ExecuTorch's runtime"


def model_report_link(report: Mapping[str, Any] | None) -> str | None:
    """The link from the fleet artifact to a model's artifact, or None.

    Relative to the fleet artifact's page: the Prefect UI shows an artifact's
    markdown at ``<ui>/artifacts/artifact/<id>`` (3.8.8: the V1 UI at ``/``, the
    V2 UI at ``/v2/``, Prefect Cloud under its workspace path), so
    ``../artifact/<id>`` opens this run's model artifact in whichever UI shows
    the fleet, at any serve base.  An absolute ``PREFECT_UI_URL`` link would
    switch V2 users to the V1 UI.  Without an id, ``../key/<key>`` (the key's
    page: every version of the model's report, newest first).
    """
    if not report:
        return None
    if report.get("artifact_id"):
        return f"../artifact/{report['artifact_id']}"
    if report.get("key"):
        return f"../key/{report['key']}"
    return None


def _md_text(text: Any) -> str:
    """``text`` as literal markdown text on one line: markdown's ASCII punctuation
    backslash-escaped, ``_`` only where it could open or close emphasis (``buffer_mutation``
    stays as it is: both Prefect UIs render it so, and a link's text must not need escapes)."""
    escaped = re.sub(r"([\\`*{}\[\]<>()#+!|~])", r"\\\1", str(text).replace("\n", " "))
    return EMPHASIS_UNDERSCORE.sub(r"\\_", escaped)


def _md_link(text: Any, url: str) -> str:
    """A link to ``url`` showing ``text``.

    Prefect's V1 UI (3.8.8) shows a backslash escape inside a link's text literally
    (``[buffer\\_mutation](…)`` reads ``buffer\\_mutation``), where its V2 UI and text
    outside links render it.  A text that needs no escape is the link's text; one that
    does is shown escaped, followed by the link: ``x.\\_y\\_ [↗](…)`` (an arrow: the
    fleet table must stay narrow).
    """
    escaped = _md_text(text)
    return f"[{escaped}]({url})" if escaped == str(text) else f"{escaped} [↗]({url})"


# --------------------------------------------------------------------------- publishing


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from ``parts``.

    ``artifact_key("model", "buffer_mutation")`` -> ``"lowerflow-model-buffer-mutation"``.
    """
    text = "-".join((ARTIFACT_PREFIX, *parts)).lower()
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", text)).strip("-")


def plan_image_name(name: str, target: str) -> str:
    """The named output of a target's memory-plan picture: ``<name>/<target>.memory_plan.png``."""
    return f"{name}/{target}.memory_plan.png"


def find_plan(entry: Mapping[str, Any], store: Any) -> MemoryPlan | None:
    """The full memory plan of a target's manifest entry, if it carries one.

    The entry's ``memory_plan`` may hold the whole plan (``"allocations"``), or a
    ref to the plan's JSON in ``store`` (``"ref": {"uri", "sha256", "size"}``).
    """
    summary = entry.get("memory_plan") or {}
    if "allocations" in summary:
        return MemoryPlan.from_dict(summary)
    ref = summary.get("ref")
    if not ref:
        return None
    import json

    from tasks.store import ArtifactRef

    data = store.get_bytes(ArtifactRef(str(ref["uri"]), str(ref["sha256"]), int(ref["size"]), str(ref.get("kind", "memory_plan"))))
    return as_memory_plan(json.loads(data))


def publish_model_report(
    model_manifest: Mapping[str, Any],
    store: Any = None,
    *,
    plans: Mapping[str, MemoryPlan | Mapping[str, Any]] | None = None,
    inline_limit: int = INLINE_PNG_LIMIT,
) -> dict[str, Any]:
    """Write each target's memory-plan PNG to ``store`` and create the model's markdown artifact.

    ``store`` is an :class:`~tasks.store.ArtifactStore` or a URL (None: the default
    store).  ``plans`` maps targets to their plans; otherwise :func:`find_plan`
    looks in the manifest.  Each picture is inlined in the artifact as a ``data:``
    URI (:func:`inline_png`, at most ``inline_limit`` bytes; past it, a note names
    the PNG in the store instead).

    Returns ``{"key", "artifact_id", "markdown", "images": {target: store uri},
    "inlined": {target: inlined PNG bytes}}``, and records ``{"key", "artifact_id"}``
    as the manifest's ``"report"`` (when it is a dict) for the fleet report's links.
    """
    from prefect.artifacts import create_markdown_artifact

    from tasks.store import ArtifactStore

    store = store if isinstance(store, ArtifactStore) else ArtifactStore(store)
    name = str(model_manifest.get("name") or "model")
    images: dict[str, str] = {}
    inline: dict[str, str] = {}
    notes: dict[str, str] = {}
    inlined: dict[str, int] = {}
    for target, entry in (model_manifest.get("targets") or {}).items():
        if entry.get("regressed"):  # refused by a gate: last night's picture stays
            continue
        published = _publish_plan_image(store, name, target, (plans or {}).get(target), entry)
        if published is None:
            continue
        uri, png = published
        images[target] = uri
        full = f"full-size picture ({format_bytes(len(png))} B): `{uri}`"
        try:
            small = _inline_once(store, png, inline_limit)
        except Exception as exc:  # never fail a lowering over its report's picture
            logger.warning("memory-plan picture of %s/%s not inlined: %s: %s", name, target, type(exc).__name__, exc)
            notes[target] = f"memory-plan picture not shown ({type(exc).__name__}); {full}"
            continue
        if small is not None:
            inline[target], inlined[target] = png_data_uri(small), len(small)
            notes[target] = full
        else:
            notes[target] = f"memory-plan picture not shown: over the {format_bytes(inline_limit)} B inline limit of the report; {full}"
    markdown = model_report_markdown(model_manifest, images=inline, notes=notes, trends=trend_images(store, model_manifest))
    key = artifact_key("model", name)
    artifact_id = create_markdown_artifact(markdown=markdown, key=key, description=f"lowerflow report of {name}")
    report = {"key": key, "artifact_id": str(artifact_id) if artifact_id else None}
    if isinstance(model_manifest, dict):
        model_manifest["report"] = report
    return {**report, "markdown": markdown, "images": images, "inlined": inlined}


def _publish_plan_image(store: Any, name: str, target: str, plan: Any, entry: Mapping[str, Any]) -> tuple[str, bytes] | None:
    """Write one target's memory-plan PNG; (its URI, its bytes), or None without a plan.

    A picture that cannot be made (plan missing from the store, ...) is a warning,
    never a failure of the lowering that publishes the report.
    """
    try:
        # Drawing takes up to ~1.5 s (the LSTM): draw once per plan, keyed by the
        # plan's digest and title, and reuse the picture on warm runs.
        plan_sha = (entry.get("memory_plan") or {}).get("ref", {}).get("sha256") if plan is None else None
        drawn = f"pictures/{plan_sha}-{_slug(name)}-{_slug(target)}.png" if plan_sha else None
        if drawn is not None:
            try:
                png = store.get_named(drawn)
            except Exception:
                png = None
            if png is not None:
                return store.put_named(plan_image_name(name, target), png, "png").uri, png
        plan = plan if plan is not None else find_plan(entry, store)
        if plan is None:
            return None
        png = memory_plan_png(plan, title=f"{name} / {target}")
        if drawn is not None:
            store.put_named(drawn, png, "png")
        return store.put_named(plan_image_name(name, target), png, "png").uri, png
    except Exception as exc:
        logger.warning("no memory-plan picture for %s/%s: %s: %s", name, target, type(exc).__name__, exc)
        return None


def _inline_once(store: Any, png: bytes, limit: int) -> bytes | None:
    """:func:`inline_png`, computed once per picture and limit (the palette reduction takes
    40-60 ms a picture, most of a warm fleet's report cost): kept in the store as
    ``pictures/inline-<sha256 of png>-<limit>.png``, empty when over the limit."""
    import hashlib

    if is_palette_png(png):  # inlined as it is: nothing to compute
        return inline_png(png, limit=limit)
    name = f"pictures/inline-{hashlib.sha256(png).hexdigest()}-{limit}.png"
    try:
        kept = store.get_named(name)
    except Exception:
        kept = None
    if kept is not None:
        return kept or None
    small = inline_png(png, limit=limit)
    try:
        store.put_named(name, small or b"", "png")
    except Exception:  # a read-only or flaky store: the next report computes it again
        pass
    return small


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def publish_fleet_report(summary: Mapping[str, Any]) -> dict[str, Any]:
    """Create the fleet's markdown artifact (key ``lowerflow-fleet``); returns ``{"key", "markdown"}``."""
    from prefect.artifacts import create_markdown_artifact

    markdown = fleet_report_markdown(summary)
    key = artifact_key("fleet")
    create_markdown_artifact(markdown=markdown, key=key, description="lowerflow fleet report")
    return {"key": key, "markdown": markdown}
