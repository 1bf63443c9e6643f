"""The ``verify`` option of a model: which check each target's verify stage runs.

    verify: true | auto       full for a small model, quick above lowering.verify.QUICK_ABOVE_BYTES (the default)
    verify: full | quick      every target
    verify: false | off       no verify stage
    verify: {xnnpack: quick, portable: full}     per target (a target left out: auto)

``full`` runs :func:`lowering.verify.verify` (every input set, twice, in each runtime);
``quick`` runs :func:`lowering.verify.verify_quick` (a decoder: one prefill and a few
decode steps on one loaded program against eager with its own KV cache).  The verify
stage's cache key holds the mode only when it is ``quick`` (:data:`tasks.stages.STAGE_OPTIONAL`),
so the keys of full verifies are those of before the option existed.
"""

from __future__ import annotations

from typing import Any, Mapping

#: What a model's or a target's ``verify`` may say (besides true / false): lowering.verify's
#: VERIFY_MODES and AUTO, spelled here so the CLI's parser does not import torch.
MODES = ("full", "quick", "off", "auto")
#: What ``lowerflow verify --verify`` may say: a check to run (``off`` would run nothing).
CHECK_MODES = ("full", "quick", "auto")


def check_verify(value: Any, targets, where: str = "verify") -> Any:
    """``value`` (true/false, a mode, or ``{target: either}``) checked; ValueError naming
    ``where`` and the value otherwise.  Returns it with per-target modes as a plain dict."""
    if isinstance(value, Mapping):
        stray = sorted(set(map(str, value)) - set(targets))
        if stray:
            raise ValueError(f"{where}: modes for targets not lowered: {stray}")
        return {str(target): _one(mode, f"{where}: {target}") for target, mode in value.items()}
    return _one(value, where)


def _one(value: Any, where: str) -> Any:
    if isinstance(value, bool) or value in MODES:
        return value
    raise ValueError(f"{where}: {value!r} is not true, false or one of {list(MODES)}")


def target_mode(verify: Any, target: str, weight_bytes: int | None) -> str:
    """The check ``target`` runs: ``full``, ``quick`` or ``off`` (``auto``: by the model's
    ``weight_bytes``, :func:`lowering.verify.resolve_mode`)."""
    from lowering.verify import AUTO, resolve_mode

    if isinstance(verify, Mapping):
        verify = verify.get(target, AUTO)
    return resolve_mode(verify, weight_bytes)


def stage_mode(mode: str) -> dict[str, str]:
    """The verify stage's ``mode`` argument for ``mode``: none for full (its default, left
    out of the key), ``{"mode": "quick"}`` for quick."""
    return {} if mode == "full" else {"mode": mode}
