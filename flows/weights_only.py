"""Weights-only lowering: the cache's key shape for a target whose weights are external.

A retrain (same code, new weights) of a model lowered with ``external_weights`` gives the
same ``.pte`` and a new ``.ptd``.  The flow gets there by keying the graph stages on the
model's *structure* and one cheap stage on its weights' *bytes*::

    export[structure] ─► [quantize] ─► partition … adjust ─► memory_plan ─► emit ─► bind_weights[bytes] ─► verify
    (keyed on Fingerprint.structure_digest:            every stage keyed on    keyed on the weights'
     code, attributes, inputs, options and the          its inputs' digests,    digest: the .ptd of
     weights by name, dtype, shape and ties)            as always               tonight's weights

so a retrain hits every graph stage (last night's artifacts: a program with last night's
weights) and runs ``bind_weights`` (:func:`tasks.stages.run_bind_weights`): the new weights
bound by name to that program (:func:`lowering.rebind.rebind_weights`: quantized again
where the recipe quantizes, every delegate preprocessed again, the ``.pte`` emitted again
and checked byte-identical), the new ``.ptd``; verify runs the pair against tonight's model.
Nothing weight-dependent reaches the outputs from the structure-keyed artifacts: the ``.pte``
is checked equal by every rebind, the ``.ptd`` and verify's quantized reference come from
``bind_weights``, and verify is keyed on the model's whole fingerprint.

Where the weights cannot be bound to last night's program (a payload or the ``.pte``
depends on weight values, control flow: :class:`~lowering.rebind.NotWeightsOnly`), the
target is lowered again with the bytes-keyed shape (export keyed on the whole fingerprint,
as without external weights) and its record says why (``weights_only.fallback``).  Some
targets never take the structure shape, and say why (``weights_only.bytes``): ``int8``
static (its activation parameters are calibrated on the model: in the program), a ``.pt2``
or an ``hf:`` directory (no layout of its weights known without reading them), a model of
several methods (not yet).  Without external weights nothing here runs: every key is as it was.
"""

from __future__ import annotations

from typing import Any

#: Why a target with external weights is keyed on its weights' bytes from export on.
STATIC_INT8 = ("recipe int8 (static) calibrates activations on the model: its activation quantization "
               "parameters are in the program, so new weights need a new program (lowered fully)")
NO_LAYOUT = "the model's weights have no layout known without reading them (a .pt2 or an hf: directory)"
METHODS = "a model of several methods is lowered fully (weights-only binding of methods is not in the flow yet)"


def bytes_reason(loaded, quantized: dict | None) -> str | None:
    """Why ``loaded`` (with ``quantized``, :func:`flows.lower_model.quantize_step`) is keyed on
    its weights' bytes even with external weights; None: the structure shape."""
    if loaded.methods:
        return METHODS
    if loaded.fingerprint.structure_digest is None:
        return NO_LAYOUT
    if quantized is not None and quantized["recipe"].get("recipe") == "int8":
        return STATIC_INT8
    return None


def bind_inputs(loaded, exported: dict) -> dict[str, Any]:
    """What stage ``bind_weights`` is keyed on besides the lowered program: the structure
    export's result and the bytes digest of tonight's weights."""
    return {"exported": exported, "weights": loaded.fingerprint.parts["weights"]}
