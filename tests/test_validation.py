"""Issue 22, the newcomer's first hour: bad input is found before any work, in one line
naming it, and ``plan`` validates exactly as ``fleet`` does.

Real manifests in tmp dirs, real CLI invocations (``flows.cli.main`` in this process),
real local stores; nothing is mocked.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "examples" / "models.py"


def write_manifest(directory: Path, body: str) -> Path:
    path = directory / "fleet.yaml"
    path.write_text(f"store: ./store\n{textwrap.dedent(body).strip()}\n")
    return path


# --------------------------------------------------------------------------- 1: factories resolved first


@pytest.mark.parametrize("command", ["fleet", "plan"])
def test_a_missing_factory_is_exit_2_naming_the_entry_before_any_model_runs(cli, tmp_path, command):
    (tmp_path / "models.py").write_text(MODELS.read_text())
    manifest = write_manifest(tmp_path, """
        models:
          - {name: mlp, model: models.py:mlp}
          - {name: cnn, model: models.py:cnnn}
        """)
    code, out, errors = cli(command, manifest)
    assert code == 2 and len(errors) == 1, (out, errors)
    assert "models[1] ('cnn')" in errors[0] and "no factory 'cnnn'" in errors[0]
    assert "did you mean 'cnn'?" in errors[0]
    assert not (tmp_path / "store").exists()  # nothing ran, nothing written to outputs/


@pytest.mark.parametrize("model, fragment", [
    ("no_such_package.models:cnn", "No module named 'no_such_package'"),
    ("examples.models:MODELS", "is a dict, not a factory"),
    ("broken.py:model", "cannot import: ZeroDivisionError"),
])
def test_every_way_a_factory_cannot_be_resolved_is_a_bad_manifest(cli, tmp_path, model, fragment):
    (tmp_path / "broken.py").write_text("1 / 0\n\ndef model():\n    pass\n")
    manifest = write_manifest(tmp_path, f"models:\n  - {{name: m, model: '{model}'}}")
    code, _, errors = cli("fleet", manifest)
    assert code == 2 and len(errors) == 1 and "models[0] ('m')" in errors[0] and fragment in errors[0], errors
    assert not (tmp_path / "store").exists()


# --------------------------------------------------------------------------- 2: unknown targets


def test_an_unknown_target_lists_the_names_users_type_and_the_closest(cli, tmp_path):
    code, _, errors = cli("lower", f"{MODELS}:mlp", "-t", "xnnpak", "--store", tmp_path / "store")
    assert code == 2 and errors == [
        "lowerflow: error: --target: unknown target 'xnnpak'; did you mean 'xnnpack'? "
        "(targets: portable, coreml, ethos-u, openvino, qnn, reference, vulkan, xnnpack)"]
    manifest = write_manifest(tmp_path, f"models:\n  - {{name: a, model: '{MODELS}:mlp', targets: [Portable]}}")
    code, _, errors = cli("fleet", manifest)
    assert code == 2 and errors == [
        "lowerflow: error: models[0] ('a'): unknown target 'Portable'; did you mean 'portable'? "
        "(targets: portable, coreml, ethos-u, openvino, qnn, reference, vulkan, xnnpack)"]
    assert "Backend" not in errors[0]  # class names are not what users type
    assert not (tmp_path / "store").exists()


# --------------------------------------------------------------------------- 3: YAML errors


def test_invalid_yaml_names_its_line_and_column(cli, tmp_path):
    manifest = write_manifest(tmp_path, f"""
        models:
          - name: mlp
            model: {MODELS}:mlp
              targets: [portable]
        """)
    code, _, errors = cli("fleet", manifest)
    assert code == 2 and errors == [f"lowerflow: error: manifest {str(manifest)!r}, line 5, column 14: "
                                    "not valid YAML: mapping values are not allowed here"]
    unclosed = write_manifest(tmp_path, "models: [a, b\n")
    code, _, errors = cli("plan", unclosed)
    assert code == 2 and len(errors) == 1 and ", line 3, column 1: not valid YAML:" in errors[0], errors
    as_json = tmp_path / "fleet.json"
    as_json.write_text('{"models": [\n  {"model": 1,}\n]}')
    code, _, errors = cli("plan", as_json)
    assert code == 2 and len(errors) == 1 and ", line 2, column 15: not valid JSON:" in errors[0], errors


# --------------------------------------------------------------------------- 4: verify a missing file


def test_verify_of_a_missing_file_is_exit_2_in_one_line(cli, tmp_path):
    missing = tmp_path / "missing.pte"
    code, out, errors = cli("verify", missing, "--model", f"{MODELS}:mlp")
    assert code == 2 and errors == [f"lowerflow: error: cannot read {str(missing)!r}: No such file or directory"]
    assert out == ""


# --------------------------------------------------------------------------- 5: plan validates as fleet does

BAD_MODELS = '''
import torch


def broken():
    raise RuntimeError("no model today")


def linear():
    return torch.nn.Linear(4, 3), (torch.randn(2, 4),)
'''


@pytest.mark.parametrize("entry, code, fragments", [
    ("{name: m, model: models.py:lineer}", 2, ["models[0] ('m')", "no factory 'lineer'; did you mean 'linear'?"]),
    ("{name: m, model: models.py:broken}", 1, ["1 of 1 models failed: m (portable load: ModelSpecError",
                                              "factory raised RuntimeError: no model today"]),
    ("{name: m, model: models.py:linear, targets: [reference], options: {reference: {colour: red}}}", 2,
     ["models[0] ('m'): 'options': target 'reference': bad options {'colour': 'red'}", "unexpected keyword"]),
    ("{name: m, model: models.py:linear, dynamic_shapes: {y: {0: {name: batch, max: 8}}}}", 1,
     ["1 of 1 models failed: m (portable load: ModelSpecError", "'y'"]),
], ids=["missing-factory", "factory-raises", "bad-options", "dynamic-shapes-argument"])
def test_plan_fails_as_fleet_fails_with_the_same_line(cli, tmp_path, prefect_api, entry, code, fragments):
    (tmp_path / "models.py").write_text(BAD_MODELS)
    manifest = write_manifest(tmp_path, f"models:\n  - {entry}")
    plan_code, _, plan_errors = cli("plan", manifest)
    fleet_code, _, fleet_errors = cli("fleet", manifest)
    assert (plan_code, plan_errors) == (fleet_code, fleet_errors)
    assert plan_code == code and len(plan_errors) == 1, plan_errors
    for fragment in fragments:
        assert fragment in plan_errors[0], plan_errors[0]
    assert (tmp_path / "store" / "outputs").exists() == (code == 1)  # exit 2: nothing ran


# --------------------------------------------------------------------------- 6: plan output


def test_plan_prints_a_summary_per_model_and_target_and_details_when_verbose(cli, tmp_path, prefect_api):
    manifest = write_manifest(tmp_path, f"""
        defaults: {{targets: [portable, reference]}}
        models:
          - {{name: mlp, model: '{MODELS}:mlp'}}
          - {{name: lstm, model: '{MODELS}:lstm', targets: [reference]}}
        """)
    code, out, errors = cli("plan", manifest)
    assert code == 0 and not errors, errors
    rows = [line.split(None, 3) for line in out.splitlines()[2:5]]
    assert rows == [
        ["mlp", "portable", "0/4", "export, memory_plan, emit, verify"],
        ["mlp", "reference", "0/9", "export, partition, create_submodule, build_programs, preprocess, adjust, "
                                    "memory_plan, emit, verify"],
        ["lstm", "reference", "0/9", "export, partition, create_submodule, build_programs, preprocess, adjust, "
                                     "memory_plan, emit, verify"],
    ]
    assert out.splitlines()[-1] == "0 of 22 stages cached, 22 to run"
    assert cli("fleet", manifest)[0] == 0
    code, out, errors = cli("plan", manifest)
    assert code == 0 and not errors
    lines = out.splitlines()
    summary = [line.split() for line in lines[2:lines.index("")]]
    assert len(summary) == 3, out  # one line per model and target, however many partitions
    partitions = int(summary[2][2].split("/")[1]) - 8  # lstm: one preprocess per partition
    assert partitions > 1
    assert [s[:4] for s in summary] == [["mlp", "portable", "4/4", "-"], ["mlp", "reference", "9/9", "-"],
                                        ["lstm", "reference", f"{8 + partitions}/{8 + partitions}", "-"]]
    assert "preprocess" not in out
    code, verbose, _ = cli("plan", manifest, "--verbose")
    assert code == 0
    details = [line.split() for line in verbose.splitlines() if line.startswith("lstm") and "preprocess" in line]
    assert details == [["lstm", "reference", "preprocess", f"×{partitions}", "cached"]]


# --------------------------------------------------------------------------- 9c: verify of a dynamic model


def test_verify_checks_a_dynamic_model_at_each_dims_min_and_max_as_the_flow_does(cli, tmp_path):
    import torch

    from examples.dynamic_models import dynamic_mlp
    from lowering import lower

    model, inputs, dynamic_shapes = dynamic_mlp()
    dynamic, static = tmp_path / "dynamic.pte", tmp_path / "static.pte"
    dynamic.write_bytes(lower(model, inputs, dynamic_shapes=dynamic_shapes).pte)
    static.write_bytes(lower(model, inputs).pte)  # right at the example batch only
    spec = f"{REPO}/examples/dynamic_models.py:dynamic_mlp"
    code, out, errors = cli("verify", dynamic, "--model", spec)
    assert code == 0 and not errors, errors
    lowerflow = [line for line in out.splitlines() if line.startswith("lowerflow ")]
    assert [line.split()[1] for line in lowerflow] == ["ok"] * 3
    assert [line.split("(")[-1] for line in lowerflow[1:]] == ["batch=1)", "batch=32)"]
    code, out, errors = cli("verify", static, "--model", spec)
    assert code == 1 and len(errors) == 1 and "does not match" in errors[0], (out, errors)
    assert "batch=1" in out and "MISMATCH" in out
    # --dynamic-shapes narrows the range to what `lower --dynamic-shapes` was given.
    narrow = tmp_path / "narrow.pte"
    narrow.write_bytes(lower(model, inputs, dynamic_shapes={
        "x": {0: torch.export.Dim("batch", min=2, max=8)}}).pte)
    code, out, errors = cli("verify", narrow, "--model", spec, "--dynamic-shapes",
                            '{"x": {"0": {"name": "batch", "min": 2, "max": 8}}}')
    assert code == 0 and not errors and "(batch=8)" in out, (out, errors)


# --------------------------------------------------------------------------- 9a: stages that reload the model


def test_verify_and_quantize_reload_a_model_with_its_export_options(tmp_path, fresh_stages):
    """A verify (or quantize) stage run where the flow's loaded model is not held (a retry in
    another process) loads the model again with the options it was exported with: the
    manifest's ``version`` and ``dynamic_shapes`` are part of its fingerprint."""
    from flows.lower_model import export_options, lower_model
    from tasks.model_spec import ModelSpec, ModelSpecError, live_model
    from tasks.store import ArtifactRef, ArtifactStore

    spec = f"{Path(__file__).resolve().parent.parent / 'examples' / 'models.py'}:mlp"
    store = tmp_path / "store"
    manifest = lower_model(model=spec, targets=["portable"], store=str(store), version="7")
    options = export_options("7")
    fingerprint = manifest["fingerprint"]["digest"]
    key = ModelSpec.parse(spec).key_text
    # Nothing holds the model now: live_model loads it again.
    assert live_model(key, fingerprint, options).fingerprint.digest == fingerprint
    with pytest.raises(ModelSpecError, match="changed while it was being lowered"):
        live_model(key, fingerprint)  # without the options: another fingerprint
    pte = manifest["targets"]["portable"]["pte"]
    ref = ArtifactRef(pte["uri"], pte["sha256"], pte["size"], "pte")
    report = fresh_stages.run_verify(ArtifactStore(str(store)), ref, key, fingerprint, options=options)
    assert report["ok"] is True, report


# --------------------------------------------------------------------------- 9b: what a plan lists


def test_plan_lists_lower_control_flow_and_quantize_before_anything_is_cached(tmp_path, fresh_stages):
    """A dry run lists every stage the run will execute: lower_control_flow for a cond model
    (known from the exported program: exported in memory when export is not cached, read
    from the store when it is) and quantize for a quantized target."""
    from flows.lower_model import lower_model, plan_model

    models = Path(__file__).resolve().parent.parent / "examples" / "models.py"
    store = str(tmp_path / "store")

    def stages(manifest, target):
        return [r["stage"] for r in manifest["targets"][target]["stages"]]

    cold = plan_model(f"{models}:cond_linear", ["reference"], store)
    assert "lower_control_flow" in stages(cold, "reference"), stages(cold, "reference")
    run = lower_model(model=f"{models}:cond_linear", targets=["reference"], store=store)
    ran = stages(run, "reference")
    assert "lower_control_flow" in ran
    # Export cached, the rest not (another target): listed from the stored program.
    warm_export = plan_model(f"{models}:cond_linear", ["xnnpack"], store)
    assert warm_export["targets"]["xnnpack"]["stages"][0]["cached"]
    assert "lower_control_flow" in stages(warm_export, "xnnpack"), stages(warm_export, "xnnpack")
    # An fp32 model without control flow lists neither.
    plain = plan_model(f"{models}:mlp", ["reference"], store)
    assert "lower_control_flow" not in stages(plain, "reference")
    quantized = plan_model(f"{models}:mlp", ["xnnpack"], store, quantize="int8-dynamic")
    assert stages(quantized, "xnnpack")[:2] == ["export", "quantize"], stages(quantized, "xnnpack")
