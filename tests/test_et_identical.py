"""Proof without the devices: a partition lowerflow compiles with ExecuTorch's own backend
is the one ExecuTorch's ``to_edge_transform_and_lower`` compiles, with the same partitioner
and options — byte-identical delegate payloads and named data (Vulkan), or, where not
identical (Core ML), the test says why and the program loads in ExecuTorch's parser."""

from __future__ import annotations

import re

import pytest
import torch

import lowering
from examples.models import cnn, mlp
from lowering.backends.executorch.adapter import named_data_of
from lowering.backends.executorch.backends import deterministic_identifier
from lowering.backends.executorch.options import check_options, make_et_partitioner
from lowering.backends.executorch.targets import TARGETS
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
    # lowerflow's export without constant folding: ExecuTorch's graph keeps permute_copy(weight) too.
    program = lowering.export(model, inputs, fold_constants=False)
    return payloads(to_backend(program, partitioner_for(target, options)))


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


def test_coreml_differs_only_by_design_and_loads_in_executorchs_parser():
    from executorch.runtime import Runtime

    model, inputs = mlp()
    (_, ours, our_named), = lowerflow_payloads(model, inputs, "coreml")
    (_, theirs, their_named), = executorch_payloads(model, inputs, "coreml")
    assert our_named == their_named == {}
    # Why not identical: (1) ExecuTorch names every Core ML model "executorch_<uuid4>" (two of
    # its lowerings differ too); (2) ExecuTorch's CoreMLPartitioner keeps aten.linear
    # from decomposition (ops_to_not_decompose), lowerflow partitions its decomposed graph,
    # so Core ML gets addmm + transpose: the same function, another MIL program.
    # lowerflow derives the identifier from the payload's bytes instead: the same partition
    # always gives the same bytes (deterministic_identifier is a no-op on its own output).
    ident = rb"executorch_[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}"
    assert len(set(re.findall(ident, ours))) == 1 and set(re.findall(ident, ours)) != set(re.findall(ident, theirs))
    assert deterministic_identifier(ours) == ours and deterministic_identifier(theirs) != theirs
    assert b"aten_addmm_default" in ours and b"aten_addmm_default" not in theirs and b"linear_0" in theirs
    # The whole program is one ExecuTorch's program parser reads (its runtime here has no Core ML).
    # Not asserted yet: that lowering it again gives the same payload (in two full-suite runs a
    # second lowering differed at byte 93 of the payload's metadata; open, see issue 28's note).
    again = lowering.lower(lowering.export(model, inputs, fold_constants=False), partitioner=partitioner_for("coreml"))
    assert len(payloads(again.exported_program)[0][1]) == len(ours)
    program = Runtime.get().load_program(again.pte)
    assert program.method_names == {"forward"}
