"""Backend fused ops (lowering.backend_ops): declaration checks, the stage-2 rewrite,
delegation (reference on lowerflow's executor, xnnpack on ExecuTorch's runtime),
the portable kernel-call path, re-export, and the cache key through the flow and CLI."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from lowering import export, lower
from lowering.backend_ops import (
    FUSED_META,
    FusedOp,
    apply_fused_ops,
    fused_ops_digest,
    missing_kernels,
)
from lowering.backends.reference import ADDMM_RELU, SUPPORTED_OPS, ReferencePartitioner
from lowering.backends.reference import fused as reference_fused
from lowering.errors import FusedOpError, PartitionError
from lowering.partition import TAG, OpSupportPartitioner, partition
from lowering.program import copy_program
from lowering.pte import deserialize
from lowering.runtime import load
from lowering.verify import program_operators, verify
from tests._interop import assert_all_close

ROOT = Path(__file__).resolve().parent.parent
aten = torch.ops.aten
FUSED_OUT = "lowerflow_reference::addmm_relu.out"


class LinearReluTwice(nn.Module):
    """linear → relu twice (fused), a linear whose pre-activation is read twice (not
    fused: its addmm has another reader), then an elementwise tail."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        a = self.fc3(h)
        return torch.tanh(self.head(torch.relu(a) + a)), h.sum(-1)


def _model():
    torch.manual_seed(0)
    return LinearReluTwice().eval(), (torch.randn(3, 8),)


def _eager(model, inputs):
    with torch.no_grad():
        return list(torch.utils._pytree.tree_leaves(model(*inputs)))


def _calls(program, target):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.fixture(scope="module")
def edge():
    model, inputs = _model()
    return model, inputs, export(model, inputs)


# ------------------------------------------------------------------ the rewrite


def test_stage2_replaces_the_pattern_and_the_reference_backend_takes_it(edge):
    model, inputs, program = edge
    before = len(_calls(program, aten.relu.default))
    result = partition(program, ReferencePartitioner())
    tagged = result.tagged_exported_program
    fused = _calls(tagged, ADDMM_RELU)
    assert len(fused) == 2  # fc1 and fc2; fc3's addmm is read by the add too
    assert len(_calls(tagged, aten.relu.default)) == before - 2 == 1
    assert all(n.meta[FUSED_META] == "lowerflow_reference::addmm_relu" for n in fused)
    assert [tuple(n.meta["val"].shape) for n in fused] == [(3, 16), (3, 16)]
    assert all(n.meta[TAG] in result.partition_tags for n in fused)
    assert not _calls(program, ADDMM_RELU), "the input program must not change"

    lowered = lower(program, partitioner=ReferencePartitioner())
    (module,) = [m for m in lowered.exported_program.graph_module.children() if hasattr(m, "original_module")]
    assert len(_calls(module.original_module, ADDMM_RELU)) == 2
    payload = deserialize(lowered.pte).delegate_data[0]
    assert FUSED_OUT in program_operators(payload)
    assert_all_close(load(lowered.pte).run("forward", list(inputs)), _eager(model, inputs))


def test_rewritten_program_re_exports_with_the_fused_op(edge):
    model, inputs, program = edge
    rewritten = apply_fused_ops(copy_program(program), reference_fused.FUSED_OPS)
    assert len(_calls(rewritten, ADDMM_RELU)) == 2
    again = torch.export.export(rewritten.module(), inputs)
    assert len(_calls(again, ADDMM_RELU)) == 2
    assert_all_close(list(again.module()(*inputs)), _eager(model, inputs))
    # ... and lowering's own stage 1 keeps it (a CompositeExplicitAutograd op is not decomposed).
    assert len(_calls(export(rewritten.module(), inputs), ADDMM_RELU)) == 2


def test_rewrite_is_deterministic_across_processes(edge):
    _, _, program = edge
    here = lower(program, partitioner=ReferencePartitioner()).pte
    code = textwrap.dedent(
        """
        import hashlib, sys, torch
        sys.path.insert(0, "tests")
        from test_backend_ops import _model
        from lowering import export, lower
        from lowering.backends.reference import ReferencePartitioner, fused
        from lowering.backend_ops import fused_ops_digest
        model, inputs = _model()
        pte = lower(export(model, inputs), partitioner=ReferencePartitioner()).pte
        print(hashlib.sha256(pte).hexdigest(), fused_ops_digest(fused.FUSED_OPS))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=_env())
    assert out.returncode == 0, out.stderr
    import hashlib

    pte_digest, ops_digest = out.stdout.split()[-2:]
    assert pte_digest == hashlib.sha256(here).hexdigest()
    assert ops_digest == fused_ops_digest(reference_fused.FUSED_OPS)


def test_digest_changes_with_the_pattern_and_the_op():
    base = reference_fused.FUSED_OPS[0]
    clamp = FusedOp(ADDMM_RELU, lambda b, x, w: torch.clamp(torch.addmm(b, x, w), min=0), base.example_inputs)
    same = FusedOp(ADDMM_RELU, reference_fused._linear_relu_pattern, base.example_inputs)
    from lowering.backends.xnnpack import fused as xnnpack_fused

    other_op = FusedOp(xnnpack_fused.ADDMM_RELU, reference_fused._linear_relu_pattern, base.example_inputs)
    digests = {fused_ops_digest([f]) for f in (base, clamp, other_op)}
    assert len(digests) == 3
    assert fused_ops_digest([same]) == fused_ops_digest([base])
    assert fused_ops_digest([]) == ""


# ------------------------------------------------------------------ declarations


@pytest.fixture(scope="module")
def test_ops():
    """Ops of a test namespace: one with only a CPU kernel, one with no kernel, one with a fake impl."""
    lib = torch.library.Library("lowerflow_test_ops", "FRAGMENT")
    lib.define("cpu_only(Tensor self, Tensor mat1, Tensor mat2) -> Tensor")
    lib.impl("cpu_only", lambda b, x, w: torch.relu(torch.addmm(b, x, w)), "CPU")
    lib.define("no_kernel(Tensor self, Tensor mat1, Tensor mat2) -> Tensor")
    lib.define("with_fake(Tensor self, Tensor mat1, Tensor mat2) -> Tensor")
    lib.impl("with_fake", lambda b, x, w: torch.relu(torch.addmm(b, x, w)), "CPU")
    torch.library.register_fake("lowerflow_test_ops::with_fake", lambda b, x, w: torch.empty(x.shape[0], w.shape[1]),
                                lib=lib)
    yield torch.ops.lowerflow_test_ops
    lib._destroy()


def test_op_without_a_traceable_kernel_is_rejected_at_declaration(test_ops):
    inputs = reference_fused.FUSED_OPS[0].example_inputs
    pattern = reference_fused._linear_relu_pattern
    with pytest.raises(FusedOpError, match=r"fused op lowerflow_test_ops::cpu_only has no kernel torch.export can "
                                           r"trace \(Meta, CompositeExplicitAutograd"):
        FusedOp(test_ops.cpu_only.default, pattern, inputs)
    with pytest.raises(FusedOpError, match=r"lowerflow_test_ops::no_kernel has no kernel .*trace.* and no kernel that runs on CPU"):
        FusedOp(test_ops.no_kernel.default, pattern, inputs)
    with pytest.raises(FusedOpError, match=r"lowerflow_test_ops::cpu_only: give an overload"):
        FusedOp(test_ops.cpu_only, pattern, inputs)
    with pytest.raises(FusedOpError, match="mutates an argument"):
        FusedOp(aten.relu_.default, pattern, inputs)
    assert missing_kernels(test_ops.with_fake.default) == []  # a register_fake impl is enough to trace
    assert missing_kernels(ADDMM_RELU) == []

    class Calls(nn.Module):
        def __init__(self, op):
            super().__init__()
            self.op = op

        def forward(self, b, x, w):
            return self.op(b, x, w)

    # What the check prevents: a graph calling the CPU-only op cannot be exported ...
    with pytest.raises(Exception, match="lowerflow_test_ops.cpu_only|lowerflow_test_ops::cpu_only"):
        torch.export.export(Calls(test_ops.cpu_only.default), inputs)
    # ... while the op with a fake impl can.
    assert _calls(torch.export.export(Calls(test_ops.with_fake.default), inputs), test_ops.with_fake.default)
    assert missing_kernels(ADDMM_RELU) == []


def test_bad_declarations_fail_at_pass_time_naming_the_op(edge, test_ops):
    _, _, program = edge
    inputs = reference_fused.FUSED_OPS[0].example_inputs
    untraceable = FusedOp(ADDMM_RELU, lambda b, x, w: torch.relu(torch.addmm(b, x, w)).numpy(), inputs)
    with pytest.raises(FusedOpError, match="lowerflow_reference::addmm_relu: its pattern cannot be traced"):
        partition(program, ReferencePartitioner(fused_ops=[untraceable]))
    wrong = FusedOp(ADDMM_RELU, reference_fused._linear_relu_pattern, inputs, replacement=lambda b, x, w: torch.relu(x))
    with pytest.raises(FusedOpError, match="replacement does not call lowerflow_reference::addmm_relu"):
        partition(program, ReferencePartitioner(fused_ops=[wrong]))
    two = FusedOp(ADDMM_RELU, lambda b, x, w: (torch.relu(torch.addmm(b, x, w)), x.neg()), inputs)
    with pytest.raises(FusedOpError, match="the pattern returns 2 values, the replacement 1"):
        partition(program, ReferencePartitioner(fused_ops=[two]))
    partitioner = OpSupportPartitioner("ReferenceBackend", SUPPORTED_OPS)
    partitioner.fused_ops = (aten.relu.default,)
    with pytest.raises(PartitionError, match="fused_ops must hold lowering.backend_ops.FusedOp, got OpOverload"):
        partition(program, partitioner)
    with pytest.raises(ValueError, match="unknown fused op 'nope::op'"):
        ReferencePartitioner(fused_ops=["nope::op"])
    assert not _calls(program, ADDMM_RELU)


# ------------------------------------------------------------------ the portable path


def test_undelegated_fused_op_is_a_kernel_call_our_executor_runs(edge, tmp_path):
    model, inputs, program = edge
    # The backend declares the fused op but does not take it: it stays in the top level.
    others = SUPPORTED_OPS - {ADDMM_RELU, aten.addmm.default, aten.relu.default}
    lowered = lower(program, partitioner=ReferencePartitioner(others, fused_ops=reference_fused.FUSED_OPS))
    assert len(_calls(lowered.exported_program, ADDMM_RELU)) == 2
    assert FUSED_OUT in program_operators(lowered.pte)
    assert lowered.memory_plan.out_variants["addmm_relu"] == FUSED_OUT
    assert_all_close(load(lowered.pte).run("forward", list(inputs)), _eager(model, inputs))

    # No backend at all: the pass applied for the portable target.
    portable = lower(apply_fused_ops(copy_program(program), reference_fused.FUSED_OPS))
    assert deserialize(portable.pte).delegate_data == []
    assert FUSED_OUT in program_operators(portable.pte)
    assert_all_close(load(portable.pte).run("forward", list(inputs)), _eager(model, inputs))

    # A fresh process that never imported the backend: the executor loads the op's library.
    path = tmp_path / "fused.pte"
    path.write_bytes(portable.pte)
    code = textwrap.dedent(
        f"""
        import torch
        from lowering.runtime import load
        import sys
        assert "lowering.backends.reference" not in sys.modules
        torch.manual_seed(1)
        out = load(open({str(path)!r}, "rb").read()).run("forward", [torch.randn(3, 8)])
        print(len(out), tuple(out[0].shape))
        """
    )
    fresh = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env=_env())
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stdout.split("\n")[-2] == "2 (3, 4)"


def test_executorch_runtime_refuses_the_fused_kernel_call_and_verify_says_why(edge):
    pytest.importorskip("executorch")
    from tests._interop import run_in_executorch

    model, inputs, program = edge
    portable = lower(apply_fused_ops(copy_program(program), reference_fused.FUSED_OPS)).pte
    with pytest.raises(RuntimeError, match=r"Failed to load method forward, error: 0x:?14"):  # OperatorMissing
        run_in_executorch(portable, list(inputs))
    report = verify(portable, model, inputs)
    checks = {c.runtime: c for c in report.checks}
    assert checks["lowerflow"].ok is True
    assert checks["executorch"].ok is None
    assert checks["executorch"].skipped == f"operators not in this runtime: ['{FUSED_OUT}']"
    assert report.ok


# ------------------------------------------------------------------ xnnpack


def test_xnnpack_fused_op_is_one_fully_connected_node_on_executorch(edge):
    pytest.importorskip("executorch")
    from lowering.backends.xnnpack import XnnpackPartitioner
    from lowering.backends.xnnpack import fused as xnnpack_fused
    from lowering.backends.xnnpack.payload import deserialize_payload
    from lowering.backends.xnnpack.generated import xnngraph_generated as fbx
    from tests._interop import run_in_executorch

    model, inputs, program = edge
    tagged = partition(program, XnnpackPartitioner(fused_ops=xnnpack_fused.FUSED_OPS)).tagged_exported_program
    fused = _calls(tagged, xnnpack_fused.ADDMM_RELU)
    assert len(fused) == 2 and all(n.meta.get(TAG) for n in fused)
    assert not _calls(partition(program, XnnpackPartitioner()).tagged_exported_program, xnnpack_fused.ADDMM_RELU)

    lowered = lower(program, partitioner=XnnpackPartitioner(fused_ops=["lowerflow_xnnpack::addmm_relu"]))
    assert not [n for n in lowered.exported_program.graph.nodes if n.op == "call_function"
                and getattr(n.target, "namespace", "") == "lowerflow_xnnpack"]
    graph, _ = deserialize_payload(deserialize(lowered.pte).delegate_data[0])
    clamps = [(n.outputMinMax.outputMin, n.outputMinMax.outputMax) for n in graph.xnodes
              if n.xnodeUnionType == fbx.NodeUnion.XNNFullyConnected and n.outputMinMax is not None]
    assert clamps.count((0.0, float("inf"))) == 2
    expected = _eager(model, inputs)
    assert_all_close(run_in_executorch(lowered.pte, list(inputs))[0], expected)
    assert_all_close(load(lowered.pte).run("forward", list(inputs)), expected)


# ------------------------------------------------------------------ flow and CLI


MODEL_FILE = '''
import torch
from torch import nn


class LinearReluTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def model():
    torch.manual_seed(0)
    return LinearReluTwice().eval(), (torch.randn(3, 8),)
'''


def test_flow_partition_key_follows_the_fused_op_declaration(fresh_stages, tmp_path, monkeypatch):
    from flows.lower_model import lower_model

    stages = fresh_stages
    (tmp_path / "fusemodel.py").write_text(MODEL_FILE)
    spec, store = f"{tmp_path / 'fusemodel.py'}:model", str(tmp_path / "store")

    def run():
        before = stages.EXECUTIONS.copy()
        try:
            manifest = lower_model(spec, ["reference"], store=store)
        finally:
            stages.LIVE.clear()
        entry = manifest["targets"]["reference"]
        assert entry["ok"], entry["error"]
        assert entry["verify"]["ok"]
        return entry, stages.EXECUTIONS - before

    fused, ran = run()
    assert ran["partition"] == 1 and fused["delegation"]["partitions"] == 1
    _, ran = run()
    assert sum(ran.values()) == 0

    # Same target, same options, another declaration (the pattern): stage 2 runs again.
    base = reference_fused.FUSED_OPS[0]
    clamp = FusedOp(ADDMM_RELU, lambda b, x, w: torch.clamp(torch.addmm(b, x, w), min=0), base.example_inputs)
    monkeypatch.setattr(reference_fused, "FUSED_OPS", (clamp,))
    unfused, ran = run()
    assert ran["export"] == 0 and ran["partition"] == 1
    assert unfused["delegation"]["total_nodes"] == fused["delegation"]["total_nodes"] + 2  # relu, addmm no longer fused
    assert unfused["pte"]["sha256"] != fused["pte"]["sha256"]

    monkeypatch.setattr(reference_fused, "FUSED_OPS", (base,))
    again, ran = run()
    assert sum(ran.values()) == 0 and again["pte"]["sha256"] == fused["pte"]["sha256"]


def test_cli_lower_reference_delegates_the_fused_op(tmp_path, prefect_api):
    from tests.test_cli import lowerflow

    out = tmp_path / "mlp.reference.pte"
    done = lowerflow("lower", "examples/models.py:mlp", "--target", "reference", "-o", str(out),
                     "--store", str(tmp_path / "store"), home=tmp_path / "prefect-home", api=prefect_api)
    assert done.returncode == 0, done.stderr
    assert f"reference: wrote {out}" in done.stdout
    pte = out.read_bytes()
    assert program_operators(pte) == []  # everything delegated
    (payload,) = deserialize(pte).delegate_data
    assert program_operators(payload).count(FUSED_OUT) == 1
    from examples.models import MODELS

    model, inputs = MODELS["mlp"]()
    assert_all_close(load(pte).run("forward", list(inputs)), _eager(model, inputs))


def _env():
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LOWERFLOW_"))}
    env["PYTHONPATH"] = str(ROOT)
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    return env


def _act(x):
    return torch.relu(x)


def _act_changed(x):
    return torch.clamp(x, min=0)


def test_code_digest_sees_called_functions_and_closures():
    from lowering.backend_ops import code_digest

    def pattern(b, x, w):
        return _act(torch.addmm(b, x, w))

    def make(limit):
        return lambda b, x, w: torch.clamp(torch.addmm(b, x, w), min=limit)

    before = code_digest(pattern)
    assert code_digest(pattern) == before
    globals()["_act"], saved = _act_changed, _act
    try:
        assert code_digest(pattern) != before  # the helper it calls changed
    finally:
        globals()["_act"] = saved
    assert code_digest(make(0)) != code_digest(make(1))
    assert code_digest(make(0)) == code_digest(make(0))
