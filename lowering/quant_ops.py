"""The quantize / dequantize op libraries a quantized program's graph calls.

``quantized_decomposed.*`` (PT2E's q/dq ops) and ``torchao.*`` (the affine q/dq
ops of the dynamic recipes) exist in ``torch.ops`` only once the Python module
that defines them is imported.  A stage that reads a quantized program back
from the store (in another process, or after a cache hit) deserializes it with
:func:`register_quantized_ops` first; an fp32 program never imports torchao.
"""

from __future__ import annotations

#: Namespaces of the ops the quantize stage puts in a graph.
QUANT_NAMESPACES = ("quantized_decomposed", "torchao")


def register_quantized_ops(graph_text: bytes | str | None = None) -> None:
    """Import the libraries that define the q/dq ops ``graph_text`` (a serialized graph;
    None: any) may call.  Cheap when done: Python caches the imports."""
    text = graph_text.decode("utf-8", "replace") if isinstance(graph_text, bytes) else graph_text
    if text is None or "quantized_decomposed." in text:
        register_out_variants()  # and the functional quantized_decomposed.* they wrap
    if text is None or "torchao." in text:
        import torchao.quantization.quant_primitives  # noqa: F401  (defines torchao.*_affine)


#: The out variants of the q/dq ops that ExecuTorch's quantized kernel library
#: (``kernels/quantized/quantized.yaml`` of the stock runtime) implements, by its
#: schemas: a portable program that keeps q/dq ops at the top level calls these.
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
}

_OUT_LIBRARY = None


def register_out_variants() -> None:
    """Define the :data:`OUT_SCHEMAS` in ``torch.ops.quantized_decomposed`` (once per
    process) with kernels that run the functional op and copy into ``out``: the memory
    planner pairs each q/dq op with its out variant by schema, the emitter names it, and
    lowerflow's executor runs it."""
    global _OUT_LIBRARY
    if _OUT_LIBRARY is not None:
        return
    import torch

    import torch.ao.quantization.fx._decomposed  # noqa: F401  (the functional ops)

    _load_stock_quantized_kernels()

    namespace = torch.ops.quantized_decomposed
    library = torch.library.Library("quantized_decomposed", "FRAGMENT")
    for name, schema in OUT_SCHEMAS.items():
        op_name, overload = name.split(".")
        defined = {schema.overload_name for schema in torch._C._jit_get_schemas_for_operator(f"quantized_decomposed::{op_name}")}
        if overload in defined:
            continue  # defined by ExecuTorch's own library (loaded above)
        library.define(f"{op_name}.{overload}{schema}")
        functional = getattr(getattr(namespace, op_name), "tensor" if overload == "Tensor_out" else "default")
        library.impl(f"{op_name}.{overload}", _out_kernel(functional), "CompositeExplicitAutograd")
    _OUT_LIBRARY = library


def _out_kernel(functional):
    def kernel(*args, out, **kwargs):
        result = functional(*args, **kwargs)
        out.copy_(result)
        return out

    return kernel


def _load_stock_quantized_kernels() -> None:
    """Where ExecuTorch is installed (the test oracle), load its quantized kernel library,
    looked up by name: it defines these same schemas in torch (and its runtime's
    kernels), and torch aborts the process when a schema is defined twice, so it must
    come first and lowerflow then defines none of them."""
    import importlib
    import importlib.util

    try:
        if importlib.util.find_spec("executorch.kernels.quantized") is None:
            return
    except (ImportError, ValueError):
        return
    importlib.import_module("executorch.kernels.quantized")
