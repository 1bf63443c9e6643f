"""What a model run publishes beside the previous run's: outputs/<model>/manifest.json.

- :func:`unpublish_failed`: a target that failed now loses its stale ``.pte`` (one a gate
  refused keeps last night's: flows/gates.py);
- :func:`keep_published`: targets lowered earlier (and still valid) keep their record;
- :func:`changed_since_last`: what changed since the previous manifest (fingerprint parts,
  ``quantize``, ``calibration``);
- :func:`device_updates`: per target with external weights, what a device downloads for
  this run's update (the ``.ptd`` only while the ``.pte`` is unchanged).
"""

from __future__ import annotations

from tasks.fingerprint import Fingerprint


def unpublish_failed(store, manifest: dict) -> None:
    """Remove what an earlier run published for each target that failed now: outputs/
    holds the latest run's programs only, never a stale one beside a failed manifest."""
    from flows.reports import plan_image_name

    for target, result in manifest["targets"].items():
        if not result["ok"] and not result.get("regressed"):  # a gate's refusal keeps last night's
            remove_program(store, manifest["name"], target)
            store.remove_named(plan_image_name(manifest["name"], target))


def keep_published(store, manifest: dict) -> None:
    """Targets of the model's published manifest that this run did not lower (``lowerflow
    lower -t portable`` after a fleet published portable and reference) stay in it while
    their ``.pte`` stays in outputs/: a published program always has its record.

    A record is kept only for the same model (same fingerprint): the ``.pte`` of a model
    that changed since is stale, and is removed from outputs/ with its record (as a
    failed target's is, :func:`unpublish_failed`).  The kept record says
    ``"kept_from"``: the flow run that lowered it.
    """
    from flows.reports import plan_image_name
    from tasks.store import ArtifactRef

    try:
        previous = store.get_json(f"{manifest['name']}/manifest.json")
    except Exception:  # none yet (or unreadable): nothing to keep
        return
    same_model = (previous.get("fingerprint") or {}).get("digest") == (manifest.get("fingerprint") or {}).get("digest")
    for target, record in (previous.get("targets") or {}).items():
        pte = (record or {}).get("pte")
        if target in manifest["targets"] or not pte:
            continue
        if not store.exists(ArtifactRef(str(pte["uri"]), str(pte["sha256"]), int(pte["size"]), "pte")):
            continue  # its program is gone (or was replaced): nothing published to keep a record of
        if same_model and record.get("ok"):
            manifest["targets"][target] = {**record, "kept_from": record.get("kept_from") or previous.get("flow_run")}
        else:
            remove_program(store, manifest["name"], target)
            store.remove_named(plan_image_name(manifest["name"], target))


def remove_program(store, name: str, target: str) -> None:
    """Remove a target's published program: its ``.pte`` and the ``.ptd`` it may need."""
    store.remove_named(f"{name}/{target}.pte")
    store.remove_named(f"{name}/{target}.ptd")


def changed_since_last(store, manifest: dict) -> list[str] | None:
    """Which fingerprint parts (weights, code, attributes, inputs, options) differ from the
    model's previous manifest in the store; None on a first lowering."""
    if "fingerprint" not in manifest:
        return None
    try:
        previous = store.get_json(f"{manifest['name']}/manifest.json")
    except Exception:  # no previous manifest (or an unreadable one): nothing to compare
        return None
    changed = Fingerprint.changed(previous.get("fingerprint"), manifest["fingerprint"])
    if changed is None:
        return None
    return changed + quantize_changes(previous, manifest)


def device_updates(store, manifest: dict) -> None:
    """Set ``update`` on every published target with a ``.ptd``: ``program`` ``"unchanged"``
    (the ``.pte`` has the previous manifest's sha256: a device keeps it), ``"changed"`` or
    ``"new"``; ``download_bytes`` (the ``.ptd``, plus the ``.pte`` unless unchanged) against
    ``whole_bytes`` (both files: what shipping the whole program costs)."""
    try:
        previous = store.get_json(f"{manifest['name']}/manifest.json")
    except Exception:  # a first lowering (or an unreadable manifest): every program is new
        previous = {}
    for target, entry in manifest["targets"].items():
        pte, ptd = entry.get("pte"), entry.get("ptd")
        if not entry.get("ok") or not pte or not ptd:
            continue
        before = ((previous.get("targets") or {}).get(target) or {}).get("pte") or {}
        program = "new" if not before else ("unchanged" if before.get("sha256") == pte["sha256"] else "changed")
        entry["update"] = {"program": program,
                           "download_bytes": int(ptd["size"]) + (0 if program == "unchanged" else int(pte["size"])),
                           "whole_bytes": int(ptd["size"]) + int(pte["size"])}


def quantize_changes(previous: dict, manifest: dict) -> list[str]:
    """``quantize`` when a target's recipe differs from the previous manifest's, ``calibration``
    when the calibration data (its digest) does."""
    def recipes(m: dict) -> dict:
        return {t: (r.get("quantize") or {}).get("recipe") for t, r in (m.get("targets") or {}).items()}

    before, after = recipes(previous), recipes(manifest)
    changes = []
    if any(before.get(t) != after[t] for t in after if t in before):
        changes.append("quantize")
    old, new = (previous.get("calibration") or {}).get("digest"), (manifest.get("calibration") or {}).get("digest")
    if old and new and old != new:
        changes.append("calibration")
    return changes
