"""OpenVINO ``precision: f32`` that the stock runtime keeps: every layer of the compiled model
marked precise, inside the payload.

ExecuTorch 1.5.1's ``OpenvinoBackend`` imports the payload (the CPU plugin's compiled-model
export) with ``ov_core_import_model(blob, device)`` and no properties, so the CPU plugin's
default ``INFERENCE_PRECISION_HINT`` applies at load (bf16 on CPUs with AMX / avx512_bf16),
whatever hint the blob was compiled with.  But the CPU plugin keeps a node at its original
precision when the node's runtime info disables fp16 compression (``precise``:
``Node::keepOrigPrecision``, honoured by ``Graph::EnforceInferencePrecision``), and its
export is the transformed model's IR, read back at import with that runtime info.  So
:func:`compile_precise` compiles the partition as ExecuTorch's ``OpenvinoBackend.preprocess``
does, with snippets off (a snippets ``Subgraph`` holding a MatMul runs bf16 whatever its
marks: ``Subgraph::initSupportedPrimitiveDescriptors``), and :func:`precise_payload` adds
``<attribute name="precise" version="0"/>`` to every layer of the IR inside the payload::

    header: 3 × (offset, size) u64   <cnndata> xml | weights | IR xml (xor-coded, codec_xor)
    IR before:  <layer ... type="FullyConnected"><rt_info><attribute name="fused_names" .../></rt_info>
    IR after:   <layer ... type="FullyConnected"><rt_info><attribute name="fused_names" .../>
                                                          <attribute name="precise" version="0"/></rt_info>

Measured here (openvino 2025.4.1, on ExecuTorch 1.5.1's runtime): max |error| against eager,
MLP 9.9e-4 (bf16) before, 7.5e-8 after; CNN 9.4e-4 before, 3.0e-7 after (marks alone leave
the MLP, one snippets Subgraph, at 9.9e-4).  The layout is the CPU plugin's
(``ModelSerializer``: a header of three sections, the IR xored with OpenVINO's fixed
``codec_xor`` key when no cache-encryption callbacks are set, as ExecuTorch's compile sets
none); a payload in any other layout is refused in one line rather than guessed at.
"""

from __future__ import annotations

import struct
import xml.etree.ElementTree as ET
from typing import Any

from ...errors import BackendError

#: OpenVINO's ``ov::util::codec_xor`` key (the CPU plugin's default cache "encryption").
CODEC_KEY = bytes([0x30, 0x60, 0x70, 0x02, 0x04, 0x08, 0x3F, 0x6F, 0x72, 0x74, 0x78, 0x7F])
HEADER = struct.Struct("<6Q")
PRECISE = "precise"  # ov::DisableFP16Compression's runtime-info name


def codec_xor(data: bytes) -> bytes:
    """OpenVINO's ``codec_xor`` (its own inverse)."""
    key = CODEC_KEY * (len(data) // len(CODEC_KEY) + 1)
    return (int.from_bytes(data, "little") ^ int.from_bytes(key[:len(data)], "little")).to_bytes(len(data), "little")


def precise_payload(blob: bytes) -> bytes:
    """The CPU plugin's compiled-model export ``blob`` with every IR layer marked ``precise``
    (kept fp32 at import, whatever the importing runtime's inference precision)."""
    if len(blob) < HEADER.size:
        raise BackendError(f"openvino precision f32: a {len(blob)}-byte payload is not a CPU compiled-model export")
    first, first_size, weights, weights_size, ir, ir_size = HEADER.unpack_from(blob)
    if (first, weights, ir) != (HEADER.size, first + first_size, weights + weights_size) or ir + ir_size > len(blob):
        raise BackendError("openvino precision f32: the payload's header is not the CPU plugin's compiled-model "
                           "export layout this lowerflow knows (OpenVINO 2025.x CPU); use another precision")
    text = codec_xor(blob[ir:ir + ir_size])
    if not text.startswith(b"<?xml") or b"<net " not in text[:200]:
        raise BackendError("openvino precision f32: the payload's model is not an OpenVINO IR coded with "
                           "OpenVINO's default key; use another precision")
    root = ET.fromstring(text)
    for layer in root.iter("layer"):
        info = layer.find("rt_info")
        if info is None:
            info = ET.SubElement(layer, "rt_info")
        if not any(a.get("name") == PRECISE for a in info.iter("attribute")):
            ET.SubElement(info, "attribute", {"name": PRECISE, "version": "0"})
    marked = codec_xor(b'<?xml version="1.0"?>\n' + ET.tostring(root, encoding="utf-8"))
    header = HEADER.pack(first, first_size, weights, weights_size, ir, len(marked))
    return header + blob[HEADER.size:ir] + marked + blob[ir + ir_size:]


#: The CPU plugin's compile config for ``precision: f32``: no snippets Subgraphs (see above).
F32_CONFIG = {"SNIPPETS_MODE": "DISABLE"}


def compile_precise(edge_program: Any, compile_specs: dict[str, str]) -> bytes:
    """The payload of ExecuTorch's ``OpenvinoBackend.preprocess`` for the ExecuTorch edge program
    ``edge_program`` (its passes, its inputs, OpenVINO's ``openvino_compile``), compiled with
    :data:`F32_CONFIG` and then :func:`precise_payload`: fp32 on the stock runtime.
    ``compile_specs``: ``{key: value}`` as ExecuTorch's preprocess decodes them (``device``)."""
    from executorch.backends.openvino._passes import DecomposeFloorDividePass
    from executorch.exir.passes.memory_format_ops_pass import DimOrderOpsRevertPass
    from openvino.frontend.pytorch.torchdynamo.compile import openvino_compile

    for pass_cls in (DimOrderOpsRevertPass, DecomposeFloorDividePass):
        result = pass_cls()(edge_program.graph_module)
        if result and result.graph_module:
            edge_program._graph_module = result.graph_module
    inputs = edge_program.graph_signature.user_inputs
    args = [node.meta["val"] for node in edge_program.graph.nodes if node.target in inputs]
    compiled = openvino_compile(edge_program.module(), *args, options={**compile_specs, "config": dict(F32_CONFIG)})
    return precise_payload(compiled.export_model().getvalue())
