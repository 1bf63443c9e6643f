"""The runtime-ops profile through the flow: a manifest's ``runtime_ops:``, ``lowerflow lower
--runtime-ops``, ``lower_model(runtime_ops=...)`` reach the emit stage, which refuses an
operator outside the profile before writing bytes; the profile is in emit's cache key only
when it is not the default (every other key stays as it was)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from flows.lower_fleet import FleetFailed, lower_fleet
from flows.lower_model import ModelLoweringFailed, lower_model
from flows.manifest import ManifestError, load_manifest
from lowering import lower
from tasks import stages
from tasks.cache import CacheConfig, StageCachePolicy
from tasks.store import ArtifactRef, ArtifactStore
from tests._lowering import executions_during

pytestmark = pytest.mark.usefixtures("fresh_stages")

MODELS = textwrap.dedent(
    '''
    import torch


    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 32)
            self.b = torch.nn.Linear(32, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))


    def batches():
        g = torch.Generator().manual_seed(3)
        return [(torch.randn(2, 16, generator=g),) for _ in range(4)]


    def mlp():
        torch.manual_seed(0)
        return {"module": MLP(), "inputs": (torch.randn(2, 16),), "calibration": batches}
    '''
)

REFUSED = re.compile(r"^emit: MissingOperatorError: operator quantized_decomposed::\w+\.out \(node '\w+'\) needs the "
                     r"stock runtime's 'quantized' kernels, which the profile leaves out \(runtime_ops: portable\)$")


def run(model: str, store: Path, **kwargs) -> dict:
    try:
        return lower_model(model=model, store=str(store), **kwargs)
    except ModelLoweringFailed as exc:
        return exc.manifest


def test_emit_keys_leave_out_the_default_profile():
    program = ArtifactRef("file:///p", "ab" * 32, 1, "program")
    plan = ArtifactRef("file:///m", "cd" * 32, 1, "memory_plan")
    lookup_policy = CacheConfig(results="/tmp").policy("emit", stages.STAGE_VERSIONS["emit"],
                                                       optional=stages.STAGE_OPTIONAL["emit"])
    before = StageCachePolicy(stage="emit", version=stages.STAGE_VERSIONS["emit"])  # the key before runtime_ops
    default = lookup_policy.key_for(stages.stage_inputs("emit", {"program": program, "plan": plan}))
    assert default == before.key_for({"program": program, "plan": plan})
    narrow = lookup_policy.key_for(stages.stage_inputs("emit", {"program": program, "plan": plan,
                                                                "runtime_ops": ["portable"]}))
    assert narrow != default


def test_runtime_ops_fails_an_int8_target_at_emit_and_keys_only_emit(tmp_path, cli):
    (tmp_path / "rmodels.py").write_text(MODELS)
    spec, store = f"{tmp_path / 'rmodels.py'}:mlp", tmp_path / "store"
    # A manifest's runtime_ops: the int8 program calls quantized_decomposed::*, outside "portable".
    fleet = {"store": str(store), "models": [{"name": "mlp", "model": spec, "targets": ["portable"],
                                               "quantize": "int8", "runtime_ops": ["portable"]}]}
    before = stages.EXECUTIONS.copy()
    with pytest.raises(FleetFailed) as failure:
        executions_during(lower_fleet, fleet)
    assert failure.value.summary["failed"] == ["mlp"]
    ran = stages.EXECUTIONS - before
    failed = ArtifactStore(str(store)).get_json("mlp/manifest.json")["targets"]["portable"]
    assert REFUSED.match(failed["error"]), failed["error"]
    assert failed["runtime_ops"] == ["portable"] and failed["pte"] is None
    assert ran["export"] == ran["quantize"] == ran["emit"] == 1 and ran["verify"] == 0
    assert not (store / "outputs" / "mlp" / "portable.pte").exists()
    assert not any(p.read_bytes()[4:8] == b"ET12" for p in (store / "objects").rglob("*") if p.is_file())

    # The default profile passes; only emit and verify run (export and quantize are cached).
    passed, ran = executions_during(run, spec, store, targets=["portable"], quantize="int8")
    result = passed["targets"]["portable"]
    assert result["ok"], result["error"]
    assert "runtime_ops" not in result
    assert (ran["export"], ran["quantize"], ran["emit"], ran["verify"]) == (0, 0, 1, 1), dict(ran)

    # Another profile is another emit key (a miss); its .pte is the library's, byte for byte.
    narrow, ran = executions_during(run, spec, store, targets=["portable"], quantize="int8",
                                    runtime_ops="quantized,portable")
    assert narrow["targets"]["portable"]["ok"], narrow["targets"]["portable"]["error"]
    assert dict(ran) == {"emit": 1}, dict(ran)  # verify is keyed on the .pte: the same bytes
    assert narrow["targets"]["portable"]["runtime_ops"] == ["portable", "quantized"]
    from tasks.model_spec import ModelSpec, load_model

    loaded = load_model(ModelSpec.parse(spec))
    library = lower(loaded.module, loaded.inputs, quantize="int8", calibration=loaded.calibration,
                    runtime_ops=("portable", "quantized")).pte
    pte = (store / "outputs" / "mlp" / "portable.pte").read_bytes()
    assert pte == library
    assert narrow["targets"]["portable"]["pte"]["sha256"] == result["pte"]["sha256"]

    # Every set named is the default: the default's keys, all cached.
    spelled, ran = executions_during(run, spec, store, targets=["portable"], quantize="int8",
                                     runtime_ops=["fused", "llm", "quantized", "portable"])
    assert sum(ran.values()) == 0, dict(ran)
    assert [r["key"] for r in spelled["targets"]["portable"]["stages"]] == \
        [r["key"] for r in result["stages"]]

    # The CLI: --runtime-ops portable fails the target in one line, writes nothing; a bad name is usage.
    out = tmp_path / "out.pte"
    code, _, errors = cli("lower", spec, "-q", "int8", "--runtime-ops", "portable", "-o", out, "--store", store)
    assert code == 1 and len(errors) == 1 and "needs the stock runtime's 'quantized' kernels" in errors[0], errors
    assert not out.exists()
    code, _, errors = cli("lower", spec, "--runtime-ops", "portable,cuda", "-o", out, "--store", store)
    assert code == 2 and errors == ["lowerflow: error: --runtime-ops: unknown op set 'cuda'; "
                                    "allowed: portable, quantized, llm, fused"], errors


def test_manifest_runtime_ops_are_validated_per_target(tmp_path):
    (tmp_path / "rmodels.py").write_text(MODELS)

    def entry(**fields):
        return {"models": [{"name": "m", "model": f"{tmp_path / 'rmodels.py'}:mlp",
                            "targets": ["portable", "xnnpack"], **fields}]}

    fleet = load_manifest(entry(runtime_ops={"portable": "portable,quantized"}))
    assert dict(fleet.models[0].runtime_ops) == {"portable": ["portable", "quantized"], "xnnpack": None}
    assert load_manifest(entry(runtime_ops="portable,quantized,llm,fused")).models[0].runtime_ops is None
    with pytest.raises(ManifestError, match=r"^models\[0\] \('m'\): 'runtime_ops' \(portable\): unknown op set "
                                            r"'xnn'; allowed: portable, quantized, llm, fused$"):
        load_manifest(entry(runtime_ops={"portable": ["xnn"]}))
    with pytest.raises(ManifestError, match=r"'runtime_ops': names targets not lowered: \['reference'\]"):
        load_manifest(entry(runtime_ops={"reference": "portable"}))


def test_runtime_ops_reach_emit_methods_of_a_text_generation_program(tmp_path):
    """An hf: text-generation program (forward and constant methods: emit_methods) calls
    llama::custom_sdpa / update_cache, which a profile without "llm" refuses."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64)).eval().save_pretrained(directory)
    manifest, ran = executions_during(run, f"hf:{directory}", tmp_path / "store", targets=["portable"], verify=False,
                                      hf={"task": "text-generation", "max_seq_len": 16},
                                      runtime_ops=["quantized", "portable"])
    result = manifest["targets"]["portable"]
    assert ran["emit_methods"] == 1 and result["ok"] is False and result["pte"] is None
    assert re.match(r"^emit_methods: MissingOperatorError: method 'forward': operator llama::\w+\.out "
                    r"\(node '\w+'\) needs the stock runtime's 'llm' kernels, which the profile leaves out "
                    r"\(runtime_ops: portable, quantized\)$",
                    result["error"]), result["error"]
