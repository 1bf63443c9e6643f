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

from .manifest import recipes_by_target


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
