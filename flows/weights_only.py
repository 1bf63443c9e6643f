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
or an ``hf:`` directory of pickle checkpoints (no layout of its weights known without reading
them; an ``hf:`` directory's safetensors headers give it), a target whose partitioner keeps ops
whole (its own export).  A model of several methods (an ``hf:`` decoder: its traced methods and
constant methods) takes the same shapes per method (:class:`MethodExports`), and stage
``bind_weights_methods`` binds tonight's weights to every method of the one program.
Without external weights nothing here runs: every key is as it was.
"""

from __future__ import annotations

from typing import Any

#: Why a target with external weights is keyed on its weights' bytes from export on.
STATIC_INT8 = ("recipe int8 (static) calibrates activations on the model: its activation quantization "
               "parameters are in the program, so new weights need a new program (lowered fully)")
NO_LAYOUT = ("the model's weights have no layout known without reading them (a .pt2, or an hf: directory "
             "whose weights are not safetensors)")
KEPT_OPS = ("the target's partitioner keeps ops whole: its own export, keyed on the weights' bytes "
            "(weights-only binding of such targets is not in the flow yet)")


def bytes_reason(loaded, quantized: dict | None, kept: bool = False) -> str | None:
    """Why ``loaded`` (with ``quantized``, :func:`flows.lower_model.quantize_step`) is keyed on
    its weights' bytes even with external weights; None: the structure shape.  ``kept``: the
    target's partitioner keeps ops whole (:func:`lowering.targets.keep_for`: its own export)."""
    if kept:
        return KEPT_OPS
    if any(part.fingerprint.structure_digest is None for part in [loaded, *(loaded.methods or {}).values()]):
        return NO_LAYOUT
    if quantized is not None and quantized["recipe"].get("recipe") == "int8":
        return STATIC_INT8
    return None


def bind_inputs(loaded, exported: dict) -> dict[str, Any]:
    """What stage ``bind_weights`` is keyed on besides the lowered program: the structure
    export's result and the bytes digest of tonight's weights."""
    return {"exported": exported, "weights": loaded.fingerprint.parts["weights"]}


class Exports:
    """Stage export of one model in the key shapes its targets need: keyed on the whole
    fingerprint (``False``) or on the structure (``True``: a target with external weights and
    no :func:`bytes_reason`), each run once (``run``: the flow's stage runner); ``records[shape]``
    the export's stage record.  ``quantized``: ``target -> quantize step or None``; ``kept``:
    ``target -> bool``, whether its partitioner keeps ops whole (its own export, bytes-keyed).
    What a dry run lists (:meth:`bound`) is what runs: both read :attr:`structured`."""

    def __init__(self, run, loaded, model: str, options: dict, records: list[dict], targets, external: dict | None,
                 quantized, kept=lambda target: False) -> None:
        self.run, self.loaded, self.model, self.options = run, loaded, model, options
        self.key_shapes(loaded, targets, external, quantized, kept)
        self.records: dict[bool, list[dict]] = {False: records, True: []}
        self.done: dict[bool, dict] = {}

    def key_shapes(self, loaded, targets, external: dict | None, quantized, kept=lambda target: False) -> None:
        """:attr:`reasons` (``{target: why bytes-keyed}`` of the targets with external weights,
        :func:`bytes_reason`) and :attr:`structured` (``{target: keyed on the structure}``)."""
        self.reasons = {t: bytes_reason(loaded, quantized(t), kept(t)) for t in targets if (external or {}).get(t)}
        self.structured = {t: self.reasons.get(t, "") is None for t in targets}

    def __call__(self, structure: bool) -> dict:
        if structure not in self.done:
            fingerprint = self.loaded.fingerprint
            self.done[structure] = self.run(
                "export", self.records[structure], model=self.model,
                fingerprint=fingerprint.structure_digest if structure else fingerprint.digest, options=self.options,
                **({"external_weights": True} if structure else {}))
        return self.done[structure]

    def needed(self) -> None:
        """Export in every shape some target needs (what a failure fails for all targets)."""
        for structure in sorted(set(self.structured.values())):
            self(structure)

    def program(self, target: str):
        """The exported program ``target``'s stages start from (its key shape's)."""
        return self(self.structured[target])["program"]

    def records_of(self, target: str) -> list[dict]:
        """A copy of the export record of ``target``'s key shape (the start of its stage records)."""
        return list(self.records[self.structured[target]])

    def bound(self) -> frozenset:
        """The targets keyed on the structure (their dry run lists ``bind_weights``)."""
        return frozenset(t for t, structure in self.structured.items() if structure)

    def weights(self, target: str) -> dict | None:
        """:func:`flows.lower_model.lower_target`'s ``weights`` for ``target``: ``{"bind": inputs,
        "fallback": () -> (program, records)}`` when its program is the structure-keyed export
        (stage ``bind_weights`` makes the ``.ptd``; where it cannot, the target is lowered again
        from the bytes-keyed export ``fallback`` gives); else ``{"bytes": why}`` (or None without
        external weights).  A fallen-back target's is ``{"fallback": why}``: its record's."""
        if self.structured[target]:
            return {"bind": bind_inputs(self.loaded, self(True)),
                    "fallback": lambda: (self(False)["program"], list(self.records[False]))}
        return {"bytes": self.reasons[target]} if target in self.reasons else None


class MethodExports(Exports):
    """:class:`Exports` of a model of several methods: each method's export in the key shapes
    its targets need (``run``: the flow's stage runner; ``run_method(run, method)``: its
    records say which method, :func:`flows.lower_model.for_method`).  No ``kept``: no target
    of a model of several methods has an export of its own (:func:`flows.lower_model.lower_target_methods`
    delegates the methods' exports for every target, a partitioner that keeps ops whole
    included), so each target's key shape is :func:`bytes_reason`'s without it."""

    def __init__(self, run, run_method, loaded, model: str, options: dict, targets, external: dict | None,
                 quantized) -> None:
        self.run, self.run_method, self.loaded, self.model, self.options = run, run_method, loaded, model, options
        self.key_shapes(loaded, targets, external, quantized)
        self.records: dict[bool, list[dict]] = {False: [], True: []}
        self.done: dict[bool, dict[str, dict]] = {}

    def __call__(self, structure: bool) -> dict[str, dict]:
        """``{method: export result}`` in the key shape ``structure``."""
        if structure not in self.done:
            done = {}
            for method, sub in self.loaded.methods.items():
                fingerprint = sub.fingerprint
                done[method] = self.run_method(self.run, method)(
                    "export", self.records[structure], model=self.model, options=self.options,
                    fingerprint=fingerprint.structure_digest if structure else fingerprint.digest,
                    **({"external_weights": True} if structure else {}))
            self.done[structure] = done
        return self.done[structure]

    def programs(self, target: str) -> dict:
        """``{method: exported program}`` ``target``'s stages start from (its key shape's)."""
        return self.programs_of(self.structured[target])

    def weights(self, target: str) -> dict | None:
        """As :meth:`Exports.weights`, ``bind``: :func:`bind_methods_inputs`."""
        if self.structured[target]:
            return {"bind": {"exported": self(True),
                             "weights": {m: sub.fingerprint.parts["weights"] for m, sub in self.loaded.methods.items()}},
                    "fallback": lambda: (self.programs_of(False), list(self.records[False]))}
        return {"bytes": self.reasons[target]} if target in self.reasons else None

    def programs_of(self, structure: bool) -> dict:
        return {m: done["program"] for m, done in self(structure).items()}


def bind(run, records: list[dict], inputs: dict, program, plan, emitted: dict, quantized: dict | None,
         reference, derived, verify: str, runtime_ops, **model: Any) -> dict:
    """Stage ``bind_weights`` after emit (``inputs``: :func:`bind_inputs`; ``model``: the
    model's ``model``, ``fingerprint`` and ``options``, to find it again)."""
    recipe = quantized["recipe"] if quantized is not None else None
    return run("bind_weights", records, **inputs, program=program, plan=plan, emitted=emitted, **model,
               recipe=recipe, reference=reference, derived=derived if recipe is not None else None,
               runtime_ops=runtime_ops, references=verify != "off")


def bind_methods(run, records: list[dict], inputs: dict, planned: dict, emitted: dict, quantized: dict | None,
                 references: dict, derived: dict, verify: str, runtime_ops, constants, **model: Any) -> dict:
    """Stage ``bind_weights_methods`` after emit_methods (``inputs``: :meth:`MethodExports.weights`'
    ``bind``; ``planned``: ``{method: {"program", "plan"}}``; ``model``: ``model``,
    ``fingerprints`` (each method's) and ``options``, to find the methods again)."""
    recipe = quantized["recipe"] if quantized is not None else None
    return run("bind_weights_methods", records, **inputs, methods=planned, emitted=emitted, **model,
               constants=constants or None, recipe=recipe, quantized=references or None,
               derived=derived if recipe is not None else None, runtime_ops=runtime_ops,
               references=verify != "off")


def record(bound: dict) -> dict:
    """The target's ``weights_only`` record of a ``bind_weights`` result."""
    return {"bind_weights": "rebound" if bound["rebound"] else "as exported",
            **({"quantized": bound["quantized"]} if "quantized" in bound else {}),
            **({"ptd": bound["ptd_from"]} if "ptd_from" in bound else {})}


def report_line(record: dict) -> str:
    """The model report's line of a target's ``weights_only`` record: how its weights were
    bound to last night's program, or why it was lowered fully."""
    if record.get("bind_weights") == "rebound":
        return "tonight's weights bound to the cached program (no graph stage ran again)"
    if record.get("bind_weights"):
        return "the program and its weights lowered together (a later retrain binds new weights only)"
    return f"lowered fully: {record.get('fallback') or record.get('bytes')}"
