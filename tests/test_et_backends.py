"""ExecuTorch's own backends as targets (lowering/backends/executorch/): the openvino target
lowered, verified on the stock runtime and cached; ordered chains; options and missing SDKs
refused before any work; the preprocess key's compiler versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.lower_model import lower_model
from flows.reports import delegation_line
from lowering.errors import BackendError
from lowering.targets import partitioner_for, verify_tolerance
from tasks import stages
from tasks.cache import CacheConfig, StageCachePolicy
from tasks.store import ArtifactRef
from tests._lowering import executions_during

pytest.importorskip("executorch")
pytest.importorskip("openvino")

pytestmark = pytest.mark.usefixtures("fresh_stages")
ROOT = Path(__file__).resolve().parents[1]
CNN = f"{ROOT / 'examples' / 'models.py'}:cnn"


def manifest_of(store: Path, name: str) -> dict:
    return json.loads((store / "outputs" / name / "manifest.json").read_text())


def test_openvino_and_xnnpack_verified_on_the_stock_runtime_and_cached(tmp_path, cli):
    store, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    code, _, errors = cli("lower", CNN, "-t", "openvino", "-t", "xnnpack", "--store", store, "-o", f"{out}/")
    assert (code, errors) == (0, [])
    assert sorted(p.name for p in out.iterdir()) == ["cnn.openvino.pte", "cnn.xnnpack.pte"]
    targets = manifest_of(store, "cnn")["targets"]
    checks = {t: {c["runtime"]: c for c in targets[t]["verify"]["checks"]} for t in targets}
    # OpenVINO ran on ExecuTorch's runtime, within the precision OpenVINO's CPU plugin uses here.
    assert checks["openvino"]["executorch"]["ok"] is True
    assert checks["openvino"]["executorch"]["max_abs_diff"] <= (verify_tolerance("openvino") or 1e-4)
    # lowerflow's own runtime cannot run an OpenVINO payload: verify says so instead of failing.
    assert checks["openvino"]["lowerflow"]["ok"] is None
    assert "OpenvinoBackend" in checks["openvino"]["lowerflow"]["skipped"]
    assert checks["xnnpack"]["executorch"]["ok"] is True and checks["xnnpack"]["lowerflow"]["ok"] is True
    delegation = targets["openvino"]["delegation"]
    assert delegation["partitions"] == 1 and delegation["delegated_nodes"] == delegation["total_nodes"]
    assert delegation["compile_seconds"] > 0 and "compile_seconds" not in targets["xnnpack"]["delegation"]
    assert "vendor compile" in delegation_line(delegation)
    pte = (out / "cnn.openvino.pte").read_bytes()

    # Warm: nothing recompiles, and the same bytes are written.
    (code, _, errors), ran = executions_during(
        cli, "lower", CNN, "-t", "openvino", "-t", "xnnpack", "--store", store, "-o", f"{out}/")
    assert (code, errors) == (0, [])
    assert not ran, f"a warm rerun executed {dict(ran)}"
    assert (out / "cnn.openvino.pte").read_bytes() == pte


CHAIN_MODELS = '''
import torch
from torch import nn

class Floor(nn.Module):
    def forward(self, x):
        return torch.floor(x)

def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Floor(), nn.Linear(16, 4)).eval(), (torch.randn(2, 8),)
'''


def test_chain_each_backend_takes_what_the_previous_left(tmp_path):
    (tmp_path / "chain_models.py").write_text(CHAIN_MODELS)
    store = tmp_path / "store"
    # Vulkan has no floor: it takes both linears, XNNPACK the floor between them.
    options = {"android": {"backends": ["vulkan", "xnnpack"], "vulkan": {"force_fp16": False}}}
    manifest = lower_model(model=f"{tmp_path / 'chain_models.py'}:net", targets=["android"], store=str(store),
                           options=options)
    entry = manifest["targets"]["android"]
    assert entry["ok"], entry["error"]
    steps = entry["delegation"]["backends"]
    assert list(steps) == ["vulkan", "xnnpack"]
    assert steps["vulkan"]["partitions"] == 2 and steps["xnnpack"]["partitions"] == 1
    assert steps["xnnpack"]["delegated_nodes"] == 1  # the floor
    assert all(t.startswith("VulkanBackend_") for t in steps["vulkan"]["partition_tags"])
    assert entry["delegation"]["delegated_nodes"] == entry["delegation"]["total_nodes"]
    line = delegation_line(entry["delegation"])
    assert "vulkan: " in line and "xnnpack: 1 nodes in 1 partition" in line
    # No runtime here has Vulkan: verify says which runtimes are missing, it does not fail.
    checks = {c["runtime"]: c for c in entry["verify"]["checks"]}
    assert checks["executorch"]["ok"] is None and "VulkanBackend" in checks["executorch"]["skipped"]
    assert checks["lowerflow"]["ok"] is None and "VulkanBackend" in checks["lowerflow"]["skipped"]


def test_chain_on_the_command_line_and_in_a_manifest(tmp_path, cli):
    from flows.manifest import ManifestError, load_manifest

    code, _, errors = cli("lower", CNN, "-t", "android=vulkan,nosuch", "--store", tmp_path / "s")
    assert code == 2 and len(errors) == 1 and "'nosuch'" in errors[0]
    path = tmp_path / "fleet.yaml"
    path.write_text(f"models:\n  - model: {CNN}\n    targets: [xnnpack, {{name: android, backends: [vulkan, xnnpack]}}]\n")
    entry = load_manifest(path).models[0]
    assert entry.targets == ("xnnpack", "android")
    assert entry.options["android"] == {"backends": ["vulkan", "xnnpack"]}
    path.write_text(f"models:\n  - model: {CNN}\n    targets: [{{name: android, backends: [vulkan, portable]}}]\n")
    with pytest.raises(ManifestError, match="'portable' is not a backend"):
        load_manifest(path)


def test_options_are_checked_before_any_work():
    with pytest.raises(BackendError, match=r"target 'coreml': unknown options \['compute_unit'\]"):
        partitioner_for("coreml", {"compute_unit": "cpu_only"})
    with pytest.raises(BackendError, match="option compute_units: 'gpu' is not one of"):
        partitioner_for("coreml", {"compute_units": "gpu"})
    with pytest.raises(BackendError, match="option 'buffer_limit' must be int"):
        partitioner_for("vulkan", {"buffer_limit": "big"})
    with pytest.raises(BackendError, match=r"option precision: 'f16' is not one of \['f32', 'default'\]"):
        partitioner_for("openvino", {"precision": "f16"})
    with pytest.raises(BackendError, match="precision f32 is for device CPU"):
        partitioner_for("openvino", {"precision": "f32", "device": "GPU"})


def test_openvino_precision_f32_runs_fp32_on_the_stock_runtime(tmp_path):
    """The stock runtime imports an OpenVINO payload with the device's default precision (bf16 on
    CPUs with AMX); ``precision: f32`` compiles without snippets and marks every layer of the payload
    precise, which the CPU plugin keeps at fp32 at import: verify on ExecuTorch's runtime at fp32's
    tolerance, for the MLP (one snippets Subgraph unless they are off) and the CNN."""
    from lowering.backends.executorch.openvino import precise_payload

    store = tmp_path / "store"
    for name in ("mlp", "cnn"):
        manifest = lower_model(model=f"{ROOT / 'examples' / 'models.py'}:{name}", targets=["openvino"],
                               options={"openvino": {"precision": "f32"}}, store=str(store))
        target = manifest["targets"]["openvino"]
        assert target["ok"], target["error"]
        check = {c["runtime"]: c for c in target["verify"]["checks"]}["executorch"]
        assert check["ok"] is True and check["max_abs_diff"] < 1e-5, check
    assert verify_tolerance("openvino", {"precision": "f32"}) is None
    with pytest.raises(BackendError, match="not the CPU plugin's compiled-model export layout"):
        precise_payload(bytes(64))


def test_qnn_without_its_sdk_is_one_line_before_any_model_runs(tmp_path, cli, monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    (tmp_path / "boom.py").write_text("def m():\n    raise SystemExit('the model ran')\n")
    code, _, errors = cli("lower", f"{tmp_path / 'boom.py'}:m", "-t", "qnn", "--store", tmp_path / "s")
    assert code == 2 and len(errors) == 1
    assert "QNN_SDK_ROOT" in errors[0] and "not on PyPI" in errors[0]


def test_preprocess_key_holds_compiler_versions_only_when_given():
    program = ArtifactRef("file:///p", "ab" * 32, 1, "program")
    inputs = {"program": program, "backend_id": "XnnpackBackend", "compile_specs": [], "label": "m/t0"}
    policy = CacheConfig(results="/tmp").policy("preprocess", stages.STAGE_VERSIONS["preprocess"],
                                                 stages.STAGE_IGNORES["preprocess"],
                                                 stages.STAGE_OPTIONAL["preprocess"])
    before = StageCachePolicy(stage="preprocess", version=stages.STAGE_VERSIONS["preprocess"],
                              ignore=stages.STAGE_IGNORES["preprocess"])  # the key before versions
    plain = policy.key_for(stages.stage_inputs("preprocess", inputs))
    assert plain == before.key_for(inputs)
    keyed = [policy.key_for(stages.stage_inputs("preprocess", {**inputs, "versions": v}))
             for v in ({"executorch": "1.5.1", "coremltools": "9.0"}, {"executorch": "1.5.1", "coremltools": "9.1"})]
    assert len({plain, *keyed}) == 3


def test_a_fleet_of_four_device_families_lowers_then_recompiles_nothing(tmp_path):
    from flows.lower_fleet import lower_fleet, plan_fleet

    mlp = f"{ROOT / 'examples' / 'models.py'}:mlp"
    fleet = {"store": str(tmp_path / "store"), "models": [{
        "name": "mlp", "model": mlp,
        "targets": ["xnnpack", "openvino", "coreml", {"name": "android", "backends": ["vulkan", "xnnpack"]}]}]}
    rows = plan_fleet(fleet)
    compiles = {(r["target"], r["stage"]) for r in rows if r["stage"] == "preprocess"}
    assert {t for t, _ in compiles} == {"xnnpack", "openvino", "coreml", "android"}  # the vendor compile stages
    summary, ran = executions_during(lower_fleet, fleet)
    assert summary["failed"] == [], summary
    assert ran["preprocess"] == 4  # xnnpack, openvino, coreml, vulkan (android's xnnpack step finds nothing left)
    targets = manifest_of(tmp_path / "store", "mlp")["targets"]
    assert targets["android"]["delegation"]["backends"]["vulkan"]["partitions"] == 1
    assert targets["coreml"]["delegation"]["compile_seconds"] > 0
    summary, ran = executions_during(lower_fleet, fleet)
    assert summary["failed"] == [] and not ran, dict(ran)
    assert all(r["cached"] for r in plan_fleet(fleet))


def test_export_key_holds_keep_for_only_when_given():
    inputs = {"model": "/m.py:mlp", "fingerprint": "ab" * 32, "options": {}}
    policy = CacheConfig(results="/tmp").policy("export", stages.STAGE_VERSIONS["export"], stages.STAGE_IGNORES["export"],
                                                stages.STAGE_OPTIONAL["export"])
    before = StageCachePolicy(stage="export", version=stages.STAGE_VERSIONS["export"],
                              ignore=stages.STAGE_IGNORES["export"])  # the key before keep_for
    plain = policy.key_for(stages.stage_inputs("export", inputs))
    assert plain == before.key_for(inputs)
    keep = {"target": "coreml", "options": {}, "versions": {"coreml": {"executorch": "1.5.1", "coremltools": "9.0"}}}
    keyed = [policy.key_for(stages.stage_inputs("export", {**inputs, "keep_for": k}))
             for k in (keep, {**keep, "versions": {"coreml": {"executorch": "1.5.1", "coremltools": "9.1"}}})]
    assert len({plain, *keyed}) == 3


def test_the_flow_exports_coreml_its_own_program_with_the_ops_it_keeps(tmp_path, cli):
    """Core ML's partitioner keeps linear whole (ops_to_not_decompose): the flow gives the coreml target its
    own export (cached apart) and writes the bytes lowering.lower writes; xnnpack shares the model's export."""
    import lowering
    from examples.models import mlp
    from lowering.targets import keep_for

    assert keep_for("xnnpack") is None and keep_for("coreml")["target"] == "coreml"
    store, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    code, _, errors = cli("lower", f"{ROOT / 'examples' / 'models.py'}:mlp", "-t", "coreml", "-t", "xnnpack",
                          "--store", store, "-o", f"{out}/", "--verify", "off")
    assert (code, errors) == (0, [])
    targets = manifest_of(store, "mlp")["targets"]
    assert [r["stage"] for r in targets["coreml"]["stages"]].count("export") == 2
    assert [r["stage"] for r in targets["xnnpack"]["stages"]].count("export") == 1
    model, inputs = mlp()
    library = lowering.lower(model, inputs, partitioner=partitioner_for("coreml")).pte
    assert (out / "mlp.coreml.pte").read_bytes() == library
    assert b"aten_linear_default" in library


def test_quantize_key_holds_the_backend_quantizer_only_when_given():
    program = ArtifactRef("file:///p", "ab" * 32, 1, "program")
    inputs = {"program": program, "recipe": {"recipe": "int8"}, "calibration": "cd" * 32,
              "versions": {"torchao": "0.15"}, "source": "x.py:batches", "model": "/m.py:mlp", "fingerprint": "ef"}
    policy = CacheConfig(results="/tmp").policy("quantize", stages.STAGE_VERSIONS["quantize"],
                                                 stages.STAGE_IGNORES["quantize"], stages.STAGE_OPTIONAL["quantize"])
    before = StageCachePolicy(stage="quantize", version=stages.STAGE_VERSIONS["quantize"],
                              ignore=stages.STAGE_IGNORES["quantize"])  # the key before backend quantizers
    plain = policy.key_for(stages.stage_inputs("quantize", inputs))
    assert plain == before.key_for(inputs)
    arm = {"target": "ethos-u", "options": {}, "quantizer": "executorch.backends.arm.quantizer.EthosUQuantizer",
           "versions": {"ethos-u": {"executorch": "1.5.1", "ethos-u-vela": "5.1.0", "tosa-tools": "2026.5.0"}}}
    newer = {**arm, "versions": {"ethos-u": {**arm["versions"]["ethos-u"], "executorch": "1.6.0"}}}
    keyed = [policy.key_for(stages.stage_inputs("quantize", {**inputs, "backend": b})) for b in (arm, newer)]
    assert len({plain, *keyed}) == 3
    from lowering.targets import quantizer_for

    assert quantizer_for("xnnpack", None, "int8") is None and quantizer_for("portable", None, "int8") is None


TWO_PARTITIONS = '''
import torch
from torch import nn

SECOND = {second}

class Floor(nn.Module):
    def forward(self, x):
        return torch.floor(x)

def net():
    torch.manual_seed(0)
    first = nn.Linear(8, 16)
    torch.manual_seed(SECOND)
    return nn.Sequential(first, Floor(), nn.Linear(16, 4)).eval(), (torch.randn(2, 8),)
'''


def test_a_changed_partition_recompiles_only_itself_and_a_new_compiler_recompiles(tmp_path, monkeypatch):
    """Vulkan takes the two linears around the floor (which it has no kernel for) as two partitions:
    new weights in the second recompile the second only; a new compiler version (the key holds
    ExecuTorch's and the vendor compiler's versions: a new vulkan serializer here) recompiles both."""
    from lowering.backends.executorch import VulkanBackend

    path, store = tmp_path / "two.py", str(tmp_path / "store")
    options = {"vulkan": {"force_fp16": False}}
    path.write_text(TWO_PARTITIONS.format(second=1))
    first, ran = executions_during(lower_model, f"{path}:net", ["vulkan"], store=store, options=options, verify=False)
    assert first["targets"]["vulkan"]["delegation"]["partitions"] == 2 and ran["preprocess"] == 2
    path.write_text(TWO_PARTITIONS.format(second=2))
    stages.LIVE.clear()
    second, ran = executions_during(lower_model, f"{path}:net", ["vulkan"], store=store, options=options, verify=False)
    assert second["targets"]["vulkan"]["ok"] and ran["preprocess"] == 1, dict(ran)
    versions = VulkanBackend.compiler_versions()
    monkeypatch.setattr(VulkanBackend, "compiler_versions", classmethod(lambda cls: {**versions, "executorch": "9.9"}))
    stages.LIVE.clear()
    third, ran = executions_during(lower_model, f"{path}:net", ["vulkan"], store=store, options=options, verify=False)
    assert third["targets"]["vulkan"]["ok"] and ran["preprocess"] == 2, dict(ran)
