"""Several methods per program (issue 10): one .pte with ``encode`` and ``decode``.

The library (lowering.lower_methods), ExecuTorch's runtime loading each method by
name from the one .pte, shared weights and equal delegate payloads stored once,
the model spec form ``{method: (module, inputs)}``, the cached flow and the CLI.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.models import MLP, Decode, Seq2Seq, encoder_decoder, mlp
from lowering import LoweringError, MethodError, lower, lower_methods
from lowering.pte import deserialize
from lowering.pte.format import decode_string
from lowering.runtime import load
from lowering.targets import PORTABLE, partitioner_for
from lowering.verify import verify_methods

from ._interop import assert_all_close, flatten
from tests._lowering import executions_during as _executions

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


# --- shared mutable buffers (a KV cache prefill writes and decode reads) ---------------------------

PROMPT = torch.tensor([[3, 17, 42, 5, 9]])
DECODE_STEPS = [(torch.tensor([[7]]), torch.tensor([5])), (torch.tensor([[1]]), torch.tensor([6])),
                (torch.tensor([[33]]), torch.tensor([7]))]
KV_SEQUENCE = [("prefill", (PROMPT,))] + [("decode", step) for step in DECODE_STEPS]


@pytest.fixture(scope="module")
def kv_lowered():
    """target -> (MethodsLowerResult with shared KV cache, the eager outputs of KV_SEQUENCE)."""
    from examples.models import kv_cache_decoder

    eager = kv_cache_decoder()
    expected = [_eager(eager[name][0], inputs) for name, inputs in KV_SEQUENCE]
    out = {}
    for target in (PORTABLE, "xnnpack"):
        result = lower_methods(kv_cache_decoder(), partitioner=_partitioner(target), share_mutable_buffers=True)
        out[target] = (result, expected)
    return out


@pytest.mark.parametrize("target", (PORTABLE, "xnnpack"))
def test_executorch_decode_reads_the_kv_cache_prefill_wrote(kv_lowered, target):
    """ExecuTorch's runtime: load both methods of the one .pte, prefill the prompt,
    then decode three tokens: every output equals the eager model run the same way."""
    pytest.importorskip("executorch")
    from executorch.runtime import Runtime

    result, expected = kv_lowered[target]
    program = Runtime.get().load_program(result.pte)
    methods = {name: program.load_method(name) for name in ("prefill", "decode")}
    for (name, inputs), want in zip(KV_SEQUENCE, expected):
        assert_all_close(list(methods[name].execute(list(inputs))), want)
    # The decode outputs depend on the cache: decode alone on a fresh program differs.
    fresh = Runtime.get().load_program(result.pte).load_method("decode")
    assert not torch.allclose(fresh.execute(list(DECODE_STEPS[0]))[0], expected[1][0], atol=1e-3)


@pytest.mark.parametrize("target", (PORTABLE, "xnnpack"))
def test_our_executor_shares_state_between_methods_of_one_program(kv_lowered, target):
    result, expected = kv_lowered[target]
    program = load(result.pte).load_all()
    for (name, inputs), want in zip(KV_SEQUENCE, expected):
        assert_all_close(program.run(name, list(inputs)), want)
    fresh = load(result.pte)
    assert not torch.allclose(fresh.run("decode", list(DECODE_STEPS[0]))[0], expected[1][0], atol=1e-3)


def test_shared_buffers_have_one_place_in_every_method(kv_lowered):
    """Each cache buffer: mem_id 2, the same offset in both methods, its initial value
    stored once; the activations stay in each method's own arena 1."""
    result, _ = kv_lowered["xnnpack"]
    places = {}
    for name, plan in result.memory_plans.items():
        program = result.exported_programs[name]
        buffers = {s.arg.name: s.target for s in program.graph_signature.input_specs if s.target in ("model.k_cache", "model.v_cache")}
        places[name] = {fqn: (plan.allocations[node].mem_id, plan.allocations[node].offset) for node, fqn in buffers.items()}
        assert plan.arena_sizes[2] == 2 * 16 * 32 * 4
        assert all(a.mem_id == 1 for key, a in plan.allocations.items() if key not in buffers)
    assert places["prefill"] == places["decode"] == {"model.k_cache": (2, 0), "model.v_cache": (2, 2048)}
    pte = deserialize(result.pte)
    assert [list(p.nonConstBufferSizes)[2] for p in pte.program.executionPlan] == [4096, 4096]
    assert len(pte.mutable_data) == 2  # b"" and the zeros both caches start from


def _counter_methods(read_shape=(2,), read_value=0.0):
    """``step`` adds to a counter buffer, ``read`` only reads it (under the same name)."""

    class Counter(torch.nn.Module):
        def __init__(self, shape=(2,), value=0.0):
            super().__init__()
            self.register_buffer("count", torch.full(shape, value))

    class Step(torch.nn.Module):
        def __init__(self, state):
            super().__init__()
            self.state = state

        def forward(self, x):
            self.state.count.add_(x)
            return self.state.count * 1

    class Read(Step):
        def forward(self, x):
            return self.state.count + x

    state = Counter()
    other = state if (read_shape, read_value) == ((2,), 0.0) else Counter(read_shape, read_value)
    return {"step": (Step(state), (torch.ones(2),)), "read": (Read(other), (torch.ones(2),))}


@pytest.mark.parametrize("target", [PORTABLE, "xnnpack"])
def test_a_method_that_only_reads_shared_state_sees_the_writes(target):
    """``read`` does not mutate ``state.count`` but still reads it from the shared arena: on
    XNNPACK the buffer is a delegate input, never constant data of ``read``'s delegate
    (which would hold the initial zeros)."""
    pytest.importorskip("executorch")
    from executorch.runtime import Runtime

    result = lower(_counter_methods(), share_mutable_buffers=True, partitioner=_partitioner(target))
    assert result.memory_plans["read"].allocations["b_state_count"].mem_id == 2
    if target == "xnnpack":
        plans = deserialize(result.pte).program.executionPlan
        assert all(len(plan.delegates or []) == 1 for plan in plans)  # each method's add delegated
    x = torch.ones(2)
    sequence = ["step", "read", "step", "read"]
    want = [torch.tensor([1.0, 1.0]), torch.tensor([2.0, 2.0]), torch.tensor([2.0, 2.0]), torch.tensor([3.0, 3.0])]
    program = Runtime.get().load_program(result.pte)
    et = {name: program.load_method(name) for name in ("read", "step")}
    ours = load(result.pte).load_all()
    for name, expected in zip(sequence, want):
        torch.testing.assert_close(et[name].execute([x])[0], expected)
        torch.testing.assert_close(ours.run(name, [x])[0], expected)


def test_a_method_keeps_its_own_state_while_another_method_runs():
    """Not shared: ``step``'s counter is its own, yet ExecuTorch's runtime lets the
    methods of a program share arena 1 (so does ours), so the state lives in a
    region of arena 2 no other method's activations touch."""
    pytest.importorskip("executorch")
    from executorch.runtime import Runtime

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(64))

        def forward(self, x):
            self.count.add_(x)
            return self.count * 1

    class Other(torch.nn.Module):
        def forward(self, x):
            return (x * 3 + 1) * 2 - 5

    x = torch.ones(64)
    result = lower_methods({"step": (Step(), (x,)), "other": (Other(), (x,))})
    plan = result.memory_plans["step"]
    assert plan.allocations["b_count"].mem_id == 2 and plan.arena_sizes[2] == result.memory_plans["other"].arena_sizes[2]
    program = Runtime.get().load_program(result.pte)
    et = {name: program.load_method(name) for name in ("other", "step")}
    ours = load(result.pte).load_all()
    for runtime in (lambda name, inputs: et[name].execute(inputs), ours.run):
        outputs = [runtime(name, [x * scale])[0] for name, scale in (("step", 1), ("other", 7), ("step", 1))]
        torch.testing.assert_close(outputs[0], torch.full((64,), 1.0))
        torch.testing.assert_close(outputs[1], (x * 7 * 3 + 1) * 2 - 5)
        torch.testing.assert_close(outputs[2], torch.full((64,), 2.0))  # was 40.0 with the counter in arena 1


@pytest.mark.parametrize(
    ("read_shape", "read_value", "fragment"),
    [((2, 1), 0.0, r"shared buffer 'state.count' is torch.float32\[2, 1\] in method 'read' but torch.float32\[2\] in method 'step'"),
     ((2,), 1.0, r"shared buffer 'state.count' has a different initial value in method 'read' than in method 'step'")],
)
def test_a_shared_buffer_must_be_the_same_in_every_method(read_shape, read_value, fragment):
    with pytest.raises(MethodError, match=fragment):
        lower_methods(_counter_methods(read_shape, read_value), share_mutable_buffers=True)


def test_shared_state_without_the_option_points_at_it():
    from examples.models import kv_cache_decoder

    with pytest.raises(MethodError, match=r"method 'decode' mutates buffer 'model.k_cache'.*share_mutable_buffers=True"):
        lower_methods(kv_cache_decoder())
    with pytest.raises(LoweringError, match="share_mutable_buffers applies to a dict of methods"):
        lower(*mlp(), share_mutable_buffers=True)


def test_a_shared_buffer_under_two_names_is_rejected():
    """Shared state is matched by buffer name: one tensor reached as two names is an error."""
    from examples.models import DecodeStep, KVCacheDecoder, Prefill

    model = KVCacheDecoder().eval()

    class Renamed(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner = model

        def forward(self, token, pos):
            return self.inner.step(token, pos)

    methods = {"prefill": (Prefill(model), (PROMPT,)), "decode": (Renamed(model), DECODE_STEPS[0])}
    with pytest.raises(MethodError, match=r"uses buffer 'inner.k_cache' of method 'decode' under another name, 'model.k_cache'"):
        lower_methods(methods, share_mutable_buffers=True)
    assert DecodeStep  # the wrapper that keeps the name (used by kv_cache_decoder)


def test_verify_call_sequence_checks_state_across_methods(kv_lowered):
    """The sequence check passes on the shared-cache program, and fails against eager
    modules that do not share the cache (so it can fail)."""
    from examples.models import kv_cache_decoder
    from lowering.verify import round_robin, verify_call_sequence

    result, _ = kv_lowered[PORTABLE]
    methods = kv_cache_decoder()
    assert [name for name, _ in round_robin(methods)] == ["decode", "prefill", "decode", "prefill"]
    report = verify_call_sequence(result.pte, methods)
    assert report.ok and {c.runtime for c in report.checks if c.ok} >= {"lowerflow"}, report
    unshared = {"prefill": kv_cache_decoder()["prefill"], "decode": kv_cache_decoder()["decode"]}
    report = verify_call_sequence(result.pte, unshared)
    assert not report.ok and all(c.ok is False for c in report.checks), report


# --- model specs ---------------------------------------------------------------------------------


def _spec_file(tmp_path: Path, body: str, name: str = "seq.py") -> str:
    path = tmp_path / name
    path.write_text("import torch\nfrom examples.models import Decode, Encode, Seq2Seq, MLP\n\n" + body)
    return str(path)


def test_spec_of_several_methods_loads_each_with_its_own_fingerprint():
    from tasks.model_spec import ModelSpec, load_methods, load_model

    spec = ModelSpec.parse(f"{MODELS}:encoder_decoder")
    loaded = load_model(spec)
    assert loaded.module is None and list(loaded.methods) == ["decode", "encode"]
    digests = {name: m.fingerprint.digest for name, m in loaded.methods.items()}
    assert len(set(digests.values())) == 2 and loaded.fingerprint.digest not in digests.values()
    assert loaded.fingerprint.to_json()["methods"]["encode"]["digest"] == digests["encode"]
    assert load_model(spec).fingerprint.digest == loaded.fingerprint.digest
    assert list(load_methods(ModelSpec.parse(f"{MODELS}:mlp"))) == ["forward"]


@pytest.mark.parametrize(
    "returns, fragment",
    [
        ("{}", "empty dict of methods"),
        ("{'bad name': (MLP(), (torch.randn(1, 64),))}", "method name 'bad name' must be a Python identifier"),
        ("{'encode': MLP()}", "method 'encode': expected (nn.Module, example_inputs[, dynamic_shapes]), got MLP"),
        ("{'encode': (MLP(), (torch.randn(1, 64),), {'x': {0: torch.export.Dim('b')}})}",
         "method 'encode': "),
    ],
)
def test_bad_method_entries_name_the_spec_and_method(tmp_path, returns, fragment):
    from tasks.model_spec import ModelSpec, ModelSpecError, load_model

    path = _spec_file(tmp_path, f"def factory():\n    return {returns}\n")
    with pytest.raises(ModelSpecError) as info:
        load_model(ModelSpec.parse(f"{path}:factory"))
    assert f"model spec '{path}:factory'" in str(info.value) and fragment in str(info.value)


def test_method_set_changes_the_fingerprint(tmp_path):
    from tasks.fingerprint import Fingerprint
    from tasks.model_spec import ModelSpec, load_model

    two = _spec_file(tmp_path, SEQ_FACTORY.format(methods="{'encode': enc, 'decode': dec}"), "two.py")
    renamed = _spec_file(tmp_path, SEQ_FACTORY.format(methods="{'encode': enc, 'generate': dec}"), "renamed.py")
    a, b = (load_model(ModelSpec.parse(f"{p}:factory")) for p in (two, renamed))
    assert a.fingerprint.digest != b.fingerprint.digest
    assert "methods" in Fingerprint.changed(a.fingerprint.to_json(), b.fingerprint.to_json())
    decode, generate = a.methods["decode"].fingerprint, b.methods["generate"].fingerprint
    assert Fingerprint.changed(decode.to_json(), generate.to_json()) == ["code"]  # the factory file only


SEQ_FACTORY = """
def factory():
    from examples.models import encoder_decoder
    methods = encoder_decoder()
    enc, dec = methods["encode"], methods["decode"]
    return {methods}
"""


# --- the cached flow and the CLI ------------------------------------------------------------------




@pytest.mark.usefixtures("fresh_stages")
def test_flow_lowers_every_method_into_one_pte_per_target(tmp_path, lowered):
    from flows.lower_model import lower_model
    from tasks.store import ArtifactStore

    store = tmp_path / "store"
    model = f"{MODELS}:encoder_decoder"
    cold, ran = _executions(lower_model, model=model, targets=list(TARGETS), store=str(store))
    assert cold["methods"] == ["decode", "encode"]
    assert ran["export"] == 2 and ran["emit_methods"] == 3 and ran["memory_plan"] == 6 and ran["verify"] == 6
    assert ran["emit"] == 0
    published = ArtifactStore(str(store)).get_json("encoder_decoder/manifest.json")
    assert published["methods"] == ["decode", "encode"]
    for target in TARGETS:
        entry = published["targets"][target]
        assert entry["ok"], entry["error"]
        assert set(entry["methods"]) == {"decode", "encode"}
        for method, part in entry["methods"].items():
            assert part["memory_plan"]["arena_bytes"] > 0 and part["memory_plan"]["ref"]
            assert part["verify"]["ok"] is True
            assert {r["stage"] for r in entry["stages"] if r.get("method") == method} >= {
                "export", "memory_plan", "verify"}
        assert entry["memory_plan"]["arena_bytes"] == sum(
            p["memory_plan"]["arena_bytes"] for p in entry["methods"].values())
        assert {c["method"] for c in entry["verify"]["checks"]} == {"decode", "encode"}
        pte = (store / "outputs" / "encoder_decoder" / f"{target}.pte").read_bytes()
        assert pte == lowered[target][0].pte  # the flow's program is the library's
        assert load(pte).method_names == ["decode", "encode"]
    assert published["targets"]["xnnpack"]["delegation"]["partitions"] >= 2

    from flows.reports import model_report_markdown

    report = model_report_markdown(published)
    assert "| encode |" in report and "| decode |" in report and "executorch (decode)" in report

    warm, ran = _executions(lower_model, model=model, targets=list(TARGETS), store=str(store))
    assert sum(ran.values()) == 0, dict(ran)
    assert all(r["cached"] for entry in warm["targets"].values() for r in entry["stages"])


@pytest.mark.usefixtures("fresh_stages")
def test_fleet_and_its_dry_run_take_a_model_of_several_methods(tmp_path):
    from flows.lower_fleet import lower_fleet, plan_fleet

    manifest = {"store": str(tmp_path / "store"), "defaults": {"targets": ["portable", "reference"]},
                "models": [{"name": "seq", "model": f"{MODELS}:encoder_decoder"}, {"model": f"{MODELS}:mlp"}]}
    cold = plan_fleet(manifest)
    seq = [(r["target"], r["stage"]) for r in cold if r["model"] == "seq"]
    assert ("portable", "emit_methods") in seq and not any(r["cached"] for r in cold)
    summary = lower_fleet(manifest)
    assert summary["ok"] and summary["models"]["seq"]["methods"] == ["decode", "encode"]
    assert all(r["cached"] for r in plan_fleet(manifest))


@pytest.mark.usefixtures("fresh_stages")
def test_changing_the_method_set_re_emits_and_never_hits_a_stale_program(tmp_path):
    from flows.lower_model import lower_model

    store = str(tmp_path / "store")
    factory = tmp_path / "seq.py"

    def lower_with(methods):
        factory.write_text(SEQ_FACTORY.format(methods=methods))
        return _executions(lower_model, model=f"{factory}:factory", targets=["reference"], store=store, name="seq")

    first, ran = lower_with("{'encode': enc, 'decode': dec}")
    assert first["targets"]["reference"]["ok"] and ran["emit_methods"] == 1
    renamed, ran = lower_with("{'encode': enc, 'generate': dec}")
    entry = renamed["targets"]["reference"]
    assert entry["ok"], entry["error"]
    # The factory file changed, so each method is exported again, to the same program:
    # every stage keyed on a method's program is cached; the one program is emitted anew.
    assert ran["export"] == 2 and ran["partition"] == 0 and ran["preprocess"] == 0 and ran["memory_plan"] == 0
    assert ran["emit_methods"] == 1 and ran["verify"] == 2
    assert "methods" in renamed["changed"]
    pte = (tmp_path / "store" / "outputs" / "seq" / "reference.pte").read_bytes()
    assert load(pte).method_names == ["encode", "generate"]
    fewer, ran = lower_with("{'encode': enc}")
    assert fewer["targets"]["reference"]["ok"] and ran["emit_methods"] == 1
    pte = (tmp_path / "store" / "outputs" / "seq" / "reference.pte").read_bytes()
    assert load(pte).method_names == ["encode"]
    back, ran = lower_with("{'encode': enc, 'decode': dec}")
    assert sum(ran.values()) == 0  # the first method set again: every stage cached
    assert back["targets"]["reference"]["pte"]["sha256"] == first["targets"]["reference"]["pte"]["sha256"]


def test_cli_lowers_and_verifies_every_method(tmp_path, lowered, prefect_api):
    from .test_cli import error_lines, lowerflow

    out = tmp_path / "out.pte"
    spec = "examples/models.py:encoder_decoder"
    home = tmp_path / "prefect-home"
    result = lowerflow("lower", spec, "-t", "xnnpack", "-o", str(out), "--store", str(tmp_path / "store"), home=home,
                       api=prefect_api)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == lowered["xnnpack"][0].pte
    assert "emit_methods" in result.stdout and "memory_plan[decode]" in result.stdout
    checked = lowerflow("verify", str(out), "--model", spec, home=home)
    assert checked.returncode == 0, checked.stderr
    lines = checked.stdout.splitlines()
    assert {line.split()[0] for line in lines} == {"decode", "encode"}
    assert all(line.split()[2] in ("ok", "skipped") for line in lines)
    assert not error_lines(checked.stderr)
    single = tmp_path / "mlp.pte"
    single.write_bytes(lower(*mlp()).pte)
    wrong = lowerflow("verify", str(single), "--model", spec, home=home)
    assert wrong.returncode == 1 and "does not match" in error_lines(wrong.stderr)[0]


@pytest.mark.usefixtures("fresh_stages")
def test_a_failing_method_names_itself_and_publishes_nothing(tmp_path):
    from flows.lower_model import ModelLoweringFailed, lower_model

    factory = tmp_path / "broken.py"
    factory.write_text(
        "import torch\nfrom examples.models import encoder_decoder\n\n"
        "class Bad(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x * 2 if x.sum() > 0 else x\n\n"  # Python control flow on data: export fails
        "def factory():\n"
        "    return {**encoder_decoder(), 'bad': (Bad(), (torch.ones(3),))}\n"
    )
    store = tmp_path / "store"
    with pytest.raises(ModelLoweringFailed) as info:
        lower_model(model=f"{factory}:factory", targets=["portable"], store=str(store), name="broken")
    entry = info.value.manifest["targets"]["portable"]
    assert not entry["ok"] and "[bad]" in entry["error"]
    assert not (store / "outputs" / "broken" / "portable.pte").exists()


@pytest.mark.usefixtures("fresh_stages")
def test_flow_rejects_state_shared_across_methods(tmp_path):
    from flows.lower_model import ModelLoweringFailed, lower_model

    factory = tmp_path / "shared_state.py"
    factory.write_text(
        "import torch\n\n"
        "class Counter(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.register_buffer('count', torch.zeros(2))\n\n"
        "class Step(torch.nn.Module):\n"
        "    def __init__(self, state):\n"
        "        super().__init__()\n"
        "        self.state = state\n"
        "    def forward(self, x):\n"
        "        self.state.count.add_(x)\n"
        "        return self.state.count * 1\n\n"
        "class Read(Step):\n"
        "    def forward(self, x):\n"
        "        return self.state.count + x\n\n"
        "def factory():\n"
        "    state = Counter()\n"
        "    return {'step': (Step(state), (torch.ones(2),)), 'read': (Read(state), (torch.ones(2),))}\n"
    )
    store = tmp_path / "store"
    with pytest.raises(ModelLoweringFailed) as info:
        lower_model(model=f"{factory}:factory", targets=["portable"], store=str(store), name="shared")
    error = info.value.manifest["targets"]["portable"]["error"]
    assert error.startswith("check_methods: MethodError: method 'step' mutates buffer 'state.count'"), error
    assert not (store / "outputs" / "shared" / "portable.pte").exists()


@pytest.mark.usefixtures("fresh_stages")
def test_flow_keeps_state_another_method_writes_out_of_a_delegate(tmp_path):
    """Through the flow (partition stage ``shared_state``), as lower_methods: ``read``'s
    XNNPACK delegate takes the shared counter as an input; verify_sequence runs step/read
    in turn on ExecuTorch's runtime and ours."""
    pytest.importorskip("executorch")
    from flows.lower_model import lower_model

    factory = tmp_path / "shared_counter.py"
    factory.write_text(
        "from tests.test_methods import _counter_methods\n\n"
        "def factory():\n"
        "    return _counter_methods()\n\n"
        "factory.share_mutable_buffers = True\n"
    )
    store = tmp_path / "store"
    cold, ran = _executions(lower_model, model=f"{factory}:factory", targets=["xnnpack"], store=str(store))
    entry = cold["targets"]["xnnpack"]
    assert entry["ok"], entry["error"]
    assert entry["pte"]["sha256"] == hashlib.sha256(
        lower(_counter_methods(), share_mutable_buffers=True, partitioner=_partitioner("xnnpack")).pte).hexdigest()
    sequence = entry["verify_sequence"]
    assert sequence["ok"] is True and {c["runtime"] for c in sequence["checks"] if c["ok"]} == {"lowerflow", "executorch"}


@pytest.mark.usefixtures("fresh_stages")
def test_flow_lowers_methods_sharing_a_kv_cache(tmp_path, kv_lowered):
    """``kv_cache_decoder.share_mutable_buffers = True``: the flow plans the shared cache,
    emits the same bytes as lower_methods, and verify runs the methods in sequence on
    one program in both runtimes; a warm run runs nothing."""
    pytest.importorskip("executorch")
    from flows.lower_model import lower_model
    from tasks.store import ArtifactStore

    store = tmp_path / "store"
    model = f"{MODELS}:kv_cache_decoder"
    cold, ran = _executions(lower_model, model=model, targets=[PORTABLE, "xnnpack"], store=str(store))
    assert cold["share_mutable_buffers"] is True
    assert ran["memory_plan"] == 4 and ran["verify"] == 4 and ran["verify_sequence"] == 2
    for target in (PORTABLE, "xnnpack"):
        entry = cold["targets"][target]
        assert entry["ok"], entry["error"]
        assert entry["pte"]["sha256"] == hashlib.sha256(kv_lowered[target][0].pte).hexdigest()  # = lower_methods
        sequence = entry["verify_sequence"]
        assert sequence["ok"] is True and {c["runtime"] for c in sequence["checks"] if c["ok"]} == {"lowerflow", "executorch"}
        assert {c["method"] for c in entry["verify"]["checks"]} == {"decode", "prefill", "(sequence)"}
        plans = entry["methods"]
        assert plans["prefill"]["memory_plan"]["shared_state_bytes"] == 4096
        assert entry["memory_plan"]["arena_bytes"] == sum(p["memory_plan"]["arena_bytes"] for p in plans.values()) - 4096
    published = ArtifactStore(str(store)).get_json("kv_cache_decoder/manifest.json")
    assert published["share_mutable_buffers"] is True
    from flows.reports import model_report_markdown

    report = model_report_markdown(published)
    assert "| prefill |" in report and "| decode |" in report and "executorch ((sequence))" in report, report
    warm, ran = _executions(lower_model, model=model, targets=[PORTABLE, "xnnpack"], store=str(store))
    assert sum(ran.values()) == 0, dict(ran)


@pytest.mark.usefixtures("fresh_stages")
def test_flow_prefill_of_any_prompt_length_and_decode_share_a_kv_cache(tmp_path):
    """The LLM case: ``prefill`` with a dynamic prompt length (a third element per method)
    and ``decode`` over one shared KV cache, through the flow; ExecuTorch's runtime runs
    prompts of 1, 4 and 8 tokens, each followed by decode steps, against eager."""
    pytest.importorskip("executorch")
    import copy

    from executorch.runtime import Runtime

    from examples.models import kv_cache_decoder
    from flows.lower_model import lower_model

    path = tmp_path / "llm.py"
    path.write_text(
        "import torch\nfrom examples.models import kv_cache_decoder\n\n"
        "def factory():\n"
        "    methods = kv_cache_decoder()\n"
        "    prefill, inputs = methods['prefill']\n"
        "    seq = torch.export.Dim('seq', min=1, max=8)\n"
        "    return {**methods, 'prefill': (prefill, inputs, {'tokens': {1: seq}})}\n\n"
        "factory.share_mutable_buffers = True\n"
    )
    store = tmp_path / "store"
    manifest, _ = _executions(
        lower_model, model=f"{path}:factory", targets=[PORTABLE, "xnnpack"], store=str(store), name="llm"
    )
    for target in (PORTABLE, "xnnpack"):
        entry = manifest["targets"][target]
        assert entry["ok"], entry["error"]
        sizes = {c.get("inputs") for c in entry["verify"]["checks"] if c.get("method") == "prefill" and c["ok"]}
        assert {"seq=1", "seq=8"} <= sizes, entry["verify"]
        pte = (store / "outputs" / "llm" / f"{target}.pte").read_bytes()
        for length in (1, 4, 8):
            program = Runtime.get().load_program(pte)  # held: it owns the bytes the runtime reads
            prefill, decode = program.load_method("prefill"), program.load_method("decode")
            eager = copy.deepcopy(kv_cache_decoder())
            tokens = torch.arange(length).reshape(1, length) % 64
            assert_all_close(list(prefill.execute([tokens])), flatten(eager["prefill"][0](tokens)), atol=1e-4)
            for step in range(2):
                token, pos = torch.tensor([[7 + step]]), torch.tensor([length + step])
                assert_all_close(list(decode.execute([token, pos])), flatten(eager["decode"][0](token, pos)), atol=1e-4)


# --------------------------------------------------------------------------- constant methods

CONSTANTS = {"get_max_seq_len": 128, "use_kv_cache": True, "get_eos_ids": [2, 7], "get_head_dim": 16.0,
             "get_name": "tiny"}


def test_constant_methods_are_emitted_as_executorch_emits_them():
    """Plain values among the methods are constant methods: each plan equals the one ExecuTorch's
    ``constant_methods`` emits (values, outputs, container metadata), and both runtimes return them."""
    pytest.importorskip("executorch.exir")
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    model, inputs = mlp()
    ours = lower({"forward": (model, inputs), **CONSTANTS}).pte
    theirs = to_edge(torch.export.export(model, inputs), constant_methods=CONSTANTS).to_executorch().buffer
    plans = {decode_string(p.name): p for p in deserialize(ours).program.executionPlan}
    reference = {decode_string(p.name): p for p in deserialize(theirs).program.executionPlan}
    assert list(plans) == ["forward", *sorted(CONSTANTS)]
    for name in CONSTANTS:
        mine, et = plans[name], reference[name]
        assert [(v.valType, vars(v.val)) for v in mine.values] == [(v.valType, vars(v.val)) for v in et.values]
        for field in ("inputs", "outputs", "nonConstBufferSizes"):
            assert list(getattr(mine, field)) == list(getattr(et, field)), (name, field)
        assert vars(mine.containerMetaType) == vars(et.containerMetaType)
    program, executor = Runtime.get().load_program(ours), load(ours)
    for name, value in CONSTANTS.items():
        expected = value if isinstance(value, list) else [value]
        assert program.load_method(name).execute([]) == expected
        assert executor.run(name, []) == expected


def test_a_constant_method_named_like_a_method_is_rejected():
    model, inputs = mlp()
    with pytest.raises(MethodError, match=r"\['forward'\] are both a method and a constant method"):
        from lowering.methods import build_methods_pte

        program = lower(model, inputs)
        build_methods_pte({"forward": (program.exported_program, program.memory_plan)}, {"forward": 1})
