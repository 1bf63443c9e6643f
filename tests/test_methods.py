"""Several methods per program (issue 10): one .pte with ``encode`` and ``decode``.

The library (lowering.lower_methods), ExecuTorch's runtime loading each method by
name from the one .pte, shared weights and equal delegate payloads stored once,
the model spec form ``{method: (module, inputs)}``, the cached flow and the CLI.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.models import MLP, Decode, Seq2Seq, encoder_decoder, mlp
from lowering import MethodError, lower, lower_methods
from lowering.pte import deserialize
from lowering.pte.format import decode_string
from lowering.runtime import load
from lowering.targets import PORTABLE, partitioner_for
from lowering.verify import verify_methods

from ._interop import assert_all_close, flatten

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "models.py"
TARGETS = (PORTABLE, "reference", "xnnpack")


def _partitioner(target):
    return None if target == PORTABLE else partitioner_for(target, {})


def _eager(module, inputs):
    with torch.no_grad():
        return flatten(module(*inputs))


@pytest.fixture(scope="module")
def lowered():
    """target -> (MethodsLowerResult, the methods it was lowered from)."""
    out = {}
    for target in TARGETS:
        methods = encoder_decoder()
        out[target] = (lower_methods(methods, partitioner=_partitioner(target)), methods)
    return out


# --- the library --------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_each_method_runs_by_name_and_matches_eager(lowered, target):
    result, methods = lowered[target]
    program = load(result.pte)
    assert program.method_names == ["decode", "encode"]  # name order
    for name, (module, inputs) in methods.items():
        assert_all_close(program.run(name, list(inputs)), _eager(module, inputs))


@pytest.mark.parametrize("target", (PORTABLE, "xnnpack"))
def test_executorch_loads_each_method_from_one_pte(lowered, target):
    runtime = pytest.importorskip("executorch.runtime")
    result, methods = lowered[target]
    program = runtime.Runtime.get().load_program(result.pte)
    assert set(program.method_names) == {"encode", "decode"}
    for name, (module, inputs) in methods.items():
        method = program.load_method(name)
        assert_all_close(list(method.execute(list(inputs))), _eager(module, inputs))
    if target == "xnnpack":
        assert _backend_ids(result.pte) == {"XnnpackBackend"}


def _backend_ids(pte):
    return {decode_string(d.id) for plan in deserialize(pte).program.executionPlan for d in plan.delegates or []}


@pytest.mark.parametrize("target", TARGETS)
def test_shared_embedding_is_stored_once(lowered, target):
    """The one .pte is smaller than the two single-method ones by the shared embedding,
    and its constant segment holds the embedding's bytes once."""
    result, methods = lowered[target]
    embedding = methods["encode"][0].model.embed.weight.detach().contiguous()
    data = embedding.reshape(-1).view(torch.uint8).numpy().tobytes()
    constants = deserialize(result.pte).constants
    assert sum(1 for c in constants if c[: len(data)] == data) == 1
    singles = [lower(module, inputs, partitioner=_partitioner(target)).pte for module, inputs in methods.values()]
    assert len(result.pte) <= sum(len(p) for p in singles) - len(data)


def test_identical_delegate_payloads_are_stored_once():
    """Two methods with the same delegated program (same backend, bytes, compile specs):
    one payload segment, and the program is barely larger than one method's."""
    model, inputs = mlp()
    single = lower(model, inputs, partitioner=_partitioner("xnnpack")).pte
    both = lower({"first": (model, inputs), "second": (model, inputs)}, partitioner=_partitioner("xnnpack")).pte
    pte = deserialize(both)
    plans = pte.program.executionPlan
    assert [decode_string(p.name) for p in plans] == ["first", "second"]
    assert len(pte.delegate_data) == 1
    assert {p.delegates[0].processed.index for p in plans} == {0}
    assert len(both) < len(single) + 4096  # a second plan table, not a second copy of the weights
    program = load(both)
    for name in ("first", "second"):
        assert_all_close(program.run(name, list(inputs)), _eager(model, inputs))


def test_method_order_and_bytes_do_not_depend_on_dict_order(lowered):
    methods = encoder_decoder()
    reverse = dict(reversed(list(methods.items())))
    assert list(reverse) == ["decode", "encode"]
    assert lower_methods(reverse).pte == lowered[PORTABLE][0].pte


def test_bytes_are_identical_in_another_process(lowered, tmp_path):
    script = (
        "import sys; from examples.models import encoder_decoder; from lowering import lower_methods; "
        "sys.stdout.buffer.write(lower_methods(encoder_decoder()).pte)"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout
    assert out == lowered[PORTABLE][0].pte


def test_verify_methods_checks_every_method(lowered):
    result, methods = lowered[PORTABLE]
    reports = verify_methods(result.pte, methods)
    assert list(reports) == ["decode", "encode"] and all(r.ok for r in reports.values())
    wrong = dict(methods, extra=methods["encode"])
    assert verify_methods(result.pte, wrong)["extra"].ok is False
    torch.manual_seed(1)
    other = Decode(Seq2Seq()).eval()  # other weights, same shapes
    reports = verify_methods(result.pte, dict(methods, decode=(other, methods["decode"][1])))
    assert reports["decode"].ok is False and reports["encode"].ok


@pytest.mark.parametrize(
    "methods, fragment",
    [
        ({}, "non-empty dict"),
        ({"not a name": (MLP(), (torch.randn(1, 64),))}, "'not a name' must be a Python identifier"),
        ({"class": (MLP(), (torch.randn(1, 64),))}, "'class' must be a Python identifier"),
        ({"encode": MLP()}, "method 'encode': expected (module, example_inputs"),
        ({"encode": ("mlp", (torch.randn(1, 64),))}, "method 'encode': expected a torch.nn.Module"),
    ],
)
def test_bad_methods_are_named(methods, fragment):
    with pytest.raises(MethodError) as info:
        lower_methods(methods)
    assert fragment in str(info.value)


def test_state_shared_across_methods_is_rejected():
    """A buffer one method mutates and another reads would diverge in the .pte (each
    method has its own memory): rejected, naming both methods and the buffer."""

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(2))

    class Step(torch.nn.Module):
        def __init__(self, state):
            super().__init__()
            self.state = state

        def forward(self, x):
            self.state.count.add_(x)
            return self.state.count * 1

    class Read(torch.nn.Module):
        def __init__(self, state):
            super().__init__()
            self.state = state

        def forward(self, x):
            return self.state.count + x

    state = Counter()
    x = torch.ones(2)
    with pytest.raises(MethodError, match=r"method 'step' mutates buffer 'state.count', which method 'read'"):
        lower_methods({"step": (Step(state), (x,)), "read": (Read(state), (x,))})
