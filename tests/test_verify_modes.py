"""Issue 27: verify proportionate to the model, and an hf: model that loads only when a stage needs it.

- ``verify: full | quick | off`` (``auto``, the default: quick above
  :data:`lowering.verify.QUICK_ABOVE_BYTES` of weights).  Quick runs a decoder's prefill
  and a few decode steps on one loaded program of each runtime against eager with its
  own KV cache; it fails a program of other weights; full still runs every input set;
  off runs no verify stage.  The mode is in the verify stage's key only when quick.
- A fully cached rerun of an ``hf:`` model hashes its files and reads its config but
  never calls ``from_pretrained`` (:data:`tasks.model_spec.HF_LOADS`), and its
  fingerprints are those the loaded model gives.

Models: a tiny random-weight Llama ``save_pretrained`` directory (and one of other weights).
"""

from __future__ import annotations

import gc
import json
import shutil
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("executorch.runtime")

import lowering.verify  # noqa: E402
from lowering import lower  # noqa: E402
from lowering.backends.xnnpack import XnnpackPartitioner  # noqa: E402
from lowering.export import export  # noqa: E402
from lowering.hf import load_hf  # noqa: E402
from lowering.quantize import quantize  # noqa: E402
from lowering.quantize.dynamic import dequantized_weights  # noqa: E402
from lowering.verify import QUICK_ABOVE_BYTES, resolve_mode, verify, verify_quick  # noqa: E402

MAX_SEQ_LEN = 16  # the quick check's prefill (8) and 3 decode steps fit
TASK = {"task": "text-generation", "max_seq_len": MAX_SEQ_LEN}


def _llama(directory, seed):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2))
    model.eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """Two tiny Llama directories of one config, other weights."""
    root = tmp_path_factory.mktemp("llamas")
    return _llama(root / "llama", 0), _llama(root / "other", 1)


@pytest.fixture(scope="module")
def ptes(llamas, tmp_path_factory):
    """Each directory's text-generation program (portable), as a file."""
    root = tmp_path_factory.mktemp("ptes")
    out = []
    for directory in llamas:
        path = root / f"{directory.name}.pte"
        path.write_bytes(lower(load_hf(str(directory), "text-generation", max_seq_len=MAX_SEQ_LEN).lower_input()).pte)
        out.append(path)
    return out


@pytest.fixture(scope="module")
def lowered_store(prefect_api, llamas, tmp_path_factory):
    """A store where the flow lowered ``llamas[0]`` to portable and xnnpack (verify auto: full),
    and that run's manifest: the cold run the flow's tests start from (what they run besides
    adds records of other keys: quick verify of xnnpack here, of portable on a copy)."""
    from flows.lower_model import lower_model as run_model

    store = tmp_path_factory.mktemp("lowered") / "store"
    return store, run_model(f"hf:{llamas[0]}", ["portable", "xnnpack"], str(store), hf=dict(TASK))


@pytest.fixture(scope="module")
def exported(llamas):
    """The exported forward of ``llamas[0]`` (each test quantizes a copy of it)."""
    module, inputs, dims = _forward(llamas[0])
    return export(module, inputs, dynamic_shapes=dims)


def _forward(directory):
    module, inputs, dims = load_hf(str(directory), "text-generation", max_seq_len=MAX_SEQ_LEN).methods["forward"]
    return module, inputs, dims


def test_quick_runs_prefill_then_decode_steps_on_both_runtimes_and_leaves_the_cache_as_it_was(llamas, ptes):
    module, inputs, _ = _forward(llamas[0])
    before = {name: buffer.clone() for name, buffer in module.named_buffers()}
    report = verify_quick(ptes[0], module, inputs, lowerflow=True)
    assert report.ok, report.to_dict()
    assert {c.runtime for c in report.checks} == {"lowerflow", "executorch"}
    assert all(c.inputs == "quick: 4 calls" and c.ok for c in report.checks)  # prefill + 3 decode steps
    calls = module.quick_calls(8, 3)
    assert [tuple(ids.shape) for ids, _ in calls] == [(1, 8), (1, 1), (1, 1), (1, 1)]
    assert [int(pos[0]) for _, pos in calls] == [0, 8, 9, 10]
    assert all(torch.equal(buffer, before[name]) for name, buffer in module.named_buffers())
    # the decode steps read the cache the prefill wrote: a decode step alone gives other logits
    with torch.no_grad():
        alone = module(*calls[1])
        with torch.no_grad():
            for buffer in module.buffers():
                buffer.zero_()
        module(*calls[0])
        after_prefill = module(*calls[1])
    assert not torch.allclose(alone, after_prefill)


def test_quick_fails_a_program_of_other_weights_and_full_still_runs_every_input_set(llamas, ptes):
    module, inputs, dims = _forward(llamas[0])
    wrong = verify_quick(ptes[1], module, inputs)  # bytes or path: the other model's program
    assert wrong.ok is False
    assert all(c.ok is False and "differ from eager" in c.error for c in wrong.checks if c.skipped is None)
    full = verify(ptes[0], module, inputs, dynamic_shapes=dims)  # a path too
    assert full.ok, full.to_dict()
    assert {c.inputs for c in full.checks} == {"example", "seq_length_dim=1", f"seq_length_dim={MAX_SEQ_LEN - 1}"}
    assert verify(ptes[1].read_bytes(), module, inputs, dynamic_shapes=dims).ok is False


def test_quick_lets_the_quantized_reference_go_before_the_runtimes_run(llamas, exported, monkeypatch):
    """A quantized program's quick check runs its reference (and the nudged one) in torch,
    then the runtimes: the reference's weights are freed before ExecuTorch's runtime loads
    the program (issue 27: Qwen2.5-0.5B 8da4w held them, 1.2 GB, beside the runtime)."""
    module, inputs, _ = _forward(llamas[0])
    program = quantize(exported, "8da4w")  # a copy: the export stays as it was
    pte = lower(program, partitioner=XnnpackPartitioner()).pte
    weights = [weakref.ref(t) for t in program.constants.values() if t.dtype == torch.int8]
    assert weights
    alive_at_runtime = []
    check = lowering.verify._executorch_sequence_check

    def runtime_check(*args, **kwargs):
        alive_at_runtime.append(sum(ref() is not None for ref in weights))
        return check(*args, **kwargs)

    monkeypatch.setattr(lowering.verify, "_executorch_sequence_check", runtime_check)
    holder = [program]
    del program
    gc.disable()  # only what verify_quick frees itself counts
    try:
        report = verify_quick(pte, module, inputs, reference=holder.pop())
    finally:
        gc.enable()
    assert report.ok, report.to_dict()
    assert alive_at_runtime == [0]


def test_a_references_weights_are_dequantized_once_and_it_computes_the_same(llamas, exported):
    """verify's quantized reference runs on several calls with its weights dequantized once
    (no dequantize of constant data left in the graph), bit-identical to dequantizing at every call."""
    module, _, _ = _forward(llamas[0])
    program = quantize(exported, "8da4w")
    plain, folded = program.module(), dequantized_weights(program.module())

    def dequantizes(graph_module):
        return [n for n in graph_module.graph.nodes
                if n.op == "call_function" and n.target.__name__.startswith("dequantize")]

    assert len(dequantizes(folded)) < len(dequantizes(plain))
    assert all(any(a.op != "get_attr" for a in n.all_input_nodes) for n in dequantizes(folded))  # activations'
    calls = module.quick_calls(8, 3)
    with torch.no_grad():
        for each in calls:
            assert torch.equal(plain(*each), folded(*each))


def test_auto_is_full_for_a_small_model_and_quick_above_the_threshold():
    from flows.verify_mode import MODES
    from lowering.verify import AUTO, VERIFY_MODES

    assert MODES == (*VERIFY_MODES, AUTO)
    assert resolve_mode(True, 1000) == resolve_mode("auto", QUICK_ABOVE_BYTES) == "full"
    assert resolve_mode(None, QUICK_ABOVE_BYTES + 1) == resolve_mode("auto", 539_000_000) == "quick"
    assert resolve_mode(True, None) == "full" and resolve_mode(False, 10**12) == "off"
    assert resolve_mode("full", 10**12) == "full" and resolve_mode("quick", 10) == "quick"
    with pytest.raises(ValueError, match="'fast' is not one of"):
        resolve_mode("fast", 10)


def _verify_record(manifest, target="portable"):
    return [r for r in manifest["targets"][target]["stages"] if r["stage"] == "verify"]


def test_the_flow_runs_the_mode_asked_for_and_keys_it_only_when_quick(prefect_api, llamas, lowered_store, tmp_path):
    from flows.lower_model import lower_model as run_model

    store = str(shutil.copytree(lowered_store[0], tmp_path / "store"))  # the cold run's: verify auto
    model = f"hf:{llamas[0]}"
    full = run_model(model, ["portable"], store, hf=dict(TASK))  # verify=True: auto, a tiny model: full
    [full_record] = _verify_record(full)
    report = full["targets"]["portable"]["verify"]
    assert report["ok"] and "mode" not in json.dumps(report["checks"][0]) and len(report["checks"]) >= 6
    explicit = run_model(model, ["portable"], store, hf=dict(TASK), verify="full")
    [again] = _verify_record(explicit)
    assert again["key"] == full_record["key"] and again["cached"]
    quick = run_model(model, ["portable"], store, hf=dict(TASK), verify={"portable": "quick"})
    [quick_record] = _verify_record(quick)
    assert quick_record["key"] != full_record["key"] and not quick_record["cached"]
    checks = quick["targets"]["portable"]["verify"]["checks"]
    assert quick["targets"]["portable"]["verify"]["ok"] and {c["inputs"] for c in checks} == {"quick: 4 calls"}
    off = run_model(model, ["portable"], store, hf=dict(TASK), verify="off")
    assert _verify_record(off) == [] and off["targets"]["portable"]["ok"]
    with pytest.raises(ValueError, match="'sometimes' is not true, false or one of"):
        run_model(model, ["portable"], store, hf=dict(TASK), verify="sometimes")


def test_a_bad_verify_mode_is_exit_2_on_lower_and_fleet_and_a_bad_manifest(cli, llamas, tmp_path):
    code, _, errors = cli("lower", f"hf:{llamas[0]}", "--task", "text-generation", "--verify", "fast",
                          "--store", tmp_path / "store")
    assert code == 2 and len(errors) == 1 and "--verify: invalid choice: 'fast'" in errors[0]
    manifest = tmp_path / "fleet.yaml"
    manifest.write_text(f"store: ./store\nmodels:\n  - {{model: 'hf:{llamas[0]}', task: text-generation}}\n")
    code, _, errors = cli("fleet", manifest, "--verify", "maybe")
    assert code == 2 and "--verify: invalid choice: 'maybe'" in errors[0]
    manifest.write_text(f"store: ./store\nmodels:\n  - {{model: 'hf:{llamas[0]}', task: text-generation, "
                        "verify: {portable: sometimes}}\n")
    code, _, errors = cli("fleet", manifest)
    assert code == 2 and "models[0]: 'verify': portable: 'sometimes' is not true, false" in errors[0]
    assert not (tmp_path / "store").exists()


def test_lower_and_fleet_take_verify_modes(cli, prefect_api, llamas, tmp_path):
    code, out, errors = cli("lower", f"hf:{llamas[0]}", "--task", "text-generation", "--max-seq-len", MAX_SEQ_LEN,
                            "--verify", "off", "--store", tmp_path / "store", "-o", tmp_path / "off.pte")
    assert code == 0 and "verify[forward]" not in out, (out, errors)
    manifest = tmp_path / "fleet.yaml"
    manifest.write_text(f"store: ./store\nmodels:\n  - {{model: 'hf:{llamas[0]}', task: text-generation, "
                        f"max_seq_len: {MAX_SEQ_LEN}, verify: off}}\n")
    code, out, errors = cli("fleet", manifest, "--verify", "quick")
    assert code == 0, (out, errors)
    report = json.loads((tmp_path / "store" / "outputs" / "llama" / "manifest.json").read_text())
    verified = report["targets"]["portable"]["verify"]
    assert verified["ok"] and {c["inputs"] for c in verified["checks"]} == {"quick: 4 calls"}


def test_lowerflow_verify_runs_the_mode_asked_for(cli, llamas, ptes):
    """``lowerflow verify --verify quick`` runs the quick check (one sequence of calls per
    method; constant methods still checked) and fails a program of other weights; ``auto``
    (the default) is full for this tiny model: every input set; ``off`` is not a check."""
    spec = f"hf:{llamas[0]}"
    args = ("--model", spec, "--task", "text-generation", "--max-seq-len", MAX_SEQ_LEN)
    code, out, errors = cli("verify", ptes[0], *args, "--verify", "quick")
    assert code == 0, (out, errors)
    forward = [line for line in out.splitlines() if line.startswith("forward ")]
    assert forward and all(line.endswith("(quick: 4 calls)") and " ok " in line for line in forward), out
    assert {line.split()[1] for line in forward} == {"lowerflow", "executorch"}
    assert "get_max_seq_len lowerflow   ok" in out
    code, out, errors = cli("verify", ptes[1], *args, "--verify", "quick")
    assert code == 1 and "MISMATCH" in out and "(quick: 4 calls)" in out
    assert errors == [f"lowerflow: error: {ptes[1]} does not match {spec} in lowerflow (forward), "
                      "executorch (forward)"], errors
    code, auto, _ = cli("verify", ptes[0], *args)
    assert code == 0 and "quick" not in auto and f"(seq_length_dim={MAX_SEQ_LEN - 1})" in auto
    assert auto == cli("verify", ptes[0], *args, "--verify", "full")[1]
    code, _, errors = cli("verify", ptes[0], *args, "--verify", "off")
    assert code == 2 and "--verify: invalid choice: 'off'" in errors[0]


def test_the_plan_lists_verify_only_where_it_runs(cli, prefect_api, llamas, tmp_path):
    """``lowerflow plan``: a target whose verify is off lists no verify stage, whether the
    first miss is the export (nothing cached) or a stage after it (export cached)."""
    from tests.test_validation import MODELS

    manifest = tmp_path / "fleet.yaml"
    manifest.write_text(f"store: ./store\nmodels:\n"
                        f"  - {{model: 'hf:{llamas[0]}', task: text-generation, max_seq_len: {MAX_SEQ_LEN}, "
                        "targets: [portable, xnnpack], verify: {portable: 'off'}}\n"
                        f"  - {{name: mlp, model: '{MODELS}:mlp', verify: false}}\n")

    def rows():
        code, out, errors = cli("plan", manifest)
        assert code == 0 and not errors, (out, errors)
        return {tuple(line.split()[:2]): line.split(None, 3)[3] for line in out.splitlines()[2:5]}

    cold = rows()
    assert cold[("llama", "portable")] == "export[forward], memory_plan, emit_methods"
    assert cold[("llama", "xnnpack")].startswith("export[forward], partition") and cold[("llama", "xnnpack")].endswith(
        "emit_methods, verify")
    assert cold[("mlp", "portable")] == "export, memory_plan, emit"
    code, out, errors = cli("lower", f"hf:{llamas[0]}", "--task", "text-generation", "--max-seq-len", MAX_SEQ_LEN,
                            "-t", "xnnpack", "--verify", "off", "--store", tmp_path / "store", "-o", tmp_path / "x.pte")
    assert code == 0, (out, errors)
    warm = rows()
    assert warm[("llama", "portable")] == "memory_plan[forward], emit_methods"
    assert warm[("llama", "xnnpack")] == "verify[forward]", warm


# --------------------------------------------------------------------------- hf: loads lazily


def test_a_cached_rerun_of_an_hf_model_never_loads_it(prefect_api, llamas, tmp_path):
    from flows.lower_model import lower_model as run_model
    from tasks.model_spec import HF_LOADS, ModelSpec

    directory = tmp_path / "llama"
    shutil.copytree(llamas[0], directory)
    key = ModelSpec.parse(f"hf:{directory}").key_text
    store = str(tmp_path / "store")
    cold = run_model(f"hf:{directory}", ["portable", "xnnpack"], store, hf=dict(TASK))
    assert HF_LOADS[key] == 1  # export and verify of both targets: one load
    warm = run_model(f"hf:{directory}", ["portable", "xnnpack"], store, hf=dict(TASK))
    assert HF_LOADS[key] == 1
    assert all(r["cached"] for t in warm["targets"].values() for r in t["stages"])
    assert warm["fingerprint"] == cold["fingerprint"]
    assert warm["targets"]["xnnpack"]["pte"] == cold["targets"]["xnnpack"]["pte"]
    # new weights: the export runs again, and so the model loads
    _llama(directory, 2)
    changed = run_model(f"hf:{directory}", ["portable"], store, hf=dict(TASK), verify="off")
    assert HF_LOADS[key] == 2 and changed["fingerprint"]["parts"]["weights"] != cold["fingerprint"]["parts"]["weights"]


#: ``lowerflow ARGS`` in a fresh interpreter, then whether Prefect's server module was imported
#: (what starting its ephemeral server takes) and whether a flow ran.
_LOWER_AND_TELL = """
import sys
from flows.cli import main
code = main(sys.argv[1:])
print("server imported:", "prefect.server.api.server" in sys.modules)
sys.exit(code)
"""


def test_a_cached_rerun_with_no_api_server_starts_none_and_publishes_the_same(prefect_api, llamas, lowered_store,
                                                                              tmp_path):
    """``lowerflow lower`` with no PREFECT_API_URL: a rerun whose stages all hit the cache runs
    without a flow run (flows.lower_model.lower_cached), so Prefect's ephemeral server is never
    started; it writes the same .pte and manifest (``flow_run`` None).  A miss still runs the flow."""
    import os
    import subprocess
    import sys

    from tests.test_cli import REPO

    store, cold = lowered_store  # the flow's run on the test's API server (its own store: the same URIs)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LOWERFLOW_"))}
    env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(tmp_path / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")

    def lower(*extra):
        args = ["lower", f"hf:{llamas[0]}", "--task", "text-generation", "--max-seq-len", str(MAX_SEQ_LEN),
                "-t", "xnnpack", "--store", str(store), "-o", str(tmp_path / "out.pte"), *extra]
        result = subprocess.run([sys.executable, "-c", _LOWER_AND_TELL, *args], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    out = lower()
    assert "server imported: False" in out and "verify[forward]     cached" in out, out
    assert (tmp_path / "out.pte").read_bytes() == (store / "outputs" / "llama" / "xnnpack.pte").read_bytes()
    manifest = json.loads((store / "outputs" / "llama" / "manifest.json").read_text())
    assert manifest["flow_run"] is None and manifest["fingerprint"] == cold["fingerprint"]
    assert manifest["targets"]["xnnpack"]["pte"] == cold["targets"]["xnnpack"]["pte"]
    assert all(r["cached"] for r in manifest["targets"]["xnnpack"]["stages"])
    out = lower("--verify", "quick")  # verify quick is not cached: the flow runs it
    assert "server imported: True" in out and "verify[forward]     ran" in out, out


@pytest.mark.parametrize("task, options", [
    ("text-generation", {"max_seq_len": MAX_SEQ_LEN}),
    ("text-generation", {"attn": "standard", "last_token_logits": True}),
    ("automatic-speech-recognition", {}),
    ("fill-mask", {"max_seq_len": 16}),
    ("image-classification", {}),
])
def test_the_fingerprint_without_loading_is_the_loaded_models(task, options, llamas, tmp_path):
    """What the flow keys an hf: model on, read from its files and config alone, equals what
    loading it gives (tasks.hf_spec.load: how every hf: model was fingerprinted before)."""
    from tasks.hf_spec import describe, load

    directory = llamas[0] if task == "text-generation" else _other_family(task, tmp_path)
    load_options = {"version": None, "hf": {"task": task, **options}}
    program, methods, whole = load(str(directory), load_options)
    described, described_methods, described_whole = describe(str(directory), load_options)
    assert described_whole.digest == whole.digest
    assert {m: f.digest for m, f in described_methods.items()} == {m: f.digest for m, f in methods.items()}
    assert described.constants == program.constants and tuple(program.methods) == described.method_names


def _other_family(task, tmp_path):
    torch.manual_seed(0)
    if task == "automatic-speech-recognition":
        model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
            vocab_size=128, num_mel_bins=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
            max_target_positions=32, decoder_start_token_id=1, eos_token_id=2, pad_token_id=0, bos_token_id=1))
    elif task == "fill-mask":
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64))
    else:
        model = transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, num_labels=5))
    model.eval().save_pretrained(tmp_path / task)
    return tmp_path / task
