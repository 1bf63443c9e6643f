"""The demo: lower the demo fleet (``examples/fleet.yaml``) and show what came out.

    python -m examples.demo        # what ``./run demo`` runs

Runs the ``lower-fleet`` flow on Prefect's ephemeral server (nothing to start),
prints the fleet table and where the ``.pte`` files and reports are.  Run it
twice: the second run takes every stage from the cache.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: The demo fleet, found next to this file whatever the working directory.
FLEET = Path(__file__).resolve().parent / "fleet.yaml"


def main() -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    from flows.lower_fleet import FleetFailed, lower_fleet
    from flows.reports import fleet_text_table

    print(f"lowering the demo fleet {FLEET} ...", flush=True)
    try:
        summary = lower_fleet(str(FLEET))
    except FleetFailed as exc:
        summary = exc.summary
    print()
    print(fleet_text_table(summary))
    print()
    print(f"store: {summary['store']}")
    for name, manifest in summary["models"].items():
        for target, entry in manifest["targets"].items():
            if entry.get("pte"):
                print(f"  {name}/{target}: {entry['pte']['uri']}")
    print(f"reports: the 'lowerflow-fleet' and 'lowerflow-model-*' artifacts in Prefect, "
          f"memory-plan pictures under {summary['store']}/outputs/<model>/")
    if summary.get("failed"):
        print(f"FAILED: {', '.join(summary['failed'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
