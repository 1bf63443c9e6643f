"""Issue 27: :func:`lowering.serialize_dataclass.bytes_to_dataclass` (torch's JSON-to-dataclass
step with each class's type hints resolved once) builds the same dataclasses as torch's
``_bytes_to_dataclass`` from real programs' graph JSON (fp32 and 8da4w, a decoder's
dynamic shapes), and a stored program reads back with it."""

from __future__ import annotations

import json

import torch
from torch import nn
from torch._export.serde import serialize as torch_serde

from lowering import export
from lowering.serialize import serialize_program
from lowering.serialize_dataclass import bytes_to_dataclass, type_hints


def graph_json(program) -> bytes:
    """The graph JSON lowerflow stores for ``program`` (torch's serde of it, normalized)."""
    serialized = serialize_program(program, keep_stack_traces=False)
    return bytes(serialized.blobs[json.loads(serialized.manifest)["graph"]])


def programs():
    from lowering.quantize import quantize

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).eval()
    fp32 = export(mlp, (torch.randn(2, 64),))
    batch = torch.export.Dim("batch", max=8)
    dynamic = export(mlp, (torch.randn(2, 64),), dynamic_shapes=({0: batch},))
    return {"fp32": fp32, "8da4w": quantize(fp32, "8da4w"), "dynamic": dynamic}


def test_the_same_dataclasses_as_torch_and_the_hints_are_resolved_once():
    for name, program in programs().items():
        data = graph_json(program)
        ours = bytes_to_dataclass(torch_serde.ExportedProgram, data)
        assert ours == torch_serde._bytes_to_dataclass(torch_serde.ExportedProgram, data), name
        assert len(ours.graph_module.graph.nodes) >= 3, name  # addmm, relu, addmm (+ q/dq ops)
    assert type_hints.cache_info().hits > type_hints.cache_info().misses
