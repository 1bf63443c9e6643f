"""Names in the reports' markdown read as they are in both Prefect UIs (browser check:
tests/test_ui_render.py): no escape where none is needed (V1 shows a backslash escape
inside a link's text literally), an escape where ``_`` could start emphasis, and a
fleet table whose cells stay short (it must fit the V1 UI at 1400 px)."""

from __future__ import annotations

from flows.reports import fleet_report_markdown, fleet_rows, model_report_markdown


def summary(*names: str) -> dict:
    entry = {"ok": True, "stages": [], "verify": {"ok": True, "checks": [
        {"runtime": "lowerflow", "ok": True}, {"runtime": "executorch", "ok": True}]},
        "delegation": {"delegated_nodes": 2, "total_nodes": 3}}
    return {"store": "memory://s", "ok": False, "failed": [names[-1]],
            "models": {n: {"name": n, "targets": {"xnnpack": entry}, "report": {"artifact_id": f"id-{n}"}}
                       for n in names}}


def test_a_name_with_underscores_inside_words_is_linked_unescaped():
    md = fleet_report_markdown(summary("buffer_mutation", "x._odd_"))
    assert "| [buffer_mutation](../artifact/id-buffer_mutation) |" in md
    # Underscores that could open or close emphasis: escaped, the link after the name.
    assert "| x.\\_odd\\_ [↗](../artifact/id-x._odd_) |" in md
    assert "FAILED: x.\\_odd\\_" in md


def test_model_report_heading_and_sections_escape_names():
    md = model_report_markdown({"name": "_private_model", "targets": {"my_target": {"ok": True, "stages": []}}})
    assert md.startswith("# lowerflow: \\_private_model\n")
    assert "## my_target — ok" in md


def test_fleet_cells_are_compact_in_markdown_and_whole_in_text():
    s = summary("mlp")
    assert [(r["delegated"], r["verify"]) for r in fleet_rows(s, compact=True)] == [("2/3 (67%)", "ok (lf, et)")]
    assert [(r["delegated"], r["verify"]) for r in fleet_rows(s)] == [("2/3 (66.7%)", "ok (lowerflow, executorch)")]
    assert "lf: lowerflow's own runtime, et: ExecuTorch's runtime" in fleet_report_markdown(s)
