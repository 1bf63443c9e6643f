"""Quantization recipes: what the ``quantize`` stage is asked to do.

A recipe is a :class:`QuantRecipe` (frozen, hashable).  :func:`parse_recipe`
accepts one, a recipe name, or a mapping (a fleet manifest's ``quantize:``
entry)::

    parse_recipe("int8")                                   # static int8 (needs calibration)
    parse_recipe("int8-dynamic")                           # dynamic per-token activations, int8 weights
    parse_recipe({"recipe": "8da4w", "group_size": 64,     # dynamic activations, int4 group weights
                  "keep_fp32": ["lm_head"]})
    parse_recipe({"recipe": "8da4w", "quantize_mha": True})  # nn.MultiheadAttention's projections too
    parse_recipe({"recipe": "8da4w", "qembedding": "4w"})  # embedding tables too (int4, groups of 32)

Which linears each recipe quantizes follows ExecuTorch's flow for it: ``int8`` and
``int8-dynamic`` (PT2E, graph level) every linear op (``int8-dynamic`` also the 2-D convolutions
``XNNPACKQuantizer``'s dynamic config takes); ``8da4w`` (torchao's ``quantize_``,
module level) ``nn.Linear`` modules, so not ``nn.MultiheadAttention``'s packed in-projection
and ``NonDynamicallyQuantizableLinear`` out-projection, unless ``quantize_mha``.

``qembedding`` (``int8-dynamic`` / ``8da4w``): every embedding lookup of a constant table
becomes one of the stock runtime's quantized embedding kernels, as optimum-executorch's
``--qembedding`` (torchao ``IntxWeightOnlyConfig``, symmetric) makes them: ``"8w"`` int8
[-128, 127] with one fp32 scale per row (``quantized_decomposed::embedding_byte``), ``"4w"``
int4 [-8, 7] packed two per byte with an fp32 scale per group of 32 values of a row
(``quantized_decomposed::embedding_4bit``); see :mod:`lowering.quantize.embedding`.

``key_text()`` is canonical JSON of every field that decides the output: the
cache key of the quantize stage is built from it, so it must never change for
a given recipe (tests pin it).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import QuantizeError

#: The recipe names, in documentation order.
RECIPE_NAMES = ("int8", "int8-dynamic", "8da4w")

#: Keys a mapping spec may have.
_SPEC_KEYS = ("recipe", "group_size", "keep_fp32", "quantize_mha", "qembedding")

#: ``qembedding`` values: optimum-executorch's ``--qembedding`` names.
QEMBEDDING = ("8w", "4w")


@dataclass(frozen=True)
class QuantRecipe:
    """One quantization recipe.

    ``name``: ``"int8"`` (static: per-channel int8 weights, per-tensor int8
    activations from calibration), ``"int8-dynamic"`` (per-channel int8 weights,
    activations quantized at runtime: per token for linears, per tensor for 2-D convolutions) or ``"8da4w"`` (int4 weights in groups
    of ``group_size`` along K, per-token int8 activations).
    ``group_size``: 8da4w only; a positive multiple of 32.
    ``keep_fp32``: module fqn prefixes (``"encoder.layer.0"``, ``"lm_head"``) or
    ``nn.Module`` class names (``"LayerNorm"``) whose layers stay fp32.
    ``quantize_mha``: 8da4w only; also quantize the linears of ``nn.MultiheadAttention``
    (its in/out projections), which torchao's ``nn.Linear`` filter, and so ExecuTorch's
    8da4w flow, leaves fp32 (the default).
    ``qembedding``: ``int8-dynamic`` / ``8da4w`` only; ``"8w"`` or ``"4w"`` quantizes the
    embedding tables (weight only; None: they stay fp32).  A table tied to the LM head
    is then stored twice, in two quantized forms: the embedding's own table (the stock
    runtime's kernel) and the head's weights (the backend's), as optimum's programs do.
    """

    name: str
    group_size: int = 32
    keep_fp32: tuple[str, ...] = ()
    quantize_mha: bool = False
    qembedding: str | None = None

    def __post_init__(self) -> None:
        if self.name not in RECIPE_NAMES:
            raise QuantizeError(f"quantize recipe {self.name!r}: unknown name{_suggestion(self.name)}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise QuantizeError(
                f"quantize recipe {self.name!r}: group_size must be an int, got {self.group_size!r}"
            )
        if self.group_size <= 0 or self.group_size % 32:
            raise QuantizeError(
                f"quantize recipe {self.name!r}: group_size {self.group_size} must be a positive "
                "multiple of 32 (XNNPACK's 4-bit group kernels need it)"
            )
        if isinstance(self.keep_fp32, str) or not isinstance(self.keep_fp32, (tuple, list)):
            raise QuantizeError(
                f"quantize recipe {self.name!r}: keep_fp32 must be a list of module names or "
                f"class names, got {self.keep_fp32!r}"
            )
        bad = [k for k in self.keep_fp32 if not isinstance(k, str) or not k]
        if bad:
            raise QuantizeError(f"quantize recipe {self.name!r}: keep_fp32 entries must be non-empty strings: {bad!r}")
        object.__setattr__(self, "keep_fp32", tuple(self.keep_fp32))
        if not isinstance(self.quantize_mha, bool):
            raise QuantizeError(
                f"quantize recipe {self.name!r}: quantize_mha must be true or false, got {self.quantize_mha!r}"
            )

        if self.qembedding is not None:
            if self.qembedding not in QEMBEDDING:
                raise QuantizeError(f"quantize recipe {self.name!r}: qembedding {self.qembedding!r} is not one of "
                                    f"{', '.join(QEMBEDDING)}{_suggestion(str(self.qembedding), QEMBEDDING)}")
            if self.name == "int8":
                raise QuantizeError("quantize recipe 'int8': qembedding applies to int8-dynamic and 8da4w "
                                    "(weight-only tables beside dynamic linears), not to static int8")

    @property
    def skips_mha(self) -> bool:
        """Whether the linears of ``nn.MultiheadAttention`` stay fp32 (8da4w by default)."""
        return self.name == "8da4w" and not self.quantize_mha

    @property
    def needs_calibration(self) -> bool:
        """Whether :func:`~lowering.quantize.quantize` needs calibration batches."""
        return self.name == "int8"

    def check_portable(self, where: str = "the portable target") -> None:
        """Raise unless the recipe's top-level ops run on the stock ExecuTorch runtime without
        a backend: ``int8``'s q/dq ops have kernels there (its quantized library), the
        per-token ops of ``int8-dynamic`` / ``8da4w`` (torchao's affine ops) do not."""
        if self.name != "int8":
            raise QuantizeError(
                f"{where}: recipe {self.name!r} cannot quantize a program without a backend: its per-token "
                "dynamic quantization (torchao affine ops) has no kernel in the stock ExecuTorch runtime; "
                f"quantize a backend target only (e.g. {{xnnpack: {self.name}}}), or use 'int8'"
            )

    def to_dict(self) -> dict[str, Any]:
        """The mapping form :func:`parse_recipe` accepts (``group_size`` and ``quantize_mha``
        only for 8da4w)."""
        out: dict[str, Any] = {"recipe": self.name}
        if self.name == "8da4w":
            out["group_size"] = self.group_size
            out["quantize_mha"] = self.quantize_mha
        out["keep_fp32"] = list(self.keep_fp32)
        if self.qembedding is not None:  # only when set: the keys of recipes without it stay
            out["qembedding"] = self.qembedding
        return out

    def key_text(self) -> str:
        """Canonical JSON of every field that decides the quantized program.

        ``group_size`` and ``quantize_mha`` appear only for 8da4w (other recipes ignore them);
        ``keep_fp32`` sorted and without duplicates (its order does not change
        the output, so it must not change the cache key either).
        """
        data = {**self.to_dict(), "keep_fp32": sorted(set(self.keep_fp32))}
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    def __str__(self) -> str:
        extra = f", group_size={self.group_size}" if self.name == "8da4w" else ""
        extra += ", quantize_mha=True" if self.quantize_mha and self.name == "8da4w" else ""
        keep = f", keep_fp32={list(self.keep_fp32)}" if self.keep_fp32 else ""
        embedding = f", qembedding={self.qembedding}" if self.qembedding else ""
        return f"{self.name}{extra}{keep}{embedding}"


def parse_recipe(spec: Any) -> QuantRecipe:
    """A :class:`QuantRecipe` from a recipe, a name or a mapping.

    Mapping keys: ``recipe`` (required), ``group_size``, ``keep_fp32`` (a list,
    or one string), ``quantize_mha``, ``qembedding``.  Anything else raises :class:`QuantizeError` naming the input.
    """
    if isinstance(spec, QuantRecipe):
        return spec
    if isinstance(spec, str):
        return QuantRecipe(_name(spec.strip(), spec))
    if isinstance(spec, Mapping):
        return _from_mapping(spec)
    raise QuantizeError(
        f"quantize recipe {spec!r}: expected a recipe name ({', '.join(RECIPE_NAMES)}), "
        f"a mapping {{'recipe': ...}} or a QuantRecipe, got {type(spec).__name__}"
    )


def _from_mapping(spec: Mapping) -> QuantRecipe:
    unknown = [k for k in spec if k not in _SPEC_KEYS]
    if unknown:
        hints = "".join(_suggestion(str(k), _SPEC_KEYS) for k in unknown[:1])
        raise QuantizeError(
            f"quantize recipe {dict(spec)!r}: unknown key(s) {unknown!r}{hints}; "
            f"allowed: {', '.join(_SPEC_KEYS)}"
        )
    if "recipe" not in spec:
        raise QuantizeError(f"quantize recipe {dict(spec)!r}: missing 'recipe' (one of {', '.join(RECIPE_NAMES)})")
    raw = spec["recipe"]
    if not isinstance(raw, str):
        raise QuantizeError(f"quantize recipe {dict(spec)!r}: 'recipe' must be a string, got {raw!r}")
    name = _name(raw.strip(), raw)
    for option in ("group_size", "quantize_mha"):
        if option in spec and name != "8da4w":
            raise QuantizeError(f"quantize recipe {dict(spec)!r}: {option} applies to 8da4w only")
    keep = spec.get("keep_fp32", ())
    if isinstance(keep, str):
        keep = (keep,)
    elif keep is None:
        keep = ()
    elif not isinstance(keep, (list, tuple)):
        raise QuantizeError(f"quantize recipe {dict(spec)!r}: keep_fp32 must be a list of strings, got {keep!r}")
    return QuantRecipe(name, group_size=spec.get("group_size", 32), keep_fp32=tuple(keep),
                       quantize_mha=spec.get("quantize_mha", False), qembedding=spec.get("qembedding"))


def _name(name: str, raw: Any) -> str:
    if name not in RECIPE_NAMES:
        raise QuantizeError(
            f"quantize recipe {raw!r}: unknown name{_suggestion(name)}; known: {', '.join(RECIPE_NAMES)}"
        )
    return name


def _suggestion(word: str, choices=RECIPE_NAMES) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""
