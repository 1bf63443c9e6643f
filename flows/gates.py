"""Gates: tonight's program is published only if it is as good as last night's.

    gates: {latency: 1.10, size: 1.05, error: 1.5, sqnr_drop_db: 1.0}

Per figure, the largest change allowed against the program published now for the same
model and target:

    latency        new / old median latency, both run interleaved in one process (benchmark stage)
    size           new / old program bytes: the ``.pte`` and its ``.ptd`` (external weights)
    error          new / old max |Δ| / max |fp32| of a quantized program (verify)
    sqnr_drop_db   old SQNR - new SQNR, dB (verify)

A program that fails a gate is not published: last night's ``.pte``, its manifest record
and its memory-plan picture stay as they are (byte-identical), the target is marked
``regressed`` with the figures, and the run fails like a failed lowering (exit 1, the
failure notification of a deployment).  ``accept_regressions`` publishes it anyway and
the record says ``accepted_regressions``.  A first lowering, or a program identical to
the published one, has nothing to compare and passes.

Settings (manifest: per entry, per target ``{xnnpack: {latency: 1.2}}``, or under
``defaults``; ``lower_model(gates=..., benchmark=..., accept_regressions=...)``):
:func:`gates_by_target`, :func:`benchmark_by_target`.
"""

from __future__ import annotations

from typing import Any, Mapping

from lowering.benchmark import BenchmarkSettings, host
from tasks.store import ArtifactRef

#: The figures a gate may limit.
GATE_FIGURES = ("latency", "size", "error", "sqnr_drop_db")


class Regressed(RuntimeError):
    """A program worse than the published one beyond a gate; ``figures`` has every ratio."""

    def __init__(self, failures: list[str], figures: dict[str, float]) -> None:
        super().__init__("; ".join(failures))
        self.figures = figures


def _per_target(value: Any, targets, settings: set[str]) -> dict[str, Any]:
    """``value`` for every target, or, a mapping none of whose keys is one of ``settings``,
    per target ``{target: value}`` (targets not named: None; names of targets this model
    does not lower, e.g. in ``defaults``, are ignored)."""
    if isinstance(value, Mapping) and value and not set(map(str, value)) & settings and all(map(_is_target, value)):
        return {t: value.get(t) for t in targets}
    return {t: value for t in targets}


def _is_target(name: Any) -> bool:
    from lowering.errors import BackendError
    from lowering.targets import check_target

    try:
        check_target(str(name))
    except BackendError:
        return False
    return True


def gates_by_target(value: Any, targets, where: str = "gates") -> dict[str, dict[str, float]] | None:
    """A ``gates`` setting as ``{target: {figure: limit}}`` (None: no gate).  ``value``:
    ``{latency: 1.1, ...}`` for every target, or per target ``{xnnpack: {...}}``."""
    if value is None:
        return None

    out: dict[str, dict[str, float]] = {}
    for target, gates in _per_target(value, targets, set(GATE_FIGURES)).items():
        if gates is None:
            continue
        if not isinstance(gates, Mapping):
            raise ValueError(f"{where}: expected a mapping of {list(GATE_FIGURES)} to limits, got {gates!r}")
        unknown = sorted(set(gates) - set(GATE_FIGURES))
        if unknown:
            raise ValueError(f"{where}: unknown gates {unknown}; allowed: {list(GATE_FIGURES)}")
        for figure, limit in gates.items():
            if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 0:
                raise ValueError(f"{where}: gate {figure!r} must be a number >= 0, got {limit!r}")
        out[target] = {k: float(v) for k, v in gates.items()}
    return out or None


def benchmark_by_target(value: Any, targets, where: str = "benchmark",
                        gated: Mapping[str, Any] | None = None) -> dict[str, dict | None]:
    """A ``benchmark`` setting as ``{target: settings dict or None (off)}``: true, false, a
    mapping of :class:`BenchmarkSettings` fields, or per target.  Not set (None): on for the
    targets that have gates (``gated``, :func:`gates_by_target`'s), whose figures need it."""
    out = {}
    for target, setting in _per_target(value, targets, set(BenchmarkSettings().to_dict())).items():
        if setting is None and value is None:
            setting = bool((gated or {}).get(target))
        try:
            settings = BenchmarkSettings.of(setting)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        out[target] = None if settings is None else settings.to_dict()
    return out


def gate_figures(previous: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, float]:
    """The changes of ``result`` (tonight's target record, with ``program_bytes``: its
    ``.pte`` and ``.ptd`` bytes) against ``previous`` (the published record), for the figures
    both have.  ``size`` counts a program's ``.pte`` and its ``.ptd`` (external weights)."""
    figures: dict[str, float] = {}
    old_size, new_size = program_bytes(previous), result.get("program_bytes")
    if old_size and new_size:
        figures["size"] = round(new_size / old_size, 4)
    latency = ((result.get("benchmark") or {}).get("ratios") or {}).get("latency")
    if latency:
        figures["latency"] = latency
    old, new = accuracy(previous), accuracy(result)
    if old.get("max_error") and new.get("max_error") is not None:
        figures["error"] = round(new["max_error"] / old["max_error"], 4)
    if old.get("sqnr_db") is not None and new.get("sqnr_db") is not None:
        figures["sqnr_drop_db"] = round(old["sqnr_db"] - new["sqnr_db"], 3)
    return figures


def accuracy(record: Mapping[str, Any]) -> dict[str, float]:
    """A target record's error against fp32 eager (quantized programs): the worst over its
    checks, ``{"max_error", "sqnr_db"}`` (empty for an fp32 program)."""
    errors, sqnrs = [], []
    for check in ((record.get("verify") or {}).get("checks") or []):
        quant = check.get("accuracy") or {}
        if quant.get("max_error") is not None:
            errors.append(float(quant["max_error"]))
        if quant.get("sqnr_db") is not None:
            sqnrs.append(float(quant["sqnr_db"]))
    return {**({"max_error": max(errors)} if errors else {}), **({"sqnr_db": min(sqnrs)} if sqnrs else {})}


def check_gates(name: str, target: str, figures: dict[str, float], gates: Mapping[str, float] | None) -> list[str]:
    """The lines of the gates ``figures`` fail: ``"latency ×1.42 > 1.10"``."""
    failures = []
    for figure, limit in (gates or {}).items():
        value = figures.get(figure)
        if value is None or value <= limit:
            continue
        shown = f"+{value:.2f} dB" if figure == "sqnr_drop_db" else f"×{value:.2f}"
        failures.append(f"{figure} {shown} > {limit:g}")
    return failures


class Publisher:
    """Publishes a target's program (``outputs/<model>/<target>.pte``) unless it fails a gate.

    ``gates``: ``{target: {figure: limit}}``; ``accept``: publish regressions anyway.  The
    published manifest of each model is read once (what tonight is compared with)."""

    def __init__(self, store, gates: dict | None = None, accept: bool = False,
                 benchmark: dict | None = None) -> None:
        self.store, self.gates, self.accept = store, gates or {}, accept
        self.benchmark = benchmark or {}
        self._published: dict[str, dict] = {}

    def published(self, name: str) -> dict:
        """The model's published manifest's targets (``{}`` on a first lowering)."""
        if name not in self._published:
            try:
                self._published[name] = dict(self.store.get_json(f"{name}/manifest.json").get("targets") or {})
            except Exception:  # none yet, or unreadable: nothing to compare with
                self._published[name] = {}
        return self._published[name]

    def previous(self, name: str, target: str) -> dict | None:
        """The published record of ``target`` whose program (and ``.ptd``) is still in outputs/ (None: none)."""
        record = self.published(name).get(target)
        if not record or not record.get("ok") or not record.get("pte"):
            return None
        files = [ArtifactRef(str(f["uri"]), str(f["sha256"]), int(f["size"]), kind)
                 for kind, f in ((k, record.get(k)) for k in ("pte", "ptd")) if f]
        return record if all(self.store.exists(ref) for ref in files) else None

    def previous_files(self, name: str, target: str, pte: ArtifactRef, ptd: ArtifactRef | None = None) -> dict:
        """The published program to benchmark tonight's against, ``{"previous": ref}`` and its
        ``"previous_ptd"`` when it has external weights: ``{}`` on a first lowering or when it
        is the same program (the same ``.pte`` and ``.ptd``: nothing to compare)."""
        record = self.previous(name, target)
        if record is None or not differs(record, pte, ptd):
            return {}
        files = {"previous": self._object(record["pte"], "pte")}
        if record.get("ptd"):
            files["previous_ptd"] = self._object(record["ptd"], "ptd")
        return files

    def _object(self, file: Mapping[str, Any], kind: str) -> ArtifactRef:
        return ArtifactRef(self.store.uri(self.store.object_path(file["sha256"])), file["sha256"], int(file["size"]), kind)

    def benchmarked(self, target: str) -> bool:
        """Whether the benchmark stage runs for ``target``."""
        return self.benchmark.get(target, BenchmarkSettings().to_dict()) is not None

    def benchmark_inputs(self, name: str, target: str, pte: ArtifactRef, ptd: ArtifactRef | None = None) -> dict | None:
        """The benchmark stage's settings, host, the program's ``.ptd`` and the previous program's
        files (None: benchmark off)."""
        if not self.benchmarked(target):
            return None
        return {"settings": self.benchmark.get(target, BenchmarkSettings().to_dict()), "host": host(),
                **({"ptd": ptd} if ptd is not None else {}), **self.previous_files(name, target, pte, ptd)}

    def __call__(self, name: str, target: str, pte: ArtifactRef, kind: str = "pte", result: dict | None = None,
                 data: ArtifactRef | None = None) -> dict:
        """Publish ``pte`` as ``target``'s program (``kind`` ``"ptd"``: its data), unless
        ``result`` (tonight's record; ``data``: its ``.ptd``) fails a gate against the published
        one: then raise :class:`Regressed`, publishing nothing."""
        previous = self.previous(name, target)
        if result is not None and previous is not None and differs(previous, pte, data):
            figures = gate_figures(previous, {**result, "program_bytes": pte.size + (data.size if data else 0)})
            result["change"] = figures
            failures = check_gates(name, target, figures, self.gates.get(target))
            if failures and not self.accept:
                result["regressed"] = figures
                raise Regressed(failures, figures)
            if failures:
                result["accepted_regressions"] = failures
        ref = self.store.publish_object(f"{name}/{target}.{kind}", pte, kind)
        return {"uri": ref.uri, "sha256": ref.sha256, "size": ref.size}


def differs(record: Mapping[str, Any], pte: ArtifactRef, ptd: ArtifactRef | None) -> bool:
    """Whether tonight's ``.pte`` (and ``.ptd``) differ from the published ``record``'s."""
    return record["pte"]["sha256"] != pte.sha256 or (record.get("ptd") or {}).get("sha256") != (ptd and ptd.sha256)


def program_bytes(record: Mapping[str, Any]) -> int:
    """A published record's program bytes: its ``.pte`` and its ``.ptd`` (external weights)."""
    return sum(int((record.get(kind) or {}).get("size") or 0) for kind in ("pte", "ptd"))
