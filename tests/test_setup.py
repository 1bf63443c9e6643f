"""Setup as a newcomer meets it (issue 22): ``./run demo`` installs only what the
product needs, and says what it is doing.

The demo environment is resolved by pip exactly as on a fresh machine
(``--ignore-installed``: nothing of this environment counts), without installing
anything: the oracle (executorch), the test models' library (transformers), the S3
server (moto) and pytest are not in it, and torch is the pinned 2.13.0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_environment_has_no_test_extra(tmp_path):
    report = tmp_path / "report.json"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
         "--report", str(report), "-e", str(ROOT)],
        check=True, capture_output=True, text=True,
    )
    installs = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert {"prefect", "fsspec", "flatbuffers", "lowerflow"} <= set(installs)
    assert installs["torch"].split("+")[0] == "2.13.0"
    test_only = {"executorch", "transformers", "moto", "pytest", "pytest-xdist"} & set(installs)
    assert not test_only, f"the demo environment would install {sorted(test_only)}"


def test_run_setup_says_what_it_does():
    """``./run setup`` prints a line per step on stderr (here: an environment that is up to date)."""
    venv = Path(sys.executable).parent.parent
    done = subprocess.run(["bash", str(ROOT / "run"), "setup", "test"], capture_output=True, text=True,
                          env={**os.environ, "LOWERFLOW_VENV": str(venv)}, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("setup: ")]
    assert lines, done.stderr
    assert lines[-1] in ("setup: done", f"setup: {venv} is up to date (test)"), lines
