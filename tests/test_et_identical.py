"""Proof without the devices: a partition lowerflow compiles with ExecuTorch's own backend
is the one ExecuTorch's ``to_edge_transform_and_lower`` compiles, with the same partitioner
and options — byte-identical delegate payloads and named data (Vulkan), or, where not
identical, the test says why and the program loads in ExecuTorch's parser.  Core ML's payload is
ExecuTorch's made deterministic (:mod:`lowering.backends.executorch.coreml`)."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowering
from examples.models import cnn, mlp
from lowering.backends.executorch.adapter import named_data_of
from lowering.backends.executorch.coreml import deterministic_payload
from lowering.backends.executorch.options import check_options, make_et_partitioner
from lowering.backends.executorch.targets import TARGETS
from lowering.errors import BackendError
from lowering.targets import partitioner_for
from lowering.to_backend import to_backend

pytest.importorskip("executorch")


def payloads(program) -> list[tuple[str, bytes, dict]]:
    """(backend id, processed bytes, named data) of every lowered module, in graph order."""
    gm = program.graph_module
    found = []
    for node in program.graph.nodes:
        module = getattr(gm, node.target, None) if node.op == "get_attr" else None
        if module is not None and hasattr(module, "processed_bytes"):
            if hasattr(module, "named_data_store_output"):  # ExecuTorch's LoweredBackendModule
                named = named_data_of(module.named_data_store_output)
            else:
                named = module.named_data
            found.append((module.backend_id, bytes(module.processed_bytes), dict(named)))
    return found


def lowerflow_payloads(model, inputs, target: str, options: dict | None = None):
    # lowerflow's export without constant folding: ExecuTorch's graph keeps permute_copy(weight) too;
    # the ops the partitioner keeps whole stay whole, as lowering.lower does.
    partitioner = partitioner_for(target, options)
    program = lowering.export(model, inputs, fold_constants=False, keep=partitioner.ops_to_not_decompose)
    return payloads(to_backend(program, partitioner))


def executorch_payloads(model, inputs, target: str, options: dict | None = None):
    from executorch.exir import to_edge_transform_and_lower

    et = make_et_partitioner(TARGETS[target], check_options(TARGETS[target], options))
    return payloads(to_edge_transform_and_lower(torch.export.export(model, inputs), partitioner=[et]).exported_program())


@pytest.mark.parametrize("factory", [mlp, cnn], ids=["mlp", "cnn_batchnorm"])
def test_vulkan_payloads_and_named_data_are_executorchs(factory):
    model, inputs = factory()
    ours, theirs = lowerflow_payloads(model, inputs, "vulkan"), executorch_payloads(model, inputs, "vulkan")
    assert len(ours) == len(theirs) == 1
    (backend, payload, named), (_, their_payload, their_named) = ours[0], theirs[0]
    assert backend == "VulkanBackend" and payload[4:8] == b"VH00"
    assert payload == their_payload
    assert named == their_named and sum(map(len, named.values())) > 0


@pytest.fixture(scope="module")
def coreml_mlp():
    """The MLP lowered for Core ML by lowerflow (twice) and by ExecuTorch: each compile is seconds."""
    model, inputs = mlp()
    first = lowering.lower(model, inputs, partitioner=partitioner_for("coreml"))
    again = lowering.lower(model, inputs, partitioner=partitioner_for("coreml"))
    return first, again, executorch_payloads(model, inputs, "coreml")


def test_coreml_payload_is_executorchs_made_deterministic(coreml_mlp):
    from executorch.runtime import Runtime

    first, again, theirs = coreml_mlp
    (backend, ours, our_named), = payloads(first.exported_program)
    (_, their_payload, their_named), = theirs
    assert backend == "CoreMLBackend" and our_named == their_named == {}
    # ExecuTorch's own payload is not deterministic (a uuid4 identifier, random manifest ids, protobuf
    # maps in a per-process order, the day's date); lowerflow's is ExecuTorch's made canonical
    # (lowering.backends.executorch.coreml): the same bytes once ExecuTorch's gets the same treatment.
    # Kept whole for Core ML, as ExecuTorch keeps them (its partitioner's ops_to_not_decompose): linear.
    assert ours == deterministic_payload(their_payload) != their_payload
    assert b"aten_linear_default" in ours and b"aten_addmm_default" not in ours
    assert deterministic_payload(ours) == ours
    assert payloads(again.exported_program)[0][1] == ours and again.pte == first.pte
    assert Runtime.get().load_program(first.pte).method_names == {"forward"}


def test_coreml_payload_is_the_same_in_another_process(coreml_mlp, tmp_path):
    """Protobuf's map order is seeded per process: the bytes must not depend on it."""
    first, _, _ = coreml_mlp
    script = tmp_path / "lower.py"
    script.write_text(
        "import hashlib, sys, lowering\n"
        "from examples.models import mlp\n"
        "from lowering.targets import partitioner_for\n"
        "model, inputs = mlp()\n"
        "pte = lowering.lower(model, inputs, partitioner=partitioner_for('coreml')).pte\n"
        "sys.stderr.write('SHA ' + hashlib.sha256(pte).hexdigest() + '\\n')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    shas = re.findall(r"^SHA ([0-9a-f]{64})$", done.stderr, re.M)
    assert shas == [hashlib.sha256(first.pte).hexdigest()], done.stderr[-2000:]


def test_coreml_cnn_fails_in_coremltools_as_executorchs_own_lowering_does():
    """The CNN's max_pool2d is kept whole for Core ML (as ExecuTorch keeps it, not
    max_pool2d_with_indices), exported without its default stride; coremltools 9.0's converter
    wants at least 3 inputs: ExecuTorch's own lowering fails on the same node, lowerflow says so
    in one BackendError naming the partition."""
    from executorch.exir import to_edge_transform_and_lower

    model, inputs = cnn()
    message = "node aten_max_pool2d_default (max_pool2d) got 2 input(s), expected minimum 3 inputs"
    with pytest.raises(BackendError, match=re.escape(message)) as ours:
        lowering.lower(model, inputs, partitioner=partitioner_for("coreml"))
    assert "'CoreMLBackend'" in str(ours.value)
    et = make_et_partitioner(TARGETS["coreml"], check_options(TARGETS["coreml"], None))
    with pytest.raises(Exception, match=re.escape(message)):
        to_edge_transform_and_lower(torch.export.export(model, inputs), partitioner=[et])


def ethos_u_ready() -> str | None:
    """Why the Ethos-U compiler cannot run here (CI's test extra has no tosa-tools / vela), or None."""
    from lowering.backends.executorch.targets import check_available

    try:
        check_available(TARGETS["ethos-u"])
    except BackendError as exc:
        return str(exc)
    return None


def executorch_ethos_u_payloads(model, inputs):
    """The payloads of ExecuTorch's own Ethos-U int8 lowering (``executorch_ethos_u_program``)."""
    return payloads(executorch_ethos_u_program(model, inputs))


def executorch_ethos_u_program(model, inputs):
    """ExecuTorch's own Ethos-U int8 lowering: Arm's quantizer calibrated on ``inputs``, then
    ``to_edge_transform_and_lower`` with the same partitioner."""
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from lowering.backends.executorch.options import ethos_u_quantizer
    from lowering.quantize import parse_recipe

    options = check_options(TARGETS["ethos-u"], None)
    prepared = prepare_pt2e(torch.export.export(model, inputs).module(check_guards=False),
                            ethos_u_quantizer(options, parse_recipe("int8")))
    prepared(*inputs)
    converted = convert_pt2e(prepared)
    et = make_et_partitioner(TARGETS["ethos-u"], options)
    return to_edge_transform_and_lower(torch.export.export(converted, inputs), partitioner=[et]).exported_program()


@pytest.mark.parametrize("factory", [mlp, cnn], ids=["mlp", "cnn_batchnorm"])
def test_ethos_u_int8_payloads_are_executorchs(factory):
    """``quantize='int8'`` for ``ethos-u`` quantizes with Arm's own EthosUQuantizer (what its partitioner
    takes: lowerflow's own int8 graph it takes 0 nodes of), on the module before decomposition, as
    ExecuTorch's Ethos-U flow does; the Vela command streams are ExecuTorch's, byte for byte."""
    reason = ethos_u_ready()
    if reason:
        pytest.skip(reason)
    from executorch.runtime import Runtime

    model, inputs = factory()
    result = lowering.lower(model, inputs, partitioner=partitioner_for("ethos-u"), quantize="int8",
                            calibration=[inputs])
    ours = payloads(result.exported_program)
    theirs = executorch_ethos_u_payloads(model, inputs)
    assert [b for b, _, _ in ours] == [b for b, _, _ in theirs] == ["EthosUBackend"]
    assert ours == theirs and len(ours[0][1]) > 10_000
    # All of it on the NPU: only the input's quantize and the output's dequantize stay outside.
    outside = [str(n.target) for n in result.exported_program.graph.nodes if n.op == "call_function"]
    assert sorted(outside) == sorted(["quantized_decomposed.quantize_per_tensor.default", "executorch_call_delegate",
                                      "<built-in function getitem>", "quantized_decomposed.dequantize_per_tensor.default"])
    assert Runtime.get().load_program(result.pte).method_names == {"forward"}


ETHOS_MODELS = '''
from examples.models import cnn


def calibrated_cnn():
    model, inputs = cnn()
    return {"module": model, "inputs": inputs, "calibration": [inputs]}
'''


def test_ethos_u_int8_through_the_flow_is_the_librarys_and_executorchs(tmp_path, cli, fresh_stages):
    """``lowerflow lower -t ethos-u --quantize int8`` quantizes with Arm's EthosUQuantizer in its quantize stage
    (keyed on the quantizer and the compilers' versions): the .pte is the one ``lowering.lower`` writes, whose
    Vela payload is ExecuTorch's; a warm rerun runs nothing."""
    reason = ethos_u_ready()
    if reason:
        pytest.skip(reason)
    from lowering.targets import quantizer_for
    from tests._lowering import executions_during

    assert quantizer_for("ethos-u", None, "int8")["quantizer"].endswith(".EthosUQuantizer")
    assert quantizer_for("ethos-u", None, "int8-dynamic") is None  # Arm's quantizer does static int8 only
    (tmp_path / "ethos_models.py").write_text(ETHOS_MODELS)
    spec = f"{tmp_path / 'ethos_models.py'}:calibrated_cnn"
    store, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    args = ("lower", spec, "-t", "ethos-u", "-t", "xnnpack", "--quantize", "int8", "--store", store, "-o", f"{out}/")
    (code, _, errors), ran = executions_during(cli, *args)
    assert (code, errors) == (0, [])
    assert ran["quantize"] == 2  # Arm's quantizer for ethos-u, lowerflow's recipe for xnnpack
    model, inputs = cnn()
    library = lowering.lower(model, inputs, partitioner=partitioner_for("ethos-u"), quantize="int8",
                             calibration=[inputs])
    flow = (out / "calibrated_cnn.ethos-u.pte").read_bytes()
    assert flow == library.pte
    (backend, payload, named), = payloads(library.exported_program)
    assert backend == "EthosUBackend" and payload in flow
    assert [("EthosUBackend", payload, named)] == executorch_ethos_u_payloads(model, inputs)
    # lowerflow's own int8 for XNNPACK is another program (Arm's partitioner takes none of its graph).
    assert payload not in (out / "calibrated_cnn.xnnpack.pte").read_bytes()
    (code, _, errors), ran = executions_during(cli, *args)
    assert (code, errors) == (0, []) and not ran, dict(ran)
