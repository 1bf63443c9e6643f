"""``qembedding``: embedding tables quantized weight-only, looked up by the stock runtime's kernels.

A recipe with ``qembedding`` (``int8-dynamic`` / ``8da4w``) rewrites every
``aten.embedding`` of a constant fp32 table (what optimum-executorch's ``--qembedding``
does with torchao's ``IntxWeightOnlyConfig``, symmetric, and ExecuTorch's quant fusion
turns into ``quantized_decomposed::embedding_byte`` / ``embedding_4bit``)::

    before:  %p_embed_tokens_weight = placeholder                          # fp32 [V, D]
             %embedding = aten.embedding.default(%p_embed_tokens_weight, %input_ids)
    after (8w):
             %c__q_table_embedding = placeholder                           # int8 [V, D]
             %c__q_table_scale_embedding = placeholder                     # fp32 [V]
             %embedding = lowerflow_quantized.embedding_byte.default(%c__q_table_embedding,
                              %c__q_table_scale_embedding, None, -128, 127, %input_ids)
    after (4w):  uint8 [V, D/2] (two values a byte, q + 8, value 2j high nibble),
             fp32 scales [V, D/32], embedding_4bit(..., -8, 7, %input_ids)

``lowerflow_quantized.*`` are lowerflow's definitions of ExecuTorch's functional ops
(:func:`lowering.quant_ops.ensure_embedding_ops`); the memory plan pairs them with the
stock runtime's ``quantized_decomposed::embedding_byte.out`` / ``embedding_4bit.out``
(``kernels/quantized``), which the ``.pte`` calls, and lowerflow's own runtime runs them
(:mod:`lowering.runtime.kernels_quant`).  No backend takes them: they stay at the top level.

Scales are ``max|w| / ((qmax - qmin) / 2)`` per row (8w) or per group of
:data:`GROUP_SIZE_4W` values of a row (4w), as torchao's ``choose_qparams_affine``
(symmetric) computes them; zero points are 0 (not stored).  A 4w table whose rows are
not a multiple of the group size stays fp32 (its name is returned).

Tied embeddings: an LM head tied to the table reads the fp32 table through its own path
(8da4w / int8-dynamic quantize it as a linear); once the lookup reads the quantized
table, the fp32 one has no reader left and is dropped: the program stores the table
twice, quantized two ways (the lookup's and the head's), and never in fp32.
"""

from __future__ import annotations

import logging

import torch
from torch.export import ExportedProgram

from ..quant_ops import EMBEDDING_NAMESPACE, ensure_embedding_ops, pack_int4
from .graph import add_constant, call, constant_value, kept_fp32
from .weights import WeightScheme, quantize_weight

log = logging.getLogger(__name__)

#: 4w's group: values of a row sharing one scale (ExecuTorch's ``embedding_quantize 4,32``).
GROUP_SIZE_4W = 32

#: qembedding -> (weight scheme, bits).
SCHEMES = {"8w": (WeightScheme(0, -128, 127), 8), "4w": (WeightScheme(GROUP_SIZE_4W, -8, 7), 4)}


def quantize_embeddings(program: ExportedProgram, qembedding: str, keep_fp32: tuple[str, ...] = ()) -> list[str]:
    """Rewrite ``program``'s embedding lookups in place (see the module docstring); returns
    the names of those left fp32 because their rows do not split into 4w's groups.  The
    caller removes the unused fp32 tables and recompiles."""
    ensure_embedding_ops()
    scheme, bits = SCHEMES[qembedding]
    op = getattr(getattr(torch.ops, EMBEDDING_NAMESPACE), "embedding_byte" if bits == 8 else "embedding_4bit").default
    tables: dict[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node]] = {}  # a table read by several lookups: once
    skipped = []
    for node in list(program.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.embedding.default:
            continue
        source = node.args[0]
        weight = constant_value(program, source) if isinstance(source, torch.fx.Node) else None
        if weight is None or weight.dim() != 2 or weight.dtype != torch.float32 or kept_fp32(node, keep_fp32):
            continue
        if scheme.block and weight.shape[1] % scheme.block:
            skipped.append(node.name)
            continue
        if source not in tables:
            tables[source] = _quantized_table(program, node, weight, scheme, bits)
        table, scales = tables[source]
        with program.graph.inserting_before(node):
            lookup = call(program.graph, op, (table, scales, None, scheme.qmin, scheme.qmax, node.args[1]),
                          meta_from=node)
        node.replace_all_uses_with(lookup)
        program.graph.erase_node(node)
    if skipped:
        log.info("qembedding %s left %d embedding(s) fp32 (rows not a multiple of %d): %s", qembedding,
                 len(skipped), scheme.block, ", ".join(skipped))
    return skipped


def _quantized_table(program: ExportedProgram, node: torch.fx.Node, weight: torch.Tensor, scheme: WeightScheme,
                     bits: int) -> tuple[torch.fx.Node, torch.fx.Node]:
    """Lift the quantized table and its scales (``[V]`` per row, ``[V, D/g]`` per group)."""
    qdata, scale, _ = quantize_weight(weight, scheme)
    table = pack_int4(qdata) if bits == 4 else qdata
    scale = scale.reshape(-1) if not scheme.block else scale
    return (add_constant(program, f"_q_table_{node.name}", table, meta_from=node),
            add_constant(program, f"_q_table_scale_{node.name}", scale.to(torch.float32), meta_from=node))
