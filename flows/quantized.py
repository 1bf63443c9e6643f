"""A model's quantize settings in the per-model flow: recipes per target, calibration, accuracy.

    load ─► export ─► quantize[recipe of target] ─► partition … emit ─► verify (accuracy)

``lower_model(quantize=..., calibration=..., min_sqnr=..., max_error=...)`` comes
here as a :class:`QuantSettings`.  Before any stage runs, :meth:`QuantSettings.calibrate`
finds the calibration data a static recipe needs (the ``calibration`` spec, else the
factory's own) and keeps it in this process by its digest; a static recipe without
any is an error naming the model, before export.  The quantize stage is keyed on
that digest (only when some target's recipe needs calibration: dynamic recipes are
never re-quantized because calibration data changed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tasks.calibration import FROM_FACTORY, as_batches, read_calibration, remember

from .manifest import recipes_by_target, with_qembedding


class CalibrationMissing(ValueError):
    """A static recipe and no calibration data; the message names the model."""


@dataclasses.dataclass(frozen=True)
class QuantSettings:
    #: Target -> recipe mapping (None: the target stays fp32).
    recipes: dict[str, Any]
    calibration: str | None = None
    min_sqnr: float | None = None
    max_error: float | None = None

    @classmethod
    def of(cls, quantize: Any, calibration: str | None, min_sqnr: float | None, max_error: float | None,
           targets: list[str]) -> "QuantSettings":
        """Settings from ``lower_model``'s parameters (validated as a manifest's are)."""
        recipes = recipes_by_target(quantize, targets) or {}
        return cls({t: recipes.get(t) for t in targets}, calibration, min_sqnr, max_error)

    @property
    def needs_calibration(self) -> bool:
        return any(r is not None and r["recipe"] == "int8" for r in self.recipes.values())

    def recipe(self, target: str) -> dict | None:
        return self.recipes.get(target)

    def calibrate(self, name: str, loaded) -> dict | None:
        """``{"digest", "source", "batches"}`` of the calibration data the recipes need
        (kept in this process for the quantize stage), None when none needs any."""
        if not self.needs_calibration:
            return None
        where = f"model {name!r}"
        if self.calibration is not None:
            batches, source = read_calibration(self.calibration, where), self.calibration
        elif getattr(loaded, "calibration", None) is not None:
            batches, source = as_batches(loaded.calibration, where), FROM_FACTORY
        else:
            raise CalibrationMissing(
                f"{where}: recipe int8 needs calibration data: return {{'module': ..., 'inputs': ..., "
                "'calibration': batches}} from the factory, or name it with 'calibration:' in the "
                "manifest (--calibration on the CLI)")
        return {"digest": remember(batches), "source": source, "batches": len(batches)}

    def thresholds(self) -> dict[str, float]:
        return {k: v for k, v in (("min_sqnr", self.min_sqnr), ("max_error", self.max_error)) if v is not None}


NO_QUANTIZATION = QuantSettings({})


def quantize_options(quantize: str | None, calibration: str | None, min_sqnr: float | None,
                     max_error: float | None, targets: list[str], qembedding: str | None = None) -> dict[str, Any]:
    """The CLI's ``--quantize`` (a recipe name or JSON), ``--qembedding``, ``--calibration``,
    ``--min-sqnr`` and ``--max-error`` as ``lower_model`` parameters, validated as a manifest's
    are; a ValueError naming the option otherwise."""
    import json

    from tasks.calibration import check_calibration_source

    out: dict[str, Any] = {}
    if quantize is not None:
        text = quantize.strip()
        try:
            value = json.loads(text) if text.startswith(("{", '"')) else text
        except json.JSONDecodeError as exc:
            raise ValueError(f"--quantize: not JSON: {exc}") from None
        out["quantize"] = recipes_by_target(value, targets, "--quantize")
    if qembedding is not None:
        if not out.get("quantize"):
            raise ValueError("--qembedding needs --quantize 8da4w (or int8-dynamic): the embedding tables are "
                             "quantized beside the linears")
        out["quantize"] = with_qembedding(out["quantize"], qembedding, "--qembedding")
    if calibration is not None:
        out["calibration"] = check_calibration_source(calibration, "--calibration")
    out.update({k: v for k, v in (("min_sqnr", min_sqnr), ("max_error", max_error)) if v is not None})
    if not out.get("quantize") and len(out) > ("quantize" in out):
        raise ValueError("--calibration, --min-sqnr and --max-error need --quantize")
    return {k: v for k, v in out.items() if v is not None}


def quantize_line(entry: dict) -> str:
    """``quantize int8: SQNR 38.5 dB, max error 1.07% against fp32 eager`` of a target's record."""
    from lowering.quantize import parse_recipe

    recipe = parse_recipe(entry["quantize"]["recipe"])
    checks = [c for c in ((entry.get("verify") or {}).get("checks") or []) if c.get("accuracy")]
    if not checks:
        return f"quantize {recipe}: not verified"
    accuracy = checks[0]["accuracy"]
    sqnr = "inf" if accuracy.get("sqnr_db") is None else f"{accuracy['sqnr_db']:.1f}"
    error = accuracy.get("max_error")
    return (f"quantize {recipe}: SQNR {sqnr} dB, max error "
            f"{'n/a' if error is None else f'{100 * error:.2f}%'} against fp32 eager")
