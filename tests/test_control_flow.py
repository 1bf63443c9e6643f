"""torch.cond and torch.map through every stage: export, partitions inside branches and
bodies, memory planning, emission, our executor and ExecuTorch's runtime, the cached flow
and the CLI."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lowering
from examples.models import cond_linear, map_linear
from lowering.control_flow_graph import COND, MAP, iter_scopes
from lowering.to_backend import count_submodule_delegates
from lowering.errors import ExportError
from lowering.lower import is_edge_form
from lowering.pte import deserialize
from lowering.runtime import load
from lowering.targets import partitioner_for
from tests._interop import assert_all_close, flatten, run_in_executorch

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "examples" / "models.py"


def _eager(model, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return flatten(model(*inputs))


def _negated(inputs):
    return tuple(-x for x in inputs)


def _delegate_ids(pte: bytes) -> list[str]:
    plan = deserialize(pte).program.executionPlan[0]
    return [d.id.decode() if isinstance(d.id, bytes) else d.id for d in plan.delegates or []]


def _instruction_kinds(pte: bytes) -> list[int]:
    plan = deserialize(pte).program.executionPlan[0]
    return [i.instrArgsType for i in plan.chains[0].instructions]


@pytest.fixture(scope="module")
def cond_model():
    model, inputs = cond_linear()
    # The example takes the true branch, its negation the false one.
    assert (inputs[0].sum() > 0) and (_negated(inputs)[0].sum() < 0)
    return model, inputs


@pytest.fixture(scope="module")
def map_model():
    return map_linear()


# --------------------------------------------------------------------------- export


def test_export_keeps_cond_and_map_with_edge_form_submodules(cond_model, map_model):
    for (model, inputs), op in ((cond_model, COND), (map_model, MAP)):
        program = lowering.export(model, inputs)
        assert [n.target for n in program.graph.nodes if n.target in (COND, MAP)] == [op]
        scopes = dict(iter_scopes(program.graph_module))
        assert len(scopes) == (3 if op is COND else 2)
        for scope, gm in scopes.items():
            if not scope:
                continue
            targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
            # Decomposed inside too (linear -> permute_copy + addmm), views are copies.
            assert torch.ops.aten.addmm.default in targets
            assert torch.ops.aten.permute_copy.default in targets
            assert torch.ops.aten.permute.default not in targets
            assert all(n.op != "get_attr" for n in gm.graph.nodes)  # no parameters of their own


# --------------------------------------------------------------------------- portable (ExecuTorch runtime)


def test_cond_portable_runs_both_branches_in_executorch(cond_model):
    pytest.importorskip("executorch")
    model, inputs = cond_model
    pte = lowering.lower(model, inputs).pte
    kinds = _instruction_kinds(pte)
    from lowering.pte import schema

    assert kinds.count(schema.InstructionArguments.JumpFalseCall) == 2
    assert kinds.count(schema.InstructionArguments.MoveCall) == 2
    true_out, false_out = _eager(model, inputs), _eager(model, _negated(inputs))
    # Alternate branches on one loaded method: each call takes the branch of its input.
    for x, expected in ((inputs, true_out), (_negated(inputs), false_out), (inputs, true_out)):
        (got,) = run_in_executorch(pte, x)
        assert_all_close(got, expected)
    assert not torch.allclose(true_out[0], -false_out[0])  # the branches compute different things
    # Our executor agrees.
    program = load(pte)
    for x in (inputs, _negated(inputs)):
        assert_all_close(program.run("forward", list(x)), _eager(model, x))


def test_map_portable_runs_in_executorch_twice(map_model):
    pytest.importorskip("executorch")
    model, inputs = map_model
    pte = lowering.lower(model, inputs).pte
    expected = _eager(model, inputs)
    # Two calls on one method: the loop index is reset at the end of each run.
    first, second = run_in_executorch(pte, inputs, calls=2)
    assert_all_close(first, expected)
    assert_all_close(second, expected)
    assert_all_close(load(pte).run("forward", list(inputs)), expected)


# --------------------------------------------------------------------------- delegated branches and bodies


@pytest.mark.parametrize("target", ["xnnpack", "reference"])
def test_cond_branches_are_delegated(cond_model, target):
    model, inputs = cond_model
    result = lowering.lower(model, inputs, partitioner=partitioner_for(target))
    gm = result.exported_program.graph_module
    # One partition in each branch (the linear layer and its elementwise op).
    assert count_submodule_delegates(gm) == 2
    backend = "XnnpackBackend" if target == "xnnpack" else "ReferenceBackend"
    ids = _delegate_ids(result.pte)
    assert ids.count(backend) >= 2, ids
    for x in (inputs, _negated(inputs)):
        expected = _eager(model, x)
        assert_all_close(load(result.pte).run("forward", list(x)), expected)
        if target == "xnnpack":
            pytest.importorskip("executorch")
            (got,) = run_in_executorch(result.pte, x)
            assert_all_close(got, expected)


@pytest.mark.parametrize("target", ["xnnpack", "reference"])
def test_map_body_is_delegated(map_model, target):
    model, inputs = map_model
    result = lowering.lower(model, inputs, partitioner=partitioner_for(target))
    assert count_submodule_delegates(result.exported_program.graph_module) == 1
    expected = _eager(model, inputs)
    assert_all_close(load(result.pte).run("forward", list(inputs)), expected)
    if target == "xnnpack":
        pytest.importorskip("executorch")
        first, second = run_in_executorch(result.pte, inputs, calls=2)
        assert_all_close(first, expected)
        assert_all_close(second, expected)


def test_branch_parameters_are_operands_not_consumed(cond_model):
    """Parameters stay top-level placeholders passed to the cond; a delegate inside a branch
    takes them as inputs (a submodule never owns weights)."""
    model, inputs = cond_model
    program = lowering.to_backend(lowering.export(model, inputs), partitioner_for("reference"))
    parameters = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "PARAMETER"]
    assert len(parameters) == 4
    (cond,) = [n for n in program.graph.nodes if n.target is COND]
    assert {a.name for a in cond.args[3]} >= set(parameters)
    for scope, gm in iter_scopes(program.graph_module):
        if scope:
            (call,) = [n for n in gm.graph.nodes if n.op == "call_function" and "delegate" in str(n.target)]
            lowered = getattr(gm, call.args[0].target)
            kinds = {s.kind.name for s in lowered.original_module.graph_signature.input_specs}
            assert kinds == {"USER_INPUT"}


# --------------------------------------------------------------------------- memory plan


def test_memory_plan_covers_submodule_values(cond_model, map_model):
    model, inputs = cond_model
    plan = lowering.lower(model, inputs).memory_plan
    keys = set(plan.allocations)
    assert {"true_graph_0/addmm", "true_graph_0/relu", "false_graph_0/addmm", "false_graph_0/mul"} <= keys
    # Each branch's result is placed on the cond output it is moved to.
    assert plan.allocations["true_graph_0/relu"].offset == plan.allocations["cond.0"].offset
    assert plan.allocations["false_graph_0/mul"].offset == plan.allocations["cond.0"].offset
    _assert_no_overlap(plan, shared={"true_graph_0/relu", "false_graph_0/mul", "cond.0"})

    model, inputs = map_model
    plan = lowering.lower(model, inputs).memory_plan
    # The map's slice is planned (the loop writes it), as are the body's results.
    assert {"body_graph_0/xs", "body_graph_0/addmm", "map_impl.0"} <= set(plan.allocations)
    assert plan.allocations["body_graph_0/xs"].size == 4 * 16 * 4
    _assert_no_overlap(plan, shared=set())


def _assert_no_overlap(plan, shared: set[str]) -> None:
    """Values whose lifetimes overlap never share bytes (except the given shared group)."""
    items = [(k, a) for k, a in plan.allocations.items() if k not in plan.aliases]
    for i, (k1, a) in enumerate(items):
        for k2, b in items[i + 1:]:
            if k1 in shared and k2 in shared:
                continue
            live = a.lifetime[0] <= b.lifetime[1] and b.lifetime[0] <= a.lifetime[1]
            bytes_overlap = a.offset < b.offset + b.size and b.offset < a.offset + a.size
            assert not (live and bytes_overlap), (k1, a, k2, b)


# --------------------------------------------------------------------------- more shapes of cond


class TwoOutputCond(nn.Module):
    """A cond with two results; the predicate is computed from the data."""

    def forward(self, x):
        def double(x):
            return x * 3.0, torch.relu(x)

        def halve(x):
            return x * 2.0, x - 1.0

        a, b = torch.cond(x.sum() > 0, double, halve, (x,))
        return a + 1.0, b


def test_cond_with_two_results_portable_and_executor():
    pytest.importorskip("executorch")
    model, inputs = TwoOutputCond(), (torch.rand(3, 5) + 0.1,)
    pte = lowering.lower(model, inputs).pte
    for x in (inputs, _negated(inputs)):
        expected = _eager(model, x)
        assert_all_close(run_in_executorch(pte, x)[0], expected)
        assert_all_close(load(pte).run("forward", list(x)), expected)


def test_same_bytes_in_another_process():
    """Deterministic: the xnnpack .pte of cond_linear is the same in a fresh process."""
    model, inputs = cond_linear()
    here = lowering.lower(model, inputs, partitioner=partitioner_for("xnnpack")).pte
    again = lowering.lower(*cond_linear(), partitioner=partitioner_for("xnnpack")).pte
    assert here == again
    code = (
        "import hashlib, lowering; from examples.models import cond_linear; "
        "from lowering.targets import partitioner_for; "
        "print(hashlib.sha256(lowering.lower(*cond_linear(), partitioner=partitioner_for('xnnpack')).pte).hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip().splitlines()[-1] == hashlib.sha256(here).hexdigest()


# --------------------------------------------------------------------------- what stays unsupported


class WhileLoop(nn.Module):
    def forward(self, x):
        def keep_going(i, x):
            return i < 3

        def step(i, x):
            return i + 1, x * 2.0

        return torch._higher_order_ops.while_loop(keep_going, step, (torch.tensor(0), x))[1]


class Scan(nn.Module):
    def forward(self, xs):
        from torch._higher_order_ops.scan import scan

        return scan(lambda carry, x: (carry + x, carry * 2.0), torch.zeros(4), xs)[1]


class MapWithTwoResults(nn.Module):
    def forward(self, xs):
        return torch._higher_order_ops.map(lambda x: (x + 1.0, x * 2.0), xs)


class MapOverTwo(nn.Module):
    def forward(self, xs, ys):
        return torch._higher_order_ops.map(lambda xy: xy[0] + xy[1], (xs, ys))


@pytest.mark.parametrize(
    "model, inputs, fragments",
    [
        (WhileLoop(), (torch.randn(3),), ["model 'WhileLoop'", "node 'while_loop'", "torch.while_loop is not supported"]),
        (Scan(), (torch.randn(3, 4),), ["model 'Scan'", "node 'scan'", "torch.scan is not supported"]),
        (MapOverTwo(), (torch.randn(3, 4), torch.randn(3, 4)), ["model 'MapOverTwo'", "node 'map_impl'", "over 2 tensors"]),
        (MapWithTwoResults(), (torch.randn(3, 4),), ["model 'MapWithTwoResults'", "node 'map_impl'", "2 outputs"]),
    ],
    ids=["while_loop", "scan", "map_over_two", "map_two_results"],
)
def test_unsupported_control_flow_is_a_clear_export_error(model, inputs, fragments):
    with pytest.raises(ExportError) as info:
        lowering.lower(model, inputs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message


# --------------------------------------------------------------------------- the cached flow and the CLI


@pytest.mark.usefixtures("fresh_stages")
def test_cached_flow_delegates_branches_and_matches_the_library(tmp_path):
    from flows.lower_model import lower_model
    from tasks import stages
    from tasks.store import ArtifactStore

    pytest.importorskip("executorch")
    spec, store = f"{MODELS}:cond_linear", str(tmp_path / "store")
    before = stages.EXECUTIONS.copy()
    manifest = lower_model(spec, ["portable", "xnnpack"], store=store)
    ran = stages.EXECUTIONS - before
    assert ran["lower_control_flow"] == 1  # only the delegated target
    model, inputs = cond_linear()
    for target in ("portable", "xnnpack"):
        result = manifest["targets"][target]
        assert result["ok"], result["error"]
        assert result["verify"]["ok"]
        pte = ArtifactStore(store).get_named(f"cond_linear/{target}.pte")
        library = lowering.lower(*cond_linear(), partitioner=partitioner_for(target)).pte
        assert pte == library, target
        for x in (inputs, _negated(inputs)):
            assert_all_close(run_in_executorch(pte, x)[0], _eager(model, x))
    delegation = manifest["targets"]["xnnpack"]["delegation"]
    assert delegation["partitions"] >= 3  # the top level's, plus one per branch
    stages.LIVE.clear()

    before = stages.EXECUTIONS.copy()
    again = lower_model(spec, ["portable", "xnnpack"], store=store)
    assert sum((stages.EXECUTIONS - before).values()) == 0
    assert [r["stage"] for r in again["targets"]["xnnpack"]["stages"]].count("lower_control_flow") == 1
    assert all(r["cached"] for r in again["targets"]["xnnpack"]["stages"])


def test_cli_lowers_map_model_for_xnnpack(tmp_path, prefect_api):
    pytest.importorskip("executorch")
    from tests.test_cli import lowerflow

    out = tmp_path / "map.pte"
    result = lowerflow("lower", "examples/models.py:map_linear", "-t", "xnnpack", "-o", str(out),
                       "--store", str(tmp_path / "store"), home=tmp_path / "prefect-home", api=prefect_api)
    assert result.returncode == 0, result.stderr
    stages = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("xnnpack ")]
    assert "lower_control_flow" in stages and stages[-1] == "verify"
    pte = out.read_bytes()
    assert "XnnpackBackend" in _delegate_ids(pte)
    model, inputs = map_linear()
    assert_all_close(run_in_executorch(pte, inputs)[0], _eager(model, inputs))


def test_tagging_the_cond_node_itself_is_a_partition_error(cond_model):
    from lowering.errors import PartitionError
    from tests._lowering import TagBy

    model, inputs = cond_model
    program = lowering.export(model, inputs)
    whole = TagBy(lambda n: "T" if n.target is COND else None, constants=False)
    with pytest.raises(PartitionError, match="tagged cond node 'cond' with 'T'.*not delegated as a whole"):
        lowering.to_backend(program, whole)


# --------------------------------------------------------------------------- nesting


class CondInsideMap(nn.Module):
    """Each slice takes its own branch: a linear layer or a shift."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, xs):
        def body(x):
            return torch.cond(x.sum() > 0, lambda x: torch.relu(self.fc(x)) + 1.0, lambda x: x - 1.0, (x,))

        return torch._higher_order_ops.map(body, xs)


class CondInsideCond(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        def inner(x, y):
            return torch.cond(y.sum() > 0, lambda x: self.fc(x) * 2.0, lambda x: x - 3.0, (x,)) + y

        return torch.cond(x.sum() > 0, inner, lambda x, y: x * y, (x, y))


def _ones(sign: float = 1.0) -> torch.Tensor:
    """A fresh tensor each call: example inputs that are one tensor object would be
    exported as one input."""
    return torch.full((2, 4), sign)


@pytest.mark.parametrize("target", ["portable", "reference", "xnnpack"])
@pytest.mark.parametrize(
    "model, input_sets, delegates",
    [
        (CondInsideMap, [(torch.tensor([[1.0, 2, 3, 4], [-1, -2, -3, -4], [5, 6, 7, -30]]),)], 1),
        (CondInsideCond, [(_ones(), _ones()), (_ones(), _ones(-1.0)), (_ones(-1.0), _ones())], 1),
    ],
    ids=["cond_in_map", "cond_in_cond"],
)
def test_nested_control_flow(model, input_sets, delegates, target):
    """Every branch taken at least once; the linear layer in the innermost true branch is delegated;
    the stored program (lowered modules inside nested submodules) reads back to the same .pte."""
    from lowering.serialize import deserialize_any, serialize_any

    model = model().eval()
    result = lowering.lower(model, input_sets[0], partitioner=partitioner_for(target))
    if target != "portable":
        assert count_submodule_delegates(result.exported_program.graph_module) >= delegates
        stored = serialize_any(result.exported_program)
        again = deserialize_any(stored.manifest, stored.blobs.__getitem__)
        assert lowering.lower(again).pte == result.pte
    for inputs in input_sets:
        expected = _eager(model, inputs)
        assert_all_close(load(result.pte).run("forward", list(inputs)), expected)
        if target != "reference":
            pytest.importorskip("executorch")
            assert_all_close(run_in_executorch(result.pte, inputs, calls=2)[1], expected)


def test_branch_returning_its_operand_is_moved_and_kept_alive(cond_model):
    """torch.cond refuses a branch that returns its input, but a program built by hand may:
    the MoveCall then points the cond's output at the operand, so the operand's memory must
    live as long as the output does."""
    pytest.importorskip("executorch")
    model, inputs = cond_model
    program = lowering.export(model, inputs)
    false_branch = program.graph_module.false_graph_0
    operand = next(n for n in false_branch.graph.nodes if n.op == "placeholder")
    false_branch.graph.output_node().args = ((operand,),)
    false_branch.graph.eliminate_dead_code()
    false_branch.recompile()
    result = lowering.lower(program)
    plan = result.memory_plan
    assert plan.allocations["x"].lifetime[1] >= plan.allocations["cond.0"].lifetime[1]
    negative = _negated(inputs)
    expected = [negative[0] + 1.0]  # cond_linear adds 1 to the cond's result
    for got in (run_in_executorch(result.pte, negative, calls=2)[1], load(result.pte).run("forward", list(negative))):
        assert_all_close(got, expected)
    assert_all_close(run_in_executorch(result.pte, inputs)[0], _eager(model, inputs))


def test_lower_decomposes_a_torch_export_program_with_control_flow(map_model):
    """A program straight from torch.export has only the map at its top level but ``linear``
    in its body: it is not in edge form, so ``lower`` decomposes it (same bytes as from the module)."""
    model, inputs = map_model
    raw = torch.export.export(model, inputs)
    assert not is_edge_form(raw)
    assert lowering.lower(raw).pte == lowering.lower(model, inputs).pte
