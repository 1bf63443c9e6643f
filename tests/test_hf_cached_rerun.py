"""Issue 27: a fully cached rerun of an hf: model hashes its files and imports neither
transformers (its description is remembered in the store, keyed by its config files'
digests, options, transformers' and lowerflow's versions: ``tasks.hf_spec.describe``) nor
Prefect (``flows.lower_model.lower_cached``), and publishes the same bytes; a changed
``config.json`` is not a stale hit.  A tiny random Llama, portable, verify off.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]

#: ``lowerflow ARGS`` in a fresh interpreter, then which of the packages it imported.
WRAPPER = """
import json, sys
from flows.cli import main
code = main(sys.argv[1:])
print("IMPORTED", json.dumps({p: any(m == p or m.startswith(p + ".") for m in sys.modules)
                              for p in ("transformers", "prefect")}))
sys.exit(code)
"""


@pytest.fixture
def tiny_llama(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, bos_token_id=1, eos_token_id=2))
    model.eval().save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def lower_args(directory: Path, store: Path, output: Path) -> list[str]:
    return ["lower", f"hf:{directory}", "--task", "text-generation", "--max-seq-len", "16", "-t", "portable",
            "--verify", "off", "--store", str(store), "-o", str(output)]


def fresh_process(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """``lowerflow ARGS`` in a new interpreter with no Prefect API server configured."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    done = subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("IMPORTED ")]
    return done, json.loads(lines[-1].removeprefix("IMPORTED ")) if lines else {}


def eos_ids(pte: Path) -> list[int]:
    from lowering.runtime import load

    return list(load(pte.read_bytes()).run("get_eos_ids", []))


def test_a_cached_rerun_imports_neither_transformers_nor_prefect_and_a_changed_config_is_no_stale_hit(
        cli, prefect_api, tiny_llama, tmp_path):
    store = tmp_path / "store"
    code, out, errors = cli(*lower_args(tiny_llama, store, tmp_path / "cold.pte"))
    assert code == 0, (out, errors)
    memos = sorted((store / "memo").iterdir())
    assert len(memos) == 1 and memos[0].name.startswith("hf-description-"), memos

    done, imported = fresh_process(lower_args(tiny_llama, store, tmp_path / "warm.pte"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "export[forward]     cached" in done.stdout, done.stdout
    assert (tmp_path / "warm.pte").read_bytes() == (tmp_path / "cold.pte").read_bytes()
    assert imported["transformers"] is False, imported

    # The eos token changes in config.json alone: a new description (and program), not the remembered one.
    config = json.loads((tiny_llama / "config.json").read_text())
    (tiny_llama / "config.json").write_text(json.dumps({**config, "eos_token_id": 3}))
    (tiny_llama / "generation_config.json").unlink()
    code, out, errors = cli(*lower_args(tiny_llama, store, tmp_path / "changed.pte"))
    assert code == 0, (out, errors)
    assert "export[forward]     ran" in out, out
    assert len(list((store / "memo").iterdir())) == 2
    assert hashlib.sha256((tmp_path / "changed.pte").read_bytes()).digest() != \
        hashlib.sha256((tmp_path / "cold.pte").read_bytes()).digest()
    assert eos_ids(tmp_path / "changed.pte") == [3] and eos_ids(tmp_path / "cold.pte") == [2]


def test_a_remembered_description_fingerprints_the_model_as_describing_it_from_its_config(tiny_llama, tmp_path):
    """The memo changes no key: the description and fingerprints read back from the store
    are the ones made from the config (and without a memo)."""
    from tasks.hf_spec import describe
    from tasks.store import ArtifactStore

    options = {"hf": {"task": "text-generation", "max_seq_len": 16}}
    store = ArtifactStore(str(tmp_path / "store"))
    plain = describe(str(tiny_llama), options)
    first = describe(str(tiny_llama), options, store)  # a miss: described from the config, remembered
    again = describe(str(tiny_llama), options, store)  # a hit
    for described, methods, whole in (first, again):
        assert described == plain[0]
        assert {k: v.digest for k, v in methods.items()} == {k: v.digest for k, v in plain[1].items()}
        assert whole.digest == plain[2].digest
    other = describe(str(tiny_llama), {"hf": {"task": "text-generation", "max_seq_len": 8}}, store)
    assert other[0].constants["get_max_seq_len"] == 8
    assert len(list((tmp_path / "store" / "memo").iterdir())) == 2
