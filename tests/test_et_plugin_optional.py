"""The core works without ExecuTorch: a real subprocess in which importing ``executorch``
fails lowers a portable program and runs it on lowerflow's runtime, and a target of the
optional plugin (lowering/backends/executorch/) is one line naming the extra, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: sitecustomize of the subprocess: every import of executorch (and find_spec) fails.
BLOCK = textwrap.dedent('''
    import sys

    class NoExecutorch:
        def find_spec(self, name, path=None, target=None):
            if name == "executorch" or name.startswith("executorch."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, NoExecutorch())
''')

PORTABLE = textwrap.dedent('''
    import sys
    import torch
    from examples.models import mlp
    from lowering import lower
    from lowering.runtime import load
    from lowering.targets import target_names

    model, inputs = mlp()
    out = load(lower(model, inputs).pte).method("forward").execute(list(inputs))[0]
    assert torch.allclose(out, model(*inputs), atol=1e-5)
    assert not any(m == "executorch" or m.startswith("executorch.") for m in sys.modules)
    print(" ".join(target_names()))
''')


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(BLOCK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_core_lowers_without_executorch_and_lists_the_plugin_targets(tmp_path):
    done = run(tmp_path, "-c", PORTABLE)
    assert done.returncode == 0, done.stderr[-2000:]
    assert {"portable", "xnnpack", "openvino", "vulkan", "coreml", "ethos-u", "qnn"} <= set(done.stdout.split())


def test_a_plugin_target_without_executorch_is_one_line_naming_the_extra(tmp_path):
    for target, extra in (("coreml", "lowerflow[executorch]"), ("openvino", "lowerflow[openvino]")):
        done = run(tmp_path, "-m", "flows.cli", "lower", "examples/models.py:mlp", "-t", target,
                   "--store", str(tmp_path / "store"))
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2, done.stderr[-2000:]
        assert len(errors) == 1 and extra in errors[0] and "executorch" in errors[0], errors
    assert not (tmp_path / "store").exists()  # refused before any work
