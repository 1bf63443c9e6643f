"""The ``xnnpack`` backend: fp32 and quantized XNNPACK delegates the stock ExecuTorch runtime executes.

- :class:`XnnpackPartitioner` tags what XNNPACK takes (:mod:`.partitioner`);
- :class:`XnnpackBackend` (id ``XnnpackBackend``, the id ExecuTorch's runtime
  dispatches on) turns each partition into an ``XH00`` + ``XNNGraph`` payload
  and its weights into named data (:mod:`.preprocess`, :mod:`.payload`,
  schema ``xnngraph.fbs``), one lowering room per op family under :mod:`.ops`,
  whose table :data:`.ops.OPS` also decides what the partitioner takes;
- quantized programs (int8 static, int8 dynamic, 8da4w): :mod:`.qplan` decides once
  which nodes compute quantized, :mod:`.qparams` reads q/dq parameters and weights,
  :mod:`.ops.quantized` lowers q/dq (aliases or Converts), weights and int32 biases;
- :class:`.runtime.XnnpackRuntime` interprets payloads on torch ops for
  lowerflow's executor (entry point ``lowerflow.backend_runtimes``).

Self-contained: the rest of ``lowering`` never imports this package by name;
it is found through the ``lowerflow.backends`` entry point (``xnnpack``).
"""

from __future__ import annotations

from ...delegation import EXTERNAL_WEIGHTS_SPEC, BackendDetails, PreprocessResult
from . import fused  # defines lowerflow_xnnpack:: ops and their lowering rules
from .partitioner import BACKEND_ID, XnnpackPartitioner
from .payload import deserialize_payload
from .preprocess import XnnpackPreprocessError, preprocess_program


class XnnpackBackend(BackendDetails):
    @classmethod
    def partitioner(cls, **options) -> XnnpackPartitioner:
        """The target's partitioner; ``options`` go to :class:`XnnpackPartitioner`."""
        options.setdefault("backend_id", cls.__name__)
        return XnnpackPartitioner(**options)

    @staticmethod
    def preprocess(edge_program, compile_specs) -> PreprocessResult:
        stable = any(spec.key == EXTERNAL_WEIGHTS_SPEC.key for spec in compile_specs)
        processed, named_data = preprocess_program(edge_program, stable_keys=stable)
        return PreprocessResult(processed, named_data=named_data)

    @staticmethod
    def external_keys(processed: bytes) -> dict[str, int]:
        """The named data a payload binds at load time: key -> bytes it must have (the
        runtime checks neither; :func:`lowering.external.check_pair` does)."""
        graph, _ = deserialize_payload(processed)
        keys = {}
        for entry in graph.constantData or []:
            key = entry.namedKey.decode() if isinstance(entry.namedKey, bytes) else (entry.namedKey or "")
            if key:
                keys[key] = int(entry.size)
        return keys


__all__ = ["BACKEND_ID", "XnnpackBackend", "XnnpackPartitioner", "XnnpackPreprocessError"]
