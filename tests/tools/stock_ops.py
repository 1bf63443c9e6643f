"""Regenerate ``lowering/stock_ops/stock_ops.json``: the operators the stock ExecuTorch
runtime registers, from the ``executorch`` installed here (a test-time tool: the product
never imports ExecuTorch).

    python tests/tools/stock_ops.py           # rewrite the table
    python tests/tools/stock_ops.py --check   # exit 1 if the committed table is stale

One fresh interpreter reads ``Runtime.get().operator_registry.operator_names`` three
times: after ``import executorch.runtime`` (the portable kernels and the prim ops: the
set "portable"), after ``import executorch.kernels.quantized`` (new names: "quantized"),
after ``import executorch.extension.llm.custom_ops.custom_ops`` (new names: "llm").
A fresh process, because whatever else a process imported may have registered more.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from lowering.stock_ops.table import LIBRARIES, OPTIONAL_SETS, TABLE_PATH as TABLE  # noqa: E402

_CHILD = """
import importlib, importlib.metadata, json, sys
runtime = importlib.import_module("executorch.runtime").Runtime.get()
seen = set(runtime.operator_registry.operator_names)
sets = {"portable": sorted(seen)}
for name, module in json.loads(sys.argv[1]).items():
    importlib.import_module(module)
    names = set(runtime.operator_registry.operator_names)
    sets[name] = sorted(names - seen)
    seen |= names
print(json.dumps({"executorch": importlib.metadata.version("executorch"), "sets": sets}))
"""


def registered_table() -> dict:
    """``{"executorch": version, "sets": {set name: sorted operator names}}`` of the
    installed ExecuTorch, read in a fresh interpreter."""
    libraries = {name: LIBRARIES[name] for name in OPTIONAL_SETS}
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(libraries)], capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"reading ExecuTorch's operator registry failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table_text(table: dict) -> str:
    """The committed form: sorted keys, one operator per line."""
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = table_text(registered_table())
    if argv[:1] == ["--check"]:
        stale = TABLE.read_text(encoding="utf-8") != text
        print(f"{TABLE.relative_to(ROOT)}: {'stale: run python tests/tools/stock_ops.py' if stale else 'up to date'}")
        return 1 if stale else 0
    TABLE.write_text(text, encoding="utf-8")
    print(f"wrote {TABLE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
