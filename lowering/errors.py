"""Errors raised by the lowering stages.

Every error names the input it is about (the model, the partition tag, the
backend, the node) so that a failed fleet run says what to fix without a
traceback from deep inside torch.
"""


class LoweringError(Exception):
    """Base class of every error lowerflow raises on bad input or a failed stage."""


class ExportError(LoweringError):
    """Stage 1: the model could not be exported or decomposed."""


class PartitionError(LoweringError):
    """Stage 2: a partitioner misbehaved or tagged something that cannot be delegated."""


class SubmoduleError(LoweringError):
    """Stage 3: the nodes of a partition tag cannot be fused into one submodule."""


class BackendError(LoweringError):
    """Stage 5: unknown backend id, or the backend's preprocess failed."""


class MemoryPlanError(LoweringError):
    """Stage 7: the program cannot be memory-planned (e.g. an op without an out variant)."""


class EmitError(LoweringError):
    """Stage 8: the program cannot be written in the ExecuTorch format."""


class MissingOperatorError(EmitError):
    """Stage 8: the program calls an operator its runtime profile has no kernel for
    (:mod:`lowering.stock_ops`); raised before any bytes are written."""


class DynamicShapeError(LoweringError):
    """A dynamic-shape spec or a symbolic size that cannot be lowered (e.g. a Dim without a max)."""


class FusedOpError(PartitionError):
    """Stage 2: a backend's fused op is unusable (missing kernel, untraceable pattern)."""


class QuantizeError(LoweringError):
    """The quantize stage: a bad recipe, missing or malformed calibration data, or a
    program the recipe cannot quantize."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type name when it has none): torch's
    messages run to pages, an error of ours quotes one line."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


#: How a user who trusts a refused input (a .pt2, a pickle checkpoint) loads it anyway.
TRUST_HINT = "trust_pickle: true on the entry, or --trust-pickle, loads it anyway"


class UntrustedInputError(LoweringError):
    """An input that is data (a ``.pt2``, a checkpoint, a stored program) would run code
    to load: refused before anything runs.  One line: the input, the entry, the rule::

        model.pt2: weight 'weight' is a pickle; lowerflow loads .pt2 files without running
        code (trust_pickle: true on the entry, or --trust-pickle, loads it anyway)
    """

    @classmethod
    def of(cls, source: str, why: str, rule: str, *, trust_hint: bool = True) -> "UntrustedInputError":
        """``"<source>: <why>; <rule> (<TRUST_HINT>)"``."""
        return cls(f"{source}: {why}; {rule}" + (f" ({TRUST_HINT})" if trust_hint else ""))
