"""The quantize / dequantize op libraries a quantized program's graph calls.

``quantized_decomposed.*`` (PT2E's q/dq ops) and ``torchao.*`` (the affine q/dq
ops of the dynamic recipes) exist in ``torch.ops`` only once the Python module
that defines them is imported.  A stage that reads a quantized program back
from the store (in another process, or after a cache hit) deserializes it with
:func:`register_quantized_ops` first; an fp32 program never imports torchao.
"""

from __future__ import annotations

import functools
import threading

#: lowerflow's own functional quantized-embedding ops (:func:`ensure_embedding_ops`).
EMBEDDING_NAMESPACE = "lowerflow_quantized"

#: Namespaces of the ops the quantize stage puts in a graph.
QUANT_NAMESPACES = ("quantized_decomposed", "torchao", EMBEDDING_NAMESPACE)


def register_quantized_ops(graph_text: bytes | str | None = None) -> None:
    """Import the libraries that define the q/dq ops ``graph_text`` (a serialized graph;
    None: any) may call.  Cheap when done: Python caches the imports."""
    text = graph_text.decode("utf-8", "replace") if isinstance(graph_text, bytes) else graph_text
    if text is None or "quantized_decomposed." in text:
        import torch.ao.quantization.fx._decomposed  # noqa: F401  (defines quantized_decomposed.*)
    if text is None or "torchao." in text:
        import torchao.quantization.quant_primitives  # noqa: F401  (defines torchao.*_affine)
    if text is None or f"{EMBEDDING_NAMESPACE}." in text:
        ensure_embedding_ops()


#: The out variants of the q/dq ops that ExecuTorch's quantized kernel library
#: (``kernels/quantized/quantized.yaml`` of the stock runtime) implements, with its
#: schemas: a portable program that keeps q/dq ops at the top level calls these.
#: They are never defined in torch (ExecuTorch's own library defines them when it is
#: loaded, and torch aborts the process on a schema defined twice): the memory plan
#: pairs ops with them by :data:`OUT_VARIANTS`, emit reads :func:`out_schema`, and
#: lowerflow's executor runs them by name (``lowering/runtime/kernels_quant.py``).
OUT_SCHEMAS = {
    "quantize_per_tensor.out": "(Tensor input, float scale, int zero_point, int quant_min, int quant_max, "
                               "ScalarType dtype, *, Tensor(a!) out) -> Tensor(a!)",
    "quantize_per_tensor.Tensor_out": "(Tensor input, Tensor scale, Tensor zero_point, int quant_min, "
                                      "int quant_max, ScalarType dtype, *, Tensor(a!) out) -> Tensor(a!)",
    "dequantize_per_tensor.out": "(Tensor input, float scale, int zero_point, int quant_min, int quant_max, "
                                 "ScalarType dtype, *, ScalarType? out_dtype=None, Tensor(a!) out) -> Tensor(a!)",
    "dequantize_per_tensor.Tensor_out": "(Tensor input, Tensor scale, Tensor zero_point, int quant_min, "
                                        "int quant_max, ScalarType dtype, *, ScalarType? out_dtype=None, "
                                        "Tensor(a!) out) -> Tensor(a!)",
    "quantize_per_channel.out": "(Tensor input, Tensor scales, Tensor zero_points, int axis, int quant_min, "
                                "int quant_max, ScalarType dtype, *, Tensor(a!) out) -> Tensor(a!)",
    "dequantize_per_channel.out": "(Tensor input, Tensor scales, Tensor? zero_points, int axis, int quant_min, "
                                  "int quant_max, ScalarType dtype, *, ScalarType? out_dtype=None, "
                                  "Tensor(a!) out) -> Tensor(a!)",
    "choose_qparams.Tensor_out": "(Tensor input, int quant_min, int quant_max, float eps, ScalarType dtype, *, "
                                 "Tensor(a!) scale_out, Tensor(b!) zero_point_out) -> (Tensor(a!), Tensor(b!))",
    "embedding_byte.out": "(Tensor weight, Tensor weight_scales, Tensor? weight_zero_points, int weight_quant_min, "
                          "int weight_quant_max, Tensor indices, *, Tensor(a!) out) -> Tensor(a!)",
    "embedding_4bit.out": "(Tensor weight, Tensor weight_scales, Tensor? weight_zero_points, int weight_quant_min, "
                          "int weight_quant_max, Tensor indices, *, Tensor(a!) out) -> Tensor(a!)",
}

#: ``quantized_decomposed`` functional overload -> its out variant (a key of OUT_SCHEMAS).
OUT_VARIANTS = {
    "quantize_per_tensor.default": "quantize_per_tensor.out",
    "quantize_per_tensor.tensor": "quantize_per_tensor.Tensor_out",
    "dequantize_per_tensor.default": "dequantize_per_tensor.out",
    "dequantize_per_tensor.tensor": "dequantize_per_tensor.Tensor_out",
    "quantize_per_channel.default": "quantize_per_channel.out",
    "dequantize_per_channel.default": "dequantize_per_channel.out",
    "choose_qparams.tensor": "choose_qparams.Tensor_out",
    # lowerflow_quantized's functional embedding ops (ensure_embedding_ops)
    "embedding_byte.default": "embedding_byte.out",
    "embedding_4bit.default": "embedding_4bit.out",
}


def out_variant_of(op) -> str | None:
    """``quantized_decomposed.quantize_per_tensor.default`` ->
    ``"quantized_decomposed::quantize_per_tensor.out"``; None when the stock runtime has none."""
    schema = op._schema
    if not schema.name.startswith(("quantized_decomposed::", f"{EMBEDDING_NAMESPACE}::")):
        return None
    key = f"{schema.name.partition('::')[2]}.{schema.overload_name or 'default'}"
    out = OUT_VARIANTS.get(key)
    return f"quantized_decomposed::{out}" if out else None


@functools.lru_cache(maxsize=None)
def out_schema(qualified: str):
    """The ``torch._C.FunctionSchema`` of an out variant of :data:`OUT_SCHEMAS`
    (``"quantized_decomposed::quantize_per_tensor.out"``), parsed, not registered; None
    for any other name."""
    import torch

    namespace, _, name = qualified.partition("::")
    if namespace != "quantized_decomposed" or name not in OUT_SCHEMAS:
        return None
    return torch._C.parse_schema(f"{qualified}{OUT_SCHEMAS[name]}")


# --------------------------------------------------------------------------- quantized embeddings

#: The functional schemas of ExecuTorch's ``quantized_decomposed::embedding_byte`` /
#: ``embedding_4bit`` (``exir/passes/_quant_patterns_and_replacements.py``), defined by
#: lowerflow under :data:`EMBEDDING_NAMESPACE`: ExecuTorch's Python defines the same names in
#: ``quantized_decomposed`` when its passes are imported, and two definitions of one name
#: fail, so lowerflow's live in a namespace of their own; their out variants are the stock
#: runtime's (:data:`OUT_VARIANTS`), so the ``.pte`` calls ``quantized_decomposed::*.out``.
EMBEDDING_SCHEMAS = {
    name: "(Tensor weight, Tensor weight_scales, Tensor? weight_zero_points, int weight_quant_min, "
          "int weight_quant_max, Tensor indices) -> Tensor"
    for name in ("embedding_byte", "embedding_4bit")
}

_EMBEDDING_LIBS: list = []
_EMBEDDING_LOCK = threading.Lock()


def ensure_embedding_ops() -> None:
    """Define ``lowerflow_quantized::embedding_byte`` / ``embedding_4bit`` (once)."""
    import torch

    with _EMBEDDING_LOCK:
        if not _EMBEDDING_LIBS:
            _EMBEDDING_LIBS.append(_define_embedding_ops(torch))


def _define_embedding_ops(torch):
    lib = torch.library.Library(EMBEDDING_NAMESPACE, "DEF")  # noqa: TOR901 (kept alive below)
    for name, schema in EMBEDDING_SCHEMAS.items():
        bits = 8 if name == "embedding_byte" else 4
        lib.define(name + schema)
        lib.impl(name, functools.partial(_embedding_cpu, bits), "CPU")
        lib.impl(name, functools.partial(_embedding_meta, bits), "Meta")
    return lib


def _embedding_cpu(bits, weight, scales, zero_points, qmin, qmax, indices):
    return quantized_embedding(weight, scales, zero_points, indices, bits)


def _embedding_meta(bits, weight, scales, zero_points, qmin, qmax, indices):
    import torch

    width = weight.shape[1] * (8 // bits)
    return torch.empty((*indices.shape, width), dtype=torch.float32, device="meta")


def quantized_embedding(weight, scales, zero_points, indices, bits: int):
    """The rows ``indices`` of a quantized table, dequantized to fp32, as ExecuTorch's
    ``quantized_embedding_byte_out`` / ``quantized_embedding_xbit_out`` compute them:
    ``(f32(q) - f32(zp)) * f32(scale)`` per group of a row (scales ``[N]`` or ``[N, groups]``;
    zero points absent: 0).  ``bits`` 4: ``weight`` is uint8 ``[N, D/2]``, value ``2j`` in the
    high nibble, ``2j+1`` in the low one, each stored as ``q + 8``."""
    import torch

    rows = weight[indices.reshape(-1)]
    q = unpack_int4(rows) if bits == 4 else rows.to(torch.int32)
    groups = 1 if scales.dim() == 1 else scales.shape[1]
    shape = (q.shape[0], groups, q.shape[1] // groups)
    scale = scales[indices.reshape(-1)].to(torch.float32).reshape(q.shape[0], groups, 1)
    zero = 0.0 if zero_points is None else zero_points[indices.reshape(-1)].to(torch.float32).reshape(q.shape[0], groups, 1)
    values = (q.to(torch.float32).reshape(shape) - zero) * scale
    return values.reshape(*indices.shape, q.shape[1])


def pack_int4(q):
    """int8 values in [-8, 7], ``[N, D]`` (D even) -> uint8 ``[N, D/2]`` (the layout of
    :func:`quantized_embedding`)."""
    import torch

    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return (u[:, 0::2] << 4) | u[:, 1::2]


def unpack_int4(packed):
    """:func:`pack_int4` undone: int32 ``[N, 2 * D/2]``."""
    import torch

    high = (packed >> 4).to(torch.int32) - 8
    low = (packed & 0x0F).to(torch.int32) - 8
    return torch.stack((high, low), dim=-1).reshape(packed.shape[0], -1)
