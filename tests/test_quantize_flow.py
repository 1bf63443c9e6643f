"""The quantize stage in the flow: a cached task keyed on the exported program, the recipe
and the calibration data's digest; calibration sources; manifest and CLI settings;
verify against the quantized reference with the error against fp32 eager."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from flows.lower_fleet import lower_fleet
from flows.lower_model import ModelLoweringFailed, lower_model
from flows.manifest import ManifestError, load_manifest
from tasks.calibration import calibration_digest, read_calibration, save_calibration
from tasks.store import ArtifactStore
from tests._lowering import executions_during

pytestmark = pytest.mark.usefixtures("fresh_stages")

MODELS = textwrap.dedent(
    '''
    import torch

    SEED = {seed}


    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(32, 64)
            self.b = torch.nn.Linear(64, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))


    def batches():
        g = torch.Generator().manual_seed(SEED)
        return [(torch.randn(4, 32, generator=g),) for _ in range(8)]


    def mlp():
        torch.manual_seed(0)
        return {{"module": MLP(), "inputs": (torch.randn(4, 32),), "calibration": batches}}


    def plain_mlp():
        torch.manual_seed(0)
        return MLP(), (torch.randn(4, 32),)
    '''
)


def write_models(directory: Path, seed: int = 1) -> Path:
    path = directory / "qmodels.py"
    path.write_text(MODELS.format(seed=seed))
    return path


def run(model: str, store: Path, **kwargs) -> dict:
    try:
        return lower_model(model=model, store=str(store), **kwargs)
    except ModelLoweringFailed as exc:
        return exc.manifest


def stages(manifest: dict, target: str = "portable") -> list[tuple[str, bool]]:
    return [(r["stage"], r["cached"]) for r in manifest["targets"][target]["stages"]]


def test_int8_portable_is_verified_against_its_reference_and_cached(tmp_path):
    models = write_models(tmp_path)
    store = tmp_path / "store"
    cold, ran = executions_during(run, f"{models}:mlp", store, targets=["portable"], quantize="int8")
    result = cold["targets"]["portable"]
    assert result["ok"], result["error"]
    assert ran["quantize"] == 1 and ran["export"] == 1
    assert [s for s, _ in stages(cold)] == ["export", "quantize", "memory_plan", "emit", "verify"]
    # The manifest says what was quantized, with which data.
    assert result["quantize"]["recipe"] == {"recipe": "int8", "keep_fp32": []}
    assert result["quantize"]["calibration"] == cold["calibration"]["digest"]
    assert cold["calibration"]["source"] == "factory" and cold["calibration"]["batches"] == 8
    assert result["quantize"]["quantized_nodes"] > 0
    # The program keeps q/dq ops at the top level: ExecuTorch's quantized kernels run them.
    checks = {c["runtime"]: c for c in result["verify"]["checks"]}
    for runtime in ("lowerflow", "executorch"):
        assert checks[runtime]["ok"] is True, checks[runtime]
        accuracy = checks[runtime]["accuracy"]
        assert 20 < accuracy["sqnr_db"] < 80 and 0 < accuracy["max_error"] < 0.1, accuracy
    assert result["verify"]["reference_accuracy"]["sqnr_db"] == pytest.approx(checks["lowerflow"]["accuracy"]["sqnr_db"], abs=1.0)

    warm, ran = executions_during(run, f"{models}:mlp", store, targets=["portable"], quantize="int8")
    assert sum(ran.values()) == 0, dict(ran)
    assert warm["targets"]["portable"]["pte"]["sha256"] == result["pte"]["sha256"]
    assert warm["changed"] == []


def test_new_calibration_data_requantizes_without_reexport(tmp_path):
    models = write_models(tmp_path, seed=1)
    store = tmp_path / "store"
    first, _ = executions_during(run, f"{models}:mlp", store, targets=["portable"], quantize="int8")
    write_models(tmp_path, seed=2)  # same model, other calibration batches
    second, ran = executions_during(run, f"{models}:mlp", store, targets=["portable"], quantize="int8")
    assert second["targets"]["portable"]["ok"], second["targets"]["portable"]["error"]
    assert second["calibration"]["digest"] != first["calibration"]["digest"]
    assert ran["quantize"] == 1 and ran["export"] == 1  # the file changed: the code part of the fingerprint
    assert "calibration" in second["changed"]


def test_calibration_digest_is_the_data_not_where_it_came_from(tmp_path):
    """The same batches from a function spec and from a safetensors file: one digest, one
    quantize stage."""
    models = write_models(tmp_path)
    url = str(tmp_path / "batches.safetensors")
    from_function = read_calibration(f"{models}:batches", "test")
    save_calibration(from_function, url)
    assert calibration_digest(read_calibration(url, "test")) == calibration_digest(from_function)

    store = tmp_path / "store"
    first, _ = executions_during(run, f"{models}:plain_mlp", store, targets=["portable"], quantize="int8",
                                 calibration=f"{models}:batches")
    second, ran = executions_during(run, f"{models}:plain_mlp", store, targets=["portable"], quantize="int8",
                                    calibration=url)
    assert first["targets"]["portable"]["ok"] and second["targets"]["portable"]["ok"]
    assert first["calibration"]["digest"] == second["calibration"]["digest"]
    assert ran["quantize"] == 0


def test_int8_without_calibration_fails_before_export(tmp_path):
    models = write_models(tmp_path)
    manifest, ran = executions_during(run, f"{models}:plain_mlp", tmp_path / "store", targets=["portable"],
                                      quantize="int8")
    result = manifest["targets"]["portable"]
    assert result["ok"] is False and ran["export"] == 0
    assert "model 'plain_mlp': recipe int8 needs calibration data" in result["error"]
    assert result["error"].startswith("calibration:")


def test_dynamic_recipe_ignores_calibration_in_its_key(tmp_path):
    """int8-dynamic observes nothing: other calibration data must not re-quantize it."""
    models = write_models(tmp_path, seed=1)
    store = tmp_path / "store"
    first = run(f"{models}:mlp", store, targets=["xnnpack"], quantize="int8-dynamic", verify=False)
    assert "calibration" not in first and first["targets"]["xnnpack"]["ok"], first["targets"]["xnnpack"]["error"]
    write_models(tmp_path, seed=2)  # other calibration batches (and so other code: a new export)
    second, ran = executions_during(run, f"{models}:mlp", store, targets=["xnnpack"], quantize="int8-dynamic",
                                    verify=False)
    assert ran["export"] == 1 and ran["quantize"] == 0, dict(ran)  # the same exported program: a hit


def test_dynamic_recipe_on_the_portable_target_is_refused(tmp_path):
    models = write_models(tmp_path)
    with pytest.raises(ValueError, match="target 'portable': recipe '8da4w' cannot quantize a program without a backend"):
        run(f"{models}:mlp", tmp_path / "store", targets=["portable"], quantize="8da4w")


def test_min_sqnr_fails_a_target_that_is_too_coarse(tmp_path):
    models = write_models(tmp_path)
    manifest = run(f"{models}:mlp", tmp_path / "store", targets=["portable"], quantize="int8", min_sqnr=200)
    result = manifest["targets"]["portable"]
    assert result["ok"] is False
    assert "below min_sqnr 200 dB" in result["error"], result["error"]
    assert not (tmp_path / "store" / "outputs" / "mlp" / "portable.pte").exists()


def test_manifest_quantize_settings_are_validated(tmp_path):
    models = write_models(tmp_path)

    def entry(**fields):
        return {"store": str(tmp_path / "store"), "models": [{"name": "m", "model": f"{models}:mlp", **fields}]}

    fleet = load_manifest(entry(targets=["portable", "xnnpack"], quantize={"xnnpack": {"recipe": "8da4w", "group_size": 64}}))
    assert dict(fleet.models[0].quantize) == {"portable": None,
                                              "xnnpack": {"recipe": "8da4w", "group_size": 64, "quantize_mha": False,
                                                          "keep_fp32": []}}
    with pytest.raises(ManifestError, match=r"models\[0\] \('m'\): 'quantize': .*'int9'.*did you mean 'int8'"):
        load_manifest(entry(quantize="int9"))
    with pytest.raises(ManifestError, match=r"'quantize': names targets not lowered: \['xnnpack'\]"):
        load_manifest(entry(quantize={"xnnpack": "int8"}))
    with pytest.raises(ManifestError, match="group_size 48 must be a positive multiple of 32"):
        load_manifest(entry(quantize={"recipe": "8da4w", "group_size": 48}))
    with pytest.raises(ManifestError, match="'min_sqnr' and 'max_error' are for quantized targets"):
        load_manifest(entry(min_sqnr=20))
    with pytest.raises(ManifestError, match=r"'calibration': calibration .*nowhere\.py.*no such file|does not exist"):
        load_manifest(entry(quantize="int8", calibration="nowhere.py:batches"))
    # A relative calibration file resolves against the manifest's directory.
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"models": [{"model": f"{models}:plain_mlp", "quantize": "int8",
                                            "calibration": "qmodels.py:batches"}]}))
    assert load_manifest(path).models[0].calibration == f"{models.resolve()}:batches"


def test_fleet_lowers_a_quantized_entry(tmp_path):
    models = write_models(tmp_path)
    fleet = {"store": str(tmp_path / "store"), "defaults": {"targets": ["portable"]},
             "models": [{"name": "q", "model": f"{models}:plain_mlp", "quantize": "int8",
                         "calibration": f"{models}:batches", "min_sqnr": 20},
                        {"name": "f", "model": f"{models}:plain_mlp"}]}
    summary = lower_fleet(fleet)
    assert summary["ok"], summary["failed"]
    store = ArtifactStore(str(tmp_path / "store"))
    quantized, fp32 = store.get_json("q/manifest.json"), store.get_json("f/manifest.json")
    assert quantized["targets"]["portable"]["quantize"]["recipe"]["recipe"] == "int8"
    assert "quantize" not in fp32["targets"]["portable"]


def test_cli_lower_quantize(tmp_path, cli):
    models = write_models(tmp_path)
    out = tmp_path / "q.pte"
    code, stdout, errors = cli("lower", f"{models}:mlp", "--quantize", "int8", "-o", out,
                               "--store", tmp_path / "store")
    assert code == 0, (stdout, errors)
    assert out.read_bytes()[4:8] == b"ET12"
    assert "quantize" in stdout
    code, _, errors = cli("lower", f"{models}:mlp", "--quantize", "int4", "-o", out)
    assert code == 2 and "--quantize: quantize recipe 'int4'" in errors[0], errors
    code, _, errors = cli("lower", f"{models}:mlp", "--calibration", f"{models}:batches", "-o", out)
    assert code == 2 and "need --quantize" in errors[0], errors


def test_quantize_is_deterministic_across_processes(tmp_path):
    """The same model, recipe and calibration: the same quantized program digest in a new process."""
    import subprocess
    import sys

    models = write_models(tmp_path)
    script = textwrap.dedent(f'''
        import json, torch
        from tasks.model_spec import ModelSpec, load_model
        from lowering import export
        from lowering.quantize import quantize
        from lowering.serialize import serialize_program
        loaded = load_model(ModelSpec.parse("{models}:mlp"))
        program = quantize(export(loaded.module, loaded.inputs), "int8", calibration=loaded.calibration)
        import hashlib
        print(hashlib.sha256(serialize_program(program, keep_stack_traces=False).manifest).hexdigest())
    ''')
    root = Path(__file__).resolve().parent.parent
    digests = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root,
                              check=True).stdout.strip().splitlines()[-1] for _ in range(2)}
    assert len(digests) == 1, digests


# --------------------------------------------------------------------------- xnnpack and real architectures

HF_MODELS = textwrap.dedent(
    '''
    import torch
    import transformers

    from examples.hf_models import bert


    def bert_batches():
        g = torch.Generator().manual_seed(7)
        return [(torch.randint(0, 128, (2, 12), generator=g), torch.ones(2, 12, dtype=torch.long)) for _ in range(4)]


    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, tokens):
            return self.model(input_ids=tokens, use_cache=False).logits


    def llama():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, use_cache=False, attn_implementation="eager")
        return Logits(transformers.LlamaForCausalLM(config).eval()).eval(), (torch.randint(0, 256, (1, 8)),)
    '''
)


def checks_of(result: dict) -> dict:
    return {c["runtime"]: c for c in result["verify"]["checks"]}


def test_xnnpack_and_portable_share_one_quantize_stage(tmp_path):
    models = write_models(tmp_path)
    store = tmp_path / "store"
    manifest, ran = executions_during(run, f"{models}:mlp", store, targets=["portable", "xnnpack"], quantize="int8")
    assert ran["quantize"] == 1, dict(ran)  # one quantized program, two targets
    xnnpack = manifest["targets"]["xnnpack"]
    assert xnnpack["ok"], xnnpack["error"]
    assert xnnpack["delegation"]["partitions"] >= 1
    for runtime, check in checks_of(xnnpack).items():
        assert check["ok"] is True, (runtime, check)
        assert check["accuracy"]["sqnr_db"] > 25, check
    fp32 = run(f"{models}:plain_mlp", store, targets=["xnnpack"], verify=False)
    # (a tiny MLP: the fixed parts of the file weigh; the weights alone are 4x smaller)
    assert xnnpack["pte"]["size"] < 0.7 * fp32["targets"]["xnnpack"]["pte"]["size"]
    weights = xnnpack["quantize"]["weight_bytes"]
    assert weights["quantized"] < 0.4 * weights["fp32"], weights  # int8 + fp32 scales, zero points, biases


@pytest.mark.parametrize("spec, recipe, calibration", [
    ("bert", "int8-dynamic", None),
    ("bert", "int8", "bert_batches"),
    ("llama", {"recipe": "8da4w", "group_size": 32}, None),
])
def test_transformers_architectures_through_the_flow(tmp_path, spec, recipe, calibration):
    pytest.importorskip("transformers")
    path = tmp_path / "hf_quant.py"
    path.write_text(HF_MODELS)
    extra = {"calibration": f"{path}:{calibration}"} if calibration else {}
    manifest = run(f"{path}:{spec}", tmp_path / "store", targets=["xnnpack"], quantize=recipe, **extra)
    result = manifest["targets"]["xnnpack"]
    assert result["ok"], result["error"]
    assert result["delegation"]["partitions"] >= 1 and result["quantize"]["quantized_nodes"] > 0
    checks = checks_of(result)
    assert checks["lowerflow"]["ok"] is True, checks["lowerflow"]
    assert checks["executorch"]["ok"] is True, checks["executorch"]
    print(spec, recipe, result["pte"]["size"], checks["executorch"]["accuracy"], result["verify"]["reference_accuracy"])
