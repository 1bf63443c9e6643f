"""Run reports: markdown tables from manifests, memory-plan PNGs, Prefect artifacts."""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import struct
import uuid
import zlib

import pytest

from examples.models import MODELS
from flows.report_pictures import inline_png, is_palette_png, memory_plan_png, png_data_uri, png_size
from flows.reports import (
    artifact_key,
    find_plan,
    fleet_report_markdown,
    fleet_rows,
    fleet_text_table,
    model_report_markdown,
    plan_image_name,
    publish_fleet_report,
    publish_model_report,
)
from lowering.export import export
from lowering.memory_plan import memory_plan


@pytest.fixture(scope="module")
def cnn_plan():
    return memory_plan(export(*MODELS["cnn"]()))


def stage(name, cached, seconds, nbytes=None, state=None):
    return {"stage": name, "cached": cached, "seconds": seconds,
            "state": state or ("Cached" if cached else "Completed"), "bytes": nbytes}


def cnn_manifest(plan):
    """A model manifest in the shape lower_model returns: one delegated target, one failed."""
    return {
        "model": "examples/models.py:cnn",
        "name": "cnn",
        "targets": {
            "reference": {
                "ok": True,
                "pte": {"uri": "memory://s/outputs/cnn/reference.pte", "sha256": "ab" * 32, "size": 123456},
                "error": None,
                "stages": [
                    stage("export", True, 0.25, 40000),
                    stage("partition", True, 0.5, 41000),
                    stage("create_submodule", False, 0.125),
                    stage("build_programs", False, 0.125),
                    stage("preprocess", False, 1.0, 90000),
                    stage("adjust", False, 0.25, 42000),
                    stage("memory_plan", False, 0.5, 2000),
                    stage("emit", False, 0.25, 123456),
                    stage("verify", False, 1.5),
                ],
                "memory_plan": {"arena_bytes": 98304, "lower_bound": 65536, "algorithm": "greedy_by_size"},
                "delegation": {"delegated_nodes": 15, "total_nodes": 20, "partitions": 2},
                "verify": {"ok": True, "checks": [
                    {"runtime": "lowerflow", "ok": True, "max_abs_diff": 2.5e-07, "error": None},
                    {"runtime": "executorch", "ok": True, "max_abs_diff": 0.0, "error": None},
                    {"runtime": "other", "ok": None, "max_abs_diff": None, "error": None,
                     "skipped": "backends not in this runtime: ['ReferenceBackend']"},
                ]},
            },
            "portable": {
                "ok": False,
                "pte": None,
                "error": "MemoryPlanError: op foo has no out variant\n  more detail",
                "stages": [stage("export", True, 0.25, 40000), stage("memory_plan", False, 0.5, None, "Failed")],
                "memory_plan": plan.to_dict(),
                "delegation": None,
                "verify": None,
            },
        },
    }


def table_rows(markdown, header):
    """The body rows (as cell lists) of the markdown table starting with ``header``."""
    lines = markdown.splitlines()
    start = lines.index(header)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows


# --------------------------------------------------------------------------- model report


def test_model_report_stage_table_in_pipeline_order_with_totals(cnn_plan):
    md = model_report_markdown(cnn_manifest(cnn_plan))
    assert md.startswith("# lowerflow: cnn\n")
    assert "## reference — ok" in md and "## portable — FAILED" in md
    reference = md[md.index("## reference"):md.index("## portable")]
    rows = table_rows(reference, "| stage | cached? | seconds | bytes |")
    assert [r[0] for r in rows] == [
        "export", "partition", "create_submodule", "build_programs", "preprocess",
        "adjust", "memory_plan", "emit", "verify", "**total**",
    ]
    assert rows[0] == ["export", "yes", "0.25", "40,000"]
    assert rows[2] == ["create_submodule", "no", "0.12", "—"]
    assert rows[-1][:3] == ["**total**", "2/9 cached", "4.50"]


def test_model_report_delegation_memory_and_verify(cnn_plan):
    md = model_report_markdown(cnn_manifest(cnn_plan))
    assert "**delegation:** 15/20 nodes delegated (75.0%) in 2 partitions" in md
    assert "**memory plan:** arena 98,304 B, lower bound 65,536 B (ratio 1.500, greedy_by_size)" in md
    reference = md[md.index("## reference"):md.index("## portable")]
    assert table_rows(reference, "| runtime | ok | max abs diff | error |") == [
        ["lowerflow", "ok", "2.5e-07", ""],
        ["executorch", "ok", "0", ""],
        ["other", "skipped", "—", "backends not in this runtime: ['ReferenceBackend']"],
    ]
    assert "**.pte:** 123,456 B" in reference


def test_model_report_failed_target_shows_first_error_line_and_failed_stage(cnn_plan):
    md = model_report_markdown(cnn_manifest(cnn_plan))
    portable = md[md.index("## portable"):]
    assert "**error:** `MemoryPlanError: op foo has no out variant`" in portable
    assert "more detail" not in portable
    rows = table_rows(portable, "| stage | cached? | seconds | bytes |")
    assert rows[1] == ["memory_plan", "failed", "0.50", "—"]
    assert "**delegation:** nothing delegated" in portable
    ratio = cnn_plan.arena_bytes / cnn_plan.lower_bound
    assert f"(ratio {ratio:.3f}, {cnn_plan.algorithm})" in portable
    assert "not verified" in portable


def test_model_report_verify_skipped_as_a_whole():
    manifest = {"name": "m", "targets": {"portable": {"ok": True, "stages": [], "verify": {
        "ok": None, "checks": [], "skipped": "a .pt2 model has no eager module to compare with"}}}}
    assert "skipped: a .pt2 model has no eager module to compare with" in model_report_markdown(manifest)


def test_model_report_shows_images_and_notes():
    manifest = {"name": "m", "model": "x.py:m", "targets": {"portable": {"ok": True, "stages": []},
                                                           "reference": {"ok": True, "stages": []}}}
    md = model_report_markdown(manifest, images={"portable": "data:image/png;base64,AAAA"},
                               notes={"portable": "full size: `s3://b/p.png`", "reference": "too large"})
    portable = md[md.index("## portable"):md.index("## reference")]
    assert "![memory plan of portable](data:image/png;base64,AAAA)\n\nfull size: `s3://b/p.png`" in portable
    reference = md[md.index("## reference"):]
    assert "![" not in reference and "too large" in reference


def test_markdown_cells_are_escaped():
    manifest = {"name": "m", "targets": {"t": {"ok": False, "error": "a | b in __init__ [x](y)\nmore", "stages": []}}}
    summary = {"store": "memory://s", "models": {"m": manifest}, "ok": False, "failed": ["m"]}
    md = fleet_report_markdown(summary)
    assert "- m / t: a \\| b in \\_\\_init\\_\\_ \\[x\\]\\(y\\)\n" in md
    assert "more" not in md
    rows = table_rows(model_report_markdown({"name": "m", "targets": {"t": {"ok": True, "stages": [
        {"stage": "a|b", "cached": True, "seconds": 1.0}]}}}), "| stage | cached? | seconds | bytes |")
    assert rows[0][0] == "a\\|b"


# --------------------------------------------------------------------------- fleet report


def fleet_summary(plan):
    mlp = {
        "model": "examples/models.py:mlp", "name": "mlp",
        "targets": {"portable": {
            "ok": True, "pte": {"uri": "u", "sha256": "cd" * 32, "size": 70000}, "error": None,
            "stages": [stage("export", True, 0.5), stage("memory_plan", True, 0.25), stage("emit", False, 1.0)],
            "memory_plan": {"arena_bytes": 8192, "lower_bound": 8192, "algorithm": "greedy_by_size"},
            "delegation": None, "verify": None,
        }},
    }
    return {"store": "memory://fleet", "models": {"mlp": mlp, "cnn": cnn_manifest(plan)},
            "ok": False, "failed": ["cnn", "broken"]}


def test_fleet_rows_one_per_model_and_target(cnn_plan):
    rows = fleet_rows(fleet_summary(cnn_plan))
    assert [(r["model"], r["target"]) for r in rows] == [
        ("mlp", "portable"), ("cnn", "reference"), ("cnn", "portable"), ("broken", "—"),
    ]
    assert rows[0] == {"model": "mlp", "target": "portable", "ok": "ok", "pte bytes": "70,000",
                       "arena bytes": "8,192", "cached": "2/3", "seconds": "1.75",
                       "delegated": "—", "verify": "—", "change": "—", "error": ""}
    assert rows[1]["cached"] == "2/9" and rows[1]["pte bytes"] == "123,456"
    assert rows[1]["delegated"] == "15/20 (75.0%)"
    assert rows[1]["verify"] == "ok (lowerflow, executorch)"  # `other` was skipped: not named
    assert rows[3]["delegated"] == rows[3]["verify"] == "—"
    assert rows[2]["ok"] == "FAILED" and rows[2]["error"] == "MemoryPlanError: op foo has no out variant"
    assert rows[2]["arena bytes"] == f"{cnn_plan.arena_bytes:,}"
    assert rows[3]["ok"] == "FAILED"


def test_fleet_markdown_and_text_tables(cnn_plan):
    summary = fleet_summary(cnn_plan)
    md = fleet_report_markdown(summary)
    # The stages' cache hits and seconds: totalled in the status line, not columns (the table fits V1).
    assert "store `memory://fleet` · 2 models · 5/14 stages cached, 7.0 s · FAILED: cnn, broken" in md
    header = "| model | target | ok | change | pte bytes | delegated | verify |"
    rows = table_rows(md, header)
    assert rows[0] == ["mlp", "portable", "ok", "—", "70,000", "—", "—"]
    assert rows[1][5:7] == ["15/20 (75%)", "ok (lf, et)"]  # compact: the table fits the V1 UI at 1400 px
    assert len(rows) == 4
    # Errors under the table, whole first lines (a column would widen the table past the UI).
    errors = md[md.index("**errors**"):].splitlines()[2:]
    assert errors == ["- cnn / portable: MemoryPlanError: op foo has no out variant",
                      "- broken / —: failed before producing a manifest"]
    text = fleet_text_table(summary).splitlines()
    assert text[0].split() == ["model", "target", "ok", "pte", "bytes", "arena", "bytes", "cached", "seconds",
                               "delegated", "verify", "change", "error"]
    assert text[2].split() == ["mlp", "portable", "ok", "70,000", "8,192", "2/3", "1.75", "—", "—", "—"]
    assert len(text) == 2 + 4


def test_fleet_markdown_links_published_models_to_their_artifacts(cnn_plan):
    summary = fleet_summary(cnn_plan)
    summary["models"]["mlp"]["report"] = {"key": "lowerflow-model-mlp", "artifact_id": "0f0e-id"}
    summary["models"]["cnn"]["report"] = {"key": "lowerflow-model-cnn", "artifact_id": None}
    rows = table_rows(fleet_report_markdown(summary), "| model | target | ok | change | pte bytes | delegated | verify |")
    # By id (this run's report) from the fleet's page /artifacts/artifact/<id>; by key without an id;
    # no link for a model that never published a report.
    assert [r[0] for r in rows] == ["[mlp](../artifact/0f0e-id)", "[cnn](../key/lowerflow-model-cnn)",
                                    "[cnn](../key/lowerflow-model-cnn)", "broken"]


def test_verify_cell():
    from flows.reports import verify_cell

    failed = {"ok": False, "checks": [{"runtime": "lowerflow", "ok": True}, {"runtime": "executorch", "ok": False}]}
    assert verify_cell(failed) == "FAILED (executorch)"
    assert verify_cell({"ok": None, "checks": [], "skipped": "a .pt2"}) == "skipped"
    assert verify_cell({"ok": True, "checks": []}) == "ok"
    assert verify_cell(None) == "—"


def test_fleet_all_ok_status():
    summary = {"store": "s", "models": {}, "ok": True, "failed": []}
    assert "0 models · 0/0 stages cached, 0.0 s · all models lowered" in fleet_report_markdown(summary)


# --------------------------------------------------------------------------- PNG


def png_chunks(data):
    """(type, body) of every chunk, checking each CRC."""
    chunks, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        chunks.append((kind, body))
        pos += 12 + length
    return chunks


def test_memory_plan_png_is_a_valid_deterministic_png(cnn_plan):
    data = memory_plan_png(cnn_plan, title="cnn / portable")
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == png_size(data) == (800, 450)
    chunks = png_chunks(data)
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    assert not any(body.startswith(b"Software") for kind, body in chunks if kind == b"tEXt")
    # Same plan (object or dict) and title: same bytes; another title: other bytes.
    assert memory_plan_png(cnn_plan.to_dict(), title="cnn / portable") == data
    assert memory_plan_png(cnn_plan, title="cnn / reference") != data


def test_memory_plan_png_same_bytes_from_concurrent_threads(cnn_plan):
    from concurrent.futures import ThreadPoolExecutor

    serial = memory_plan_png(cnn_plan, title="t")
    with ThreadPoolExecutor(4) as pool:
        pictures = list(pool.map(lambda i: memory_plan_png(cnn_plan, title="t"), range(8)))
    assert all(p == serial for p in pictures)


def test_memory_plan_png_refuses_a_summary():
    with pytest.raises(ValueError, match="not a memory plan"):
        memory_plan_png({"arena_bytes": 1, "lower_bound": 1, "algorithm": "x"}, title="t")


def test_png_size_refuses_other_bytes():
    with pytest.raises(ValueError, match="not a PNG"):
        png_size(b"GIF89a" + bytes(30))


def test_the_plan_picture_is_a_small_palette_png_inlined_as_it_is(cnn_plan):
    from PIL import Image, ImageChops

    png = memory_plan_png(cnn_plan, title="cnn / portable")
    assert is_palette_png(png) and len(png) < 12_000, len(png)
    assert inline_png(png) is png
    assert inline_png(png, limit=len(png)) is png and inline_png(png, limit=len(png) - 1) is None
    # Drawn in RGB, then reduced: the same picture, no pixel off by more than a few levels.
    rgb = _rgb_png(png)
    with Image.open(io.BytesIO(png)) as a:
        assert a.mode == "P"
        with Image.open(io.BytesIO(rgb)) as b:
            assert b.mode == "RGB"
            diff = ImageChops.difference(a.convert("RGB"), b)
            assert max(high for _, high in diff.getextrema()) == 0
    assert png_data_uri(png).startswith("data:image/png;base64,iVBORw0KGgo")


def _rgb_png(png: bytes) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    with Image.open(io.BytesIO(png)) as image:
        image.convert("RGB").save(out, format="PNG")
    return out.getvalue()


def test_inline_png_reduces_any_other_png_to_a_smaller_palette_png_of_the_same_picture(cnn_plan):
    from PIL import Image, ImageChops

    rgb = _rgb_png(memory_plan_png(cnn_plan, title="cnn / portable"))
    assert not is_palette_png(rgb)
    small = inline_png(rgb)
    assert small is not None and is_palette_png(small) and png_size(small) == png_size(rgb) == (800, 450)
    assert len(small) < len(rgb) / 2, (len(small), len(rgb))
    assert inline_png(rgb) == small
    with Image.open(io.BytesIO(small)) as a, Image.open(io.BytesIO(rgb)) as b:
        diff = ImageChops.difference(a.convert("RGB"), b.convert("RGB"))
        assert max(high for _, high in diff.getextrema()) <= 48
    assert inline_png(rgb, limit=len(small)) == small
    assert inline_png(rgb, limit=len(small) - 1) is None


# --------------------------------------------------------------------------- publishing


def test_artifact_keys_are_valid_prefect_keys():
    assert artifact_key("model", "buffer_mutation") == "lowerflow-model-buffer-mutation"
    assert artifact_key("model", "My Model.v2") == "lowerflow-model-my-model-v2"
    assert artifact_key("fleet") == "lowerflow-fleet"


def test_find_plan_inline_or_by_ref(cnn_plan):
    import json

    from tasks.store import ArtifactStore

    store = ArtifactStore(f"memory://plans-{uuid.uuid4().hex}")
    summary = {"arena_bytes": cnn_plan.arena_bytes, "lower_bound": cnn_plan.lower_bound, "algorithm": cnn_plan.algorithm}
    assert find_plan({"memory_plan": summary}, store) is None
    assert find_plan({"memory_plan": None}, store) is None
    assert find_plan({"memory_plan": cnn_plan.to_dict()}, store) == cnn_plan
    ref = store.put_bytes(json.dumps(cnn_plan.to_dict()).encode(), "memory_plan")
    assert find_plan({"memory_plan": {**summary, "ref": ref.to_json()}}, store) == cnn_plan


def read_markdown_artifact(key):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    return asyncio.run(read())


def in_flow(fn, *args, **kwargs):
    """Call ``fn`` inside a Prefect flow run, as the lowering flows do."""
    from prefect import flow

    @flow(name="publish-report-test")
    def publish():
        return fn(*args, **kwargs)

    return publish()


class Collect(logging.Handler):
    """The messages of one logger (caplog's root handler can be replaced when a
    session's first flow run sets up Prefect's logging)."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.logger = logging.getLogger(name)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> "Collect":
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)


def test_publish_model_report_writes_pngs_and_a_markdown_artifact(prefect_api, cnn_plan):
    from tasks.store import ArtifactStore

    store = ArtifactStore(f"memory://reports-{uuid.uuid4().hex}")
    manifest = cnn_manifest(cnn_plan)
    name = f"cnn_{uuid.uuid4().hex[:8]}"
    manifest["name"] = name
    # A plan ref whose object is not in the store: a warning, no picture, still a report.
    missing = {"uri": "memory://elsewhere/objects/ab/cd", "sha256": "ab" * 32, "size": 10, "kind": "memory_plan"}
    manifest["targets"]["lost"] = {**manifest["targets"]["portable"], "memory_plan": {"ref": missing}}
    with Collect("lowerflow.reports") as warnings:
        published = in_flow(publish_model_report, manifest, store, plans={"reference": cnn_plan})
    assert published["key"] == artifact_key("model", name)
    # reference from `plans`, portable from its manifest entry (the whole plan).
    assert sorted(published["images"]) == ["portable", "reference"]
    assert [m for m in warnings.messages if m.startswith(f"no memory-plan picture for {name}/lost: ArtifactMissing")]
    assert "## lost — FAILED" in published["markdown"]
    for target, uri in published["images"].items():
        png = store.get_named(plan_image_name(name, target))
        assert png_size(png) == (800, 450)
        assert uri == store.uri(store.named_path(f"{name}/{target}.memory_plan.png"))
        # The artifact inlines the picture (a browser cannot load the store's URI) and names the file.
        inlined = inline_png(png)
        assert published["inlined"][target] == len(inlined)
        assert f"![memory plan of {target}](data:image/png;base64,{base64.b64encode(inlined).decode()})" in published["markdown"]
        assert f"full-size picture ({len(png):,} B): `{uri}`" in published["markdown"]
    assert "](memory://" not in published["markdown"] and "](file:" not in published["markdown"]
    artifacts = read_markdown_artifact(published["key"])
    assert [a.data for a in artifacts] == [published["markdown"]]
    assert artifacts[0].type == "markdown"
    # The manifest records the artifact, for the fleet report's link.
    assert manifest["report"] == {"key": published["key"], "artifact_id": str(artifacts[0].id)}


def test_publish_model_report_past_the_inline_limit_names_the_file(prefect_api, cnn_plan):
    from tasks.store import ArtifactStore

    store = ArtifactStore(f"memory://reports-{uuid.uuid4().hex}")
    manifest = {"name": f"big_{uuid.uuid4().hex[:8]}", "targets": {"portable": {
        "ok": True, "stages": [], "memory_plan": cnn_plan.to_dict()}}}
    published = in_flow(publish_model_report, manifest, store, inline_limit=1000)
    assert published["inlined"] == {} and list(published["images"]) == ["portable"]
    assert "data:image" not in published["markdown"]
    assert (f"memory-plan picture not shown: over the 1,000 B inline limit of the report; "
            f"full-size picture (") in published["markdown"]
    assert f"`{published['images']['portable']}`" in published["markdown"]


def test_publish_fleet_report(prefect_api, cnn_plan):
    published = in_flow(publish_fleet_report, fleet_summary(cnn_plan))
    assert published["key"] == "lowerflow-fleet"
    artifacts = read_markdown_artifact("lowerflow-fleet")
    assert published["markdown"] in [a.data for a in artifacts]
