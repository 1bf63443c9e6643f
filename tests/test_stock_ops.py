"""Only ops the stock runtime has (lowering.stock_ops): the committed table against the
installed ExecuTorch, profiles, the check before emit writes bytes, stage 1's
decomposition of ops the portable set lacks (wav2vec2's weight norm), and verify loading
the kernel libraries a program needs (the "llm" set in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from lowering import export, lower
from lowering.export import PATH_META
from lowering.backend_ops import apply_fused_ops
from lowering.backends.reference import fused as reference_fused
from lowering.errors import LoweringError, MissingOperatorError
from lowering.program import copy_program
from lowering.stock_ops import (
    DEFAULT_PROFILE,
    check_program_ops,
    needed_sets,
    runtime_profile,
    stock_decomposition,
    stock_table,
)
from lowering.stock_ops.table import TABLE_PATH
from lowering.verify import program_operators, verify
from tests._interop import assert_all_close

ROOT = Path(__file__).resolve().parent.parent
aten = torch.ops.aten


# ------------------------------------------------------------------ the table


def test_committed_table_is_what_the_installed_executorch_registers():
    pytest.importorskip("executorch")
    from tests.tools.stock_ops import registered_table, table_text

    registered = registered_table()
    committed = TABLE_PATH.read_text(encoding="utf-8")
    assert committed == table_text(registered), "stale: run python tests/tools/stock_ops.py"
    data = json.loads(committed)
    assert all(names == sorted(names) for names in data["sets"].values())
    table = stock_table()
    assert table.executorch == data["executorch"]
    portable = table.sets["portable"]
    # portable kernels and the prim ops the emitter calls, always there
    assert {"aten::add.out", "aten::sym_size.int", "aten::copy_", "executorch_prim::add.Scalar",
            "executorch_prim::et_copy_index.tensor"} <= portable
    assert "aten::linalg_vector_norm.out" not in portable
    assert "quantized_decomposed::dequantize_per_tensor.out" in table.sets["quantized"]
    assert {"llama::custom_sdpa.out", "llama::update_cache.out"} <= table.sets["llm"]


def test_profiles_and_needed_sets():
    assert runtime_profile() == DEFAULT_PROFILE == ("portable", "quantized", "llm", "fused")
    assert runtime_profile(("llm",)) == ("portable", "llm")
    assert runtime_profile("portable") == ("portable",)
    with pytest.raises(LoweringError, match="runtime_ops: unknown op set 'cuda'"):
        runtime_profile(["portable", "cuda"])
    with pytest.raises(LoweringError, match="unknown op set 'xnn'"):
        lower(nn.ReLU(), (torch.randn(2),), runtime_ops=["xnn"])
    assert needed_sets(["aten::add.out", "quantized_decomposed::dequantize_per_tensor.out",
                        "llama::custom_sdpa.out", "lowerflow_reference::addmm_relu.out"]) == {"quantized", "llm"}
    assert needed_sets(["aten::add.out", "executorch_prim::add.Scalar"]) == set()
    check_program_ops(["aten::add.out", "llama::custom_sdpa.out"])
    with pytest.raises(MissingOperatorError, match=r"^operator llama::custom_sdpa.out \(node 'sdpa'\) needs the "
                       r"stock runtime's 'llm' kernels, which the profile leaves out \(runtime_ops: portable, "
                       r"quantized\)$"):
        check_program_ops({"aten::add.out": "add", "llama::custom_sdpa.out": "sdpa"}, ["quantized"])


# ------------------------------------------------------------------ decomposition in stage 1


class VectorNorm(nn.Module):
    def forward(self, v):
        return v / torch.linalg.vector_norm(v, 2, dim=(1, 2), keepdim=True)


def _targets(program) -> set:
    return {n.target for n in program.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("fast", [True, False])
def test_an_op_the_portable_set_lacks_is_decomposed_in_stage_1(fast, monkeypatch):
    monkeypatch.setattr(sys.modules["lowering.export"], "FAST_PATH", fast)
    assert stock_decomposition(aten.linalg_vector_norm.default) is not None
    assert stock_decomposition(aten.add.Tensor) is None  # a portable kernel
    assert stock_decomposition(aten.sort.default) is None  # no portable kernel, no decomposition
    model, inputs = VectorNorm(), (torch.randn(4, 3, 5),)
    program = export(model, inputs)
    assert program.graph_module.meta[PATH_META].startswith("fast" if fast else "slow")
    assert aten.linalg_vector_norm.default not in _targets(program)
    assert aten.pow.Tensor_Scalar in _targets(program)
    result = lower(program)
    assert "aten::linalg_vector_norm.out" not in program_operators(result.pte)
    report = verify(result.pte, model, inputs)
    assert report.ok and all(c.ok for c in report.checks), report.to_dict()


def _wav2vec2():
    """A tiny random HF wav2vec2 (hidden 32, 2 layers): its positional conv has weight norm."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        vocab_size=32)
    torch.manual_seed(0)
    return transformers.Wav2Vec2Model(config).eval(), (torch.randn(1, 400),)


@pytest.mark.parametrize("target", ["portable", "xnnpack"])
def test_hf_wav2vec2_runs_on_the_stock_executorch_runtime_equal_to_eager(target):
    pytest.importorskip("executorch")
    from lowering.backends.xnnpack import XnnpackPartitioner

    model, inputs = _wav2vec2()
    result = lower(model, inputs, partitioner=XnnpackPartitioner() if target == "xnnpack" else None)
    operators = program_operators(result.pte)
    assert "aten::linalg_vector_norm.out" not in operators
    assert ("aten::pow.Tensor_Scalar_out" in operators) == (target == "portable")  # xnnpack takes the pows
    report = verify(result.pte, model, inputs)
    checks = {c.runtime: c for c in report.checks}
    assert checks["executorch"].ok is True and checks["lowerflow"].ok is True, report.to_dict()


# ------------------------------------------------------------------ the check before emit


_LIBRARY = torch.library.Library("lowerflow_stock_test", "DEF")
_LIBRARY.define("mystery(Tensor x) -> Tensor")
_LIBRARY.define("mystery.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)")
_LIBRARY.impl("mystery", lambda x: x * 2 + 1, "CompositeExplicitAutograd")
_LIBRARY.impl("mystery.out", lambda x, *, out: out.copy_(x * 2 + 1), "CompositeExplicitAutograd")


class Mystery(nn.Module):
    def forward(self, x):
        return torch.ops.lowerflow_stock_test.mystery(torch.relu(x)) + 1


def test_an_op_without_kernel_or_decomposition_fails_with_one_line_naming_op_and_node(tmp_path, prefect_api):
    model, inputs = Mystery(), (torch.randn(3, 4),)
    expected = ("operator lowerflow_stock_test::mystery.out (node 'mystery') has no kernel in the stock "
                "ExecuTorch runtime and torch has no decomposition of it (runtime_ops: portable, quantized, "
                "llm, fused)")
    with pytest.raises(MissingOperatorError) as caught:
        lower(model, inputs)
    assert str(caught.value) == expected
    with pytest.raises(MissingOperatorError) as caught:
        lower({"encode": (model, inputs), "forward": (nn.ReLU(), inputs)})
    assert str(caught.value) == f"method 'encode': {expected}"

    # Through the CLI: one line, exit 1, no .pte written.
    (tmp_path / "mystery.py").write_text(textwrap.dedent("""
        import torch
        from tests.test_stock_ops import Mystery

        def model():
            return Mystery(), (torch.randn(3, 4),)
    """))
    out = tmp_path / "out.pte"
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "lower", f"{tmp_path / 'mystery.py'}:model", "-t", "portable",
         "-o", str(out), "--store", str(tmp_path / "store")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**_env(), "PREFECT_API_URL": prefect_api})  # the session's server: no ephemeral one (~10 s of CPU)
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("lowerflow: error:")]
    assert len(errors) == 1 and "operator lowerflow_stock_test::mystery.out (node 'mystery')" in errors[0], done.stderr
    assert not out.exists()


def test_backend_fused_ops_pass_the_default_profile_and_fail_a_stock_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    inputs = (torch.randn(3, 8),)
    fused = apply_fused_ops(copy_program(export(model, inputs)), reference_fused.FUSED_OPS)
    assert "lowerflow_reference::addmm_relu.out" in program_operators(lower(copy_program(fused)).pte)
    with pytest.raises(MissingOperatorError, match=r"^operator lowerflow_reference::addmm_relu.out \(node "
                       r"'addmm_relu'\) is a backend fused op no backend took; the stock runtime has no kernel "
                       r"for it \(runtime_ops: portable, quantized, llm\)$"):
        lower(fused, runtime_ops=("portable", "quantized", "llm"))
    plain = lower(export(model, inputs), runtime_ops=("portable",))  # nothing outside the portable set
    assert_all_close(verify_outputs(plain.pte, inputs), [model(*inputs).detach()])


def verify_outputs(pte: bytes, inputs) -> list[torch.Tensor]:
    from lowering.runtime import load

    return load(pte).run("forward", list(inputs))


# ------------------------------------------------------------------ the llm set


_LLM_PROGRAM = """
import importlib, sys, torch
importlib.import_module("executorch.extension.llm.custom_ops.custom_ops")  # before anything defines llama::*
from lowering import lower
from lowering.errors import MissingOperatorError
from lowering.verify import program_operators
from lowering.verify_executorch import executorch_runner


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.ops.llama.custom_sdpa(q, k, v, 0, None, 0.0, True, None) * 2


torch.manual_seed(0)
inputs = [torch.randn(1, 4, 2, 8) for _ in range(3)]
pte = lower(Attention(), tuple(inputs)).pte
assert program_operators(pte)[0] == "llama::custom_sdpa.out", program_operators(pte)
try:
    lower(Attention(), tuple(inputs), runtime_ops=("portable",))
    raise SystemExit("the portable profile let llama::custom_sdpa.out through")
except MissingOperatorError as exc:
    assert "needs the stock runtime's 'llm' kernels" in str(exc), exc
here = executorch_runner()(pte, inputs, 1)[0][0]  # the library is loaded: in this process
expected = Attention()(*inputs)
assert torch.allclose(here, expected, atol=1e-5), (here - expected).abs().max()
open(sys.argv[1], "wb").write(pte)
torch.save({"inputs": inputs, "expected": expected}, sys.argv[2])
"""


def test_a_program_of_llama_ops_runs_on_executorch_with_the_custom_ops_library_in_a_fresh_interpreter(
        tmp_path, monkeypatch):
    """The program is made in a child that loaded ExecuTorch's custom-ops library first; this
    process never loads it (lowerflow's own llama ops may be defined here: loading it would
    abort), so verify's runner runs the program in a fresh interpreter: ONE for every job of
    a batch (each on a program loaded for it alone; a job's error is its own)."""
    pytest.importorskip("executorch")
    from lowering.verify_executorch import executorch_runner

    pte_path, data_path = tmp_path / "sdpa.pte", tmp_path / "data.pt"
    done = subprocess.run([sys.executable, "-c", _LLM_PROGRAM, str(pte_path), str(data_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    pte, data = pte_path.read_bytes(), torch.load(data_path)
    assert needed_sets(program_operators(pte)) == {"llm"}
    assert "executorch.extension.llm.custom_ops.custom_ops" not in sys.modules
    started, run = [], subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: started.append(args) or run(*args, **kwargs))
    inputs = data["inputs"]
    first, again, missing = executorch_runner().batch(pte, [
        (["forward"], [("forward", inputs)] * 2), (["forward"], [("forward", inputs)]), (["decode"], [("decode", inputs)])])
    assert len(started) == 1
    assert len(first) == 2 and len(again) == 1
    assert_all_close(first[0], [data["expected"]])
    assert_all_close(again[0], first[0])
    assert isinstance(missing, RuntimeError) and str(missing).startswith("KeyError: "), missing
    assert "program has no method 'decode'; methods: ['forward']" in str(missing)
    assert "executorch.extension.llm.custom_ops.custom_ops" not in sys.modules


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}
