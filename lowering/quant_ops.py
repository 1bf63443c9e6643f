"""The quantize / dequantize op libraries a quantized program's graph calls.

``quantized_decomposed.*`` (PT2E's q/dq ops) and ``torchao.*`` (the affine q/dq
ops of the dynamic recipes) exist in ``torch.ops`` only once the Python module
that defines them is imported.  A stage that reads a quantized program back
from the store (in another process, or after a cache hit) deserializes it with
:func:`register_quantized_ops` first; an fp32 program never imports torchao.
"""

from __future__ import annotations

import functools

#: Namespaces of the ops the quantize stage puts in a graph.
QUANT_NAMESPACES = ("quantized_decomposed", "torchao")


def register_quantized_ops(graph_text: bytes | str | None = None) -> None:
    """Import the libraries that define the q/dq ops ``graph_text`` (a serialized graph;
    None: any) may call.  Cheap when done: Python caches the imports."""
    text = graph_text.decode("utf-8", "replace") if isinstance(graph_text, bytes) else graph_text
    if text is None or "quantized_decomposed." in text:
        import torch.ao.quantization.fx._decomposed  # noqa: F401  (defines quantized_decomposed.*)
    if text is None or "torchao." in text:
        import torchao.quantization.quant_primitives  # noqa: F401  (defines torchao.*_affine)


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
}


def out_variant_of(op) -> str | None:
    """``quantized_decomposed.quantize_per_tensor.default`` ->
    ``"quantized_decomposed::quantize_per_tensor.out"``; None when the stock runtime has none."""
    schema = op._schema
    if not schema.name.startswith("quantized_decomposed::"):
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
