"""Issue 21, hf: model specs: Hugging Face models lowered by directory and task, through the
library (``lowering.hf.load_hf`` + ``lowering.lower``) and the flow (``lowerflow lower hf:DIR``
in this process), run on ExecuTorch's runtime equal to eager.

Models: random-weight ``save_pretrained`` directories made once per session (Llama,
BERT, ViT, Whisper; hidden 32-64, 2 layers, vocabulary <= 256).  Also: transformers' own
``TorchExportableModuleWithStaticCache`` returned by a factory (the issue's failure),
constant methods, strict export, the fingerprint of a directory, and the one-line errors.
Whisper's greedy decode with its KV cache: ``tests/test_hf_speech.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
runtime = pytest.importorskip("executorch.runtime")

from lowering import lower  # noqa: E402
from lowering.hf import HFError, load_hf  # noqa: E402

MAX_SEQ_LEN = 32


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """``{family: save_pretrained directory}`` of tiny random-weight models."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    models = {
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)),
        "bert": transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64)),
        "vit": transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, num_labels=5)),
        "whisper": transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
            vocab_size=128, num_mel_bins=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
            max_target_positions=32, decoder_start_token_id=1, eos_token_id=2, pad_token_id=0, bos_token_id=1)),
    }
    dirs = {}
    for name, model in models.items():
        dirs[name] = root / name
        model.eval().save_pretrained(dirs[name])
    return dirs


def et_program(pte: bytes):
    return runtime.Runtime.get().load_program(pte)


def llama_eager(directory):
    """The checkpoint's own LM, no cache: logits [S, V] of a token list."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()

    def logits(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]

    return logits


def check_prefill_and_decode(method, eager, tokens=(5, 9, 17, 33, 60, 2, 7)) -> None:
    """Prefill of 3 tokens, 2 decode steps, then a prefill of 5 (the cache rewound), and a
    decode step after it: every step's logits equal eager's without a cache."""
    tokens = list(tokens)
    out = method.execute([torch.tensor([tokens[:3]]), torch.arange(3)])[0]
    torch.testing.assert_close(out[0], eager(tokens[:3]), atol=1e-5, rtol=1e-4)
    for i in (3, 4):
        out = method.execute([torch.tensor([[tokens[i]]]), torch.tensor([i])])[0]
        torch.testing.assert_close(out[0, -1], eager(tokens[:i + 1])[-1], atol=1e-5, rtol=1e-4)
    other = [11, 12, 13, 14, 15, 16]
    out = method.execute([torch.tensor([other[:5]]), torch.arange(5)])[0]
    torch.testing.assert_close(out[0], eager(other[:5]), atol=1e-5, rtol=1e-4)
    out = method.execute([torch.tensor([[other[5]]]), torch.tensor([5])])[0]
    torch.testing.assert_close(out[0, -1], eager(other)[-1], atol=1e-5, rtol=1e-4)


class OurMethod:
    """lowering.runtime's method with ExecuTorch's ``execute`` call."""

    def __init__(self, pte: bytes, name: str = "forward") -> None:
        from lowering.runtime import load

        self.program, self.name = load(pte), name

    def execute(self, inputs):
        return self.program.run(self.name, inputs)


#: Run in a fresh interpreter: ExecuTorch's custom-ops library is loaded before anything
#: defines llama::* ops (loading it after lowerflow's definitions aborts the process).
_FRESH_EXECUTORCH = textwrap.dedent("""
    import sys
    import executorch.extension.llm.custom_ops.custom_ops  # llama::*.out kernels, first
    sys.path.insert(0, sys.argv[1])
    from tests.test_hf import check_prefill_and_decode, et_program, llama_eager
    eager = llama_eager(sys.argv[2])
    for path in sys.argv[3:]:
        program = et_program(open(path, "rb").read())
        check_prefill_and_decode(program.load_method("forward"), eager)
        print(path, program.load_method("get_max_seq_len").execute([]), program.load_method("use_sdpa_with_kv_cache").execute([]))
""")


def check_on_fresh_executorch(directory, *ptes: Path) -> str:
    """check_prefill_and_decode of each .pte on ExecuTorch's runtime with its custom-ops library."""
    root = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", _FRESH_EXECUTORCH, root, str(directory), *map(str, ptes)],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# --------------------------------------------------------------------------- library


def test_text_generation_standard_runs_prefill_and_decode_on_executorch_equal_to_eager(hf_dirs):
    hf = load_hf(str(hf_dirs["llama"]), "text-generation", max_seq_len=MAX_SEQ_LEN, attn="standard")
    assert list(hf.methods) == ["forward"] and hf.options["attn"] == "standard"
    program = et_program(lower(hf.lower_input()).pte)
    check_prefill_and_decode(program.load_method("forward"), llama_eager(hf_dirs["llama"]))
    metadata = {name: program.load_method(name).execute([]) for name in hf.constants}
    assert metadata["get_max_seq_len"] == [MAX_SEQ_LEN]
    assert metadata["get_vocab_size"] == [256]
    assert metadata["get_bos_id"] == [1] and metadata["get_eos_ids"] == [2]
    assert metadata["use_kv_cache"] == [True] and metadata["enable_dynamic_shape"] == [True]
    assert metadata["use_sdpa_with_kv_cache"] == [False]


def test_text_generation_custom_attention_by_default_runs_on_both_runtimes(hf_dirs, tmp_path):
    """The default attn is ExecuTorch's llama::update_cache + llama::custom_sdpa: lowerflow's
    executor runs it here, ExecuTorch's runtime (with its custom-ops library) in a fresh process."""
    hf = load_hf(str(hf_dirs["llama"]), "text-generation", max_seq_len=MAX_SEQ_LEN)
    assert hf.options["attn"] == "custom" and hf.constants["use_sdpa_with_kv_cache"] is True
    result = lower(hf.lower_input())
    nodes = [n for n in result.exported_programs["forward"].graph.nodes if n.op == "call_function"]
    assert sum(str(n.target) == "llama.custom_sdpa.default" for n in nodes) == 2  # one per layer
    assert sum("update_cache" in str(n.args[0]) for n in nodes if str(n.target) == "auto_functionalized_v2") == 4
    check_prefill_and_decode(OurMethod(result.pte), llama_eager(hf_dirs["llama"]))
    path = tmp_path / "llama.pte"
    path.write_bytes(result.pte)
    assert "[32] [True]" in check_on_fresh_executorch(hf_dirs["llama"], path)


def test_text_generation_last_token_logits_returns_the_last_row_only(hf_dirs):
    """``last_token_logits``: forward's output is the last position's logits (prefill and decode),
    not one row per position; the option is in the fingerprint only when set; other tasks refuse it."""
    directory = str(hf_dirs["llama"])
    full = load_hf(directory, "text-generation", max_seq_len=MAX_SEQ_LEN)
    last = load_hf(directory, "text-generation", max_seq_len=MAX_SEQ_LEN, last_token_logits=True)
    assert "last_token_logits" not in full.options and last.options["last_token_logits"] is True
    full_result, last_result = lower(full.lower_input()), lower(last.lower_input())
    eager, ours = llama_eager(hf_dirs["llama"]), OurMethod(last_result.pte)
    tokens = [5, 9, 3, 7]
    (prefill,) = ours.execute([torch.tensor([tokens]), torch.arange(4)])
    assert prefill.shape[-1] == 256 and prefill.numel() == 256
    torch.testing.assert_close(prefill.reshape(-1), eager(tokens)[-1], atol=1e-4, rtol=1e-4)
    (step,) = ours.execute([torch.tensor([[11]]), torch.tensor([4])])
    torch.testing.assert_close(step.reshape(-1), eager([*tokens, 11])[-1], atol=1e-4, rtol=1e-4)
    (full_prefill,) = OurMethod(full_result.pte).execute([torch.tensor([tokens]), torch.arange(4)])
    assert full_prefill.shape == (1, 4, 256)
    with pytest.raises(HFError, match="last_token_logits is an option of text-generation, not fill-mask"):
        load_hf(str(hf_dirs["bert"]), "fill-mask", last_token_logits=True)


class RunnerSignature(torch.nn.Module):
    """The runner's positional ``forward(input_ids, cache_position)`` over transformers' wrapper
    (whose own forward takes ``inputs_embeds`` second)."""

    def __init__(self, wrapper: torch.nn.Module) -> None:
        super().__init__()
        self.wrapper = wrapper

    def forward(self, input_ids, cache_position):
        return self.wrapper(input_ids=input_ids, cache_position=cache_position)


def static_cache_factory(directory):
    """What a user's factory returns: transformers' TorchExportableModuleWithStaticCache around
    LlamaForCausalLM, a dynamic prompt length (the issue's ``decomposition to core ATen failed``)."""
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"
    wrapper = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=MAX_SEQ_LEN)
    seq = torch.export.Dim("seq_length_dim", max=MAX_SEQ_LEN - 1)
    inputs = (torch.tensor([[2, 3, 4]]), torch.arange(3))
    return RunnerSignature(wrapper).eval(), inputs, {"input_ids": {1: seq}, "cache_position": {0: seq}}


def test_transformers_static_cache_wrapper_from_a_factory_lowers_non_strict(hf_dirs):
    """The cache tensors are lifted twice by a non-strict export (buffers, and constants held by
    the StaticLayer objects): unrepaired, decomposition fails and says what to try; lowerflow's
    export merges the aliases, and prefill / decode run on ExecuTorch equal to eager."""
    from lowering.errors import ExportError
    from lowering.export import to_edge

    module, inputs, dims = static_cache_factory(hf_dirs["llama"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = torch.export.export(module, inputs, dynamic_shapes=dims, strict=False)
    assert any("lifted_tensor" in name for name in raw.constants)
    with pytest.raises(ExportError, match="decomposition to core ATen failed.*what to try: export with strict=True"):
        to_edge(raw)

    module, inputs, dims = static_cache_factory(hf_dirs["llama"])  # the raw export above wrote its caches
    before = {name: b.clone() for name, b in module.named_buffers()}
    result = lower(module, inputs, dynamic_shapes=dims)
    for name, buffer in module.named_buffers():  # export left the model as it was
        assert buffer.grad_fn is None and torch.equal(buffer, before[name]), name
    mutated = set(result.exported_program.graph_signature.buffers_to_mutate.values())
    assert {"wrapper.key_cache_0", "wrapper.value_cache_1", "wrapper.cumulative_length_0"} <= mutated
    assert not any("lifted_tensor" in name for name in result.exported_program.constants)
    check_prefill_and_decode(et_program(result.pte).load_method("forward"), llama_eager(hf_dirs["llama"]))


def test_strict_export_of_the_static_cache_wrapper(hf_dirs):
    """strict=True (TorchDynamo) exports the same wrapper without lifting a constant at all."""
    module, inputs, dims = static_cache_factory(hf_dirs["llama"])
    result = lower(module, inputs, dynamic_shapes=dims, strict=True)
    check_prefill_and_decode(et_program(result.pte).load_method("forward"), llama_eager(hf_dirs["llama"]))


@pytest.mark.parametrize("task, field", [("fill-mask", "logits"), ("feature-extraction", "last_hidden_state")])
def test_text_encoders_run_any_length_on_executorch_equal_to_eager(hf_dirs, task, field):
    hf = load_hf(str(hf_dirs["bert"]), task, max_seq_len=MAX_SEQ_LEN)
    method = et_program(lower(hf.lower_input()).pte).load_method("forward")
    module = hf.methods["forward"][0]
    for length in (5, 12):
        ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones(1, length, dtype=torch.long)
        with torch.no_grad():
            expected = module(ids, mask)
        assert expected.shape[:2] == (1, length) and module.field == field
        torch.testing.assert_close(method.execute([ids, mask])[0], expected, atol=1e-5, rtol=1e-4)


def test_image_classification_runs_on_executorch_equal_to_eager(hf_dirs):
    hf = load_hf(str(hf_dirs["vit"]), "image-classification")
    module, (pixels,), _ = hf.methods["forward"]
    out = et_program(lower(hf.lower_input()).pte).load_method("forward").execute([pixels])[0]
    with torch.no_grad():
        expected = module(pixels)
    assert expected.shape == (1, 5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- fingerprint and errors


def test_the_fingerprint_changes_with_weights_config_tokenizer_and_options(hf_dirs, tmp_path):
    from tasks.model_spec import ModelSpec, load_model

    directory = tmp_path / "bert"
    shutil.copytree(hf_dirs["bert"], directory)
    spec = ModelSpec.parse(f"hf:{directory}")
    options = {"version": None, "hf": {"task": "fill-mask", "max_seq_len": 16}}

    def fingerprint(opts=options):
        return load_model(spec, opts).fingerprint

    first = fingerprint()
    assert fingerprint().digest == first.digest  # deterministic
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    after_tokenizer = fingerprint()
    assert after_tokenizer.parts["tokenizer"] != first.parts["tokenizer"]
    config = json.loads((directory / "config.json").read_text())
    config["layer_norm_eps"] = 1e-6
    (directory / "config.json").write_text(json.dumps(config))
    after_config = fingerprint()
    assert after_config.parts["config"] != after_tokenizer.parts["config"]
    torch.manual_seed(1)
    model = transformers.BertForMaskedLM.from_pretrained(str(directory))
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight.add_(1.0)
    model.save_pretrained(directory)
    after_weights = fingerprint()
    assert after_weights.parts["weights"] != after_config.parts["weights"]
    longer = fingerprint({"version": None, "hf": {"task": "fill-mask", "max_seq_len": 24}})
    assert longer.parts["options"] != after_weights.parts["options"]
    assert len({f.digest for f in (first, after_tokenizer, after_config, after_weights, longer)}) == 5
    assert first.to_json()["transformers"] == transformers.__version__


def test_a_bad_task_or_option_is_one_line_naming_the_spec(hf_dirs):
    with pytest.raises(HFError, match=r"hf:.*bert: task 'translation' is not one of"):
        load_hf(str(hf_dirs["bert"]), "translation")
    with pytest.raises(HFError, match="attn is an option of text-generation"):
        load_hf(str(hf_dirs["bert"]), "fill-mask", attn="standard")
    with pytest.raises(HFError, match="no such directory"):
        load_hf("./no/such/model", "fill-mask")


def test_without_transformers_an_hf_spec_says_how_to_install_it(hf_dirs, monkeypatch):
    from tasks.model_spec import ModelSpec, ModelSpecError, load_model

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    spec = ModelSpec.parse(f"hf:{hf_dirs['bert']}")
    with pytest.raises(ModelSpecError) as info:
        load_model(spec, {"hf": {"task": "fill-mask"}})
    message = str(info.value)
    assert message.startswith(f"model spec 'hf:{hf_dirs['bert']}': needs the 'transformers' package")
    assert "pip install 'lowerflow[hf]'" in message and "\n" not in message


# --------------------------------------------------------------------------- the flow


def test_lowerflow_lower_hf_text_generation_writes_a_runner_program(cli, prefect_api, hf_dirs, tmp_path):
    output = tmp_path / "out" / "{name}-{target}.pte"
    code, out, errors = cli("lower", f"hf:{hf_dirs['llama']}", "--task", "text-generation",
                            "--max-seq-len", MAX_SEQ_LEN, "-t", "portable", "-t", "xnnpack",
                            "--store", tmp_path / "store", "-o", output)
    assert code == 0, (out, errors)
    assert "verify[forward]" in out
    ptes = [tmp_path / "out" / f"llama-{target}.pte" for target in ("portable", "xnnpack")]
    assert check_on_fresh_executorch(hf_dirs["llama"], *ptes).count("[32] [True]") == 2
    again = cli("lower", f"hf:{hf_dirs['llama']}", "--task", "text-generation", "--max-seq-len", MAX_SEQ_LEN,
                "--store", tmp_path / "store", "-o", tmp_path / "again.pte")
    assert again[0] == 0 and "export[forward]     cached" in again[1], again


def test_lowerflow_verify_hf_text_generation_checks_forward_and_the_constant_methods(cli, hf_dirs, tmp_path,
                                                                                    monkeypatch):
    """``verify --model hf:DIR --task ...`` takes lower's hf: flags: forward on both runtimes at
    the Dim's min and max, and each constant method's value; a flag the .pte was not lowered
    with is a mismatch (exit 1) naming the constant method.  ExecuTorch's runtime runs the
    three input sets in one fresh interpreter (llama:: ops)."""
    hf = load_hf(str(hf_dirs["llama"]), "text-generation", max_seq_len=MAX_SEQ_LEN)
    pte = tmp_path / "llama.pte"
    pte.write_bytes(lower(hf.lower_input()).pte)
    spec = f"hf:{hf_dirs['llama']}"
    started, run = [], subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: started.append(args) or run(*args, **kwargs))
    code, out, errors = cli("verify", pte, "--model", spec, "--task", "text-generation", "--max-seq-len", MAX_SEQ_LEN)
    assert code == 0, (out, errors)
    assert len(started) == 1 and out.count("forward     executorch  ok") == 3, out
    assert "forward     executorch  ok" in out and "(seq_length_dim=31)" in out
    assert "get_eos_ids lowerflow   ok" in out and "get_max_seq_len lowerflow   ok" in out
    code, out, errors = cli("verify", pte, "--model", spec, "--task", "text-generation", "--max-seq-len", MAX_SEQ_LEN,
                            "--attn", "standard")
    assert code == 1 and "use_sdpa_with_kv_cache is [True], expected False" in out
    assert errors == [f"lowerflow: error: {pte} does not match {spec} in lowerflow (use_sdpa_with_kv_cache)"]
    code, _, errors = cli("verify", pte, "--model", spec)
    assert code == 2 and "task None is not one of" in errors[0]


def test_lowerflow_lower_hf_without_a_task_or_with_a_bad_one_is_exit_2(cli, hf_dirs, tmp_path, monkeypatch):
    spec = f"hf:{hf_dirs['bert']}"
    code, _, errors = cli("lower", spec, "--store", tmp_path / "store")
    assert code == 2 and errors == [f"lowerflow: error: model spec {spec!r}: task None is not one of "
                                    "['automatic-speech-recognition', 'feature-extraction', 'fill-mask', "
                                    "'image-classification', 'text-generation'] (give --task / 'task:')"]
    code, _, errors = cli("lower", spec, "--task", "summarize", "--store", tmp_path / "store")
    assert code == 2 and len(errors) == 1 and "task 'summarize' is not one of" in errors[0]
    code, _, errors = cli("lower", "examples/models.py:mlp", "--task", "fill-mask", "--store", tmp_path / "store")
    assert code == 2 and len(errors) == 1 and "--task: only for an hf: model" in errors[0]
    code, _, errors = cli("lower", spec, "--task", "fill-mask", "--last-token-logits", "--store", tmp_path / "store")
    assert code == 2 and len(errors) == 1 and "last_token_logits is an option of text-generation" in errors[0]
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
        code, _, errors = cli("lower", spec, "--task", "fill-mask", "--store", tmp_path / "store")
    assert code == 2 and errors == [f"lowerflow: error: model spec {spec!r}: needs the 'transformers' package: "
                                    "pip install 'lowerflow[hf]'"]
    assert not (tmp_path / "store").exists()


def test_a_fleet_manifest_lowers_hf_entries_with_their_task(cli, prefect_api, hf_dirs, tmp_path):
    """Relative hf: directories resolve against the manifest; the ASR model is one program of
    two methods and its metadata; every program is verified on ExecuTorch's runtime against
    eager; the issue's factory (transformers' static-cache wrapper) lowers in the same fleet;
    a bad key is caught before any work."""
    for name in ("whisper", "vit", "bert"):
        shutil.copytree(hf_dirs[name], tmp_path / name)
    (tmp_path / "static_cache.py").write_text(textwrap.dedent(f"""
        from tests.test_hf import static_cache_factory

        def decoder():
            return static_cache_factory({str(hf_dirs['llama'])!r})
        """))
    manifest = tmp_path / "fleet.yaml"
    manifest.write_text("store: ./store\nmodels:\n"
                        "  - {model: 'hf:./whisper', task: automatic-speech-recognition}\n"
                        "  - {model: 'hf:./vit', task: image-classification, targets: [xnnpack]}\n"
                        "  - {model: 'hf:./bert', task: fill-mask, max_seq_len: 16}\n"
                        "  - {model: 'static_cache.py:decoder'}\n")
    code, out, errors = cli("fleet", manifest)
    assert code == 0, (out, errors)
    for name, target in (("whisper", "portable"), ("vit", "xnnpack"), ("bert", "portable"), ("decoder", "portable")):
        report = json.loads((tmp_path / "store" / "outputs" / name / "manifest.json").read_text())
        checks = report["targets"][target]["verify"]["checks"]
        assert report["targets"][target]["verify"]["ok"] is True, (name, checks)
        assert any(c["runtime"] == "executorch" and c["ok"] for c in checks), (name, checks)
    whisper = et_program((tmp_path / "store" / "outputs" / "whisper" / "portable.pte").read_bytes())
    assert {"encoder", "text_decoder", "get_eos_ids"} <= set(whisper.method_names)
    summary = json.loads((tmp_path / "store" / "outputs" / "whisper" / "manifest.json").read_text())
    assert summary["methods"] == ["encoder", "text_decoder"] and summary["fingerprint"]["kind"] == "hf"
    assert (tmp_path / "store" / "outputs" / "vit" / "xnnpack.pte").is_file()

    manifest.write_text("store: ./store2\nmodels:\n  - {model: 'hf:./vit', task: image-classification, attn: custom}\n")
    code, _, errors = cli("fleet", manifest)
    assert code == 2 and len(errors) == 1 and "models[0]" in errors[0] and "attn is an option of text-generation" in errors[0]
    assert not (tmp_path / "store2").exists()


def test_models_load_beside_export_stages_unchanged(hf_dirs, tmp_path):
    """A fleet loads models on threads while other models' stages run, and torch.export
    switches process-wide state (tasks.torch_lock: a Whisper load beside an export failed with
    KeyError 'custom'; weights initialized meanwhile went through torch._refs).  Loads beside a
    thread running export stages all succeed, with the weights a load alone gets: a factory's
    (built from a seed) and an hf: model's (its ASR head is initialized, not in the checkpoint)."""
    import threading

    from tasks.cache import CacheConfig
    from tasks.stage_tasks import StageTasks
    from tasks.model_spec import ModelSpec, holding, load_model

    factory = tmp_path / "initialized.py"
    factory.write_text(textwrap.dedent("""
        import torch

        def model():
            torch.manual_seed(0)
            layers = [torch.nn.Linear(32, 32) for _ in range(8)]
            return torch.nn.Sequential(torch.nn.Embedding(64, 32), *layers), (torch.tensor([[1, 2]]),)
        """))
    specs = [(ModelSpec.parse(f"{factory}:model"), {}),
             (ModelSpec.parse(f"hf:{hf_dirs['whisper']}"), {"hf": {"task": "automatic-speech-recognition"}})]

    def weights(loaded):
        return {(name, key): value for name, method in (loaded.methods or {"forward": loaded}).items()
                for key, value in method.module.state_dict().items()}

    alone = [weights(load_model(spec, options)) for spec, options in specs]
    exported = tmp_path / "exported.py"
    exported.write_text(textwrap.dedent("""
        import torch

        def model():
            return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), (torch.randn(2, 8),)
        """))
    export_options = {"strict": True}  # a dynamo export: the most process-wide state
    other = load_model(ModelSpec.parse(f"{exported}:model"), export_options)
    export = StageTasks(CacheConfig.for_store(str(tmp_path / "store"))).export.fn
    exports, done = [], threading.Event()

    def export_stages():
        with holding(other):
            while not done.is_set():
                exports.append(export(model=other.spec.text, fingerprint=other.fingerprint.digest,
                                      options=export_options))

    exporter = threading.Thread(target=export_stages)
    exporter.start()
    try:
        for round in range(50):
            spec, options = specs[0 if round % 10 else 1]
            loaded = weights(load_model(spec, options))
            expected = alone[0 if round % 10 else 1]
            assert loaded.keys() == expected.keys()
            assert all(torch.equal(loaded[key], expected[key]) for key in loaded), (spec.text, round)
    finally:
        done.set()
        exporter.join()
    assert exports and all(result["program"] for result in exports)


def test_a_hub_id_loads_from_the_hub_cache_and_keys_as_its_local_copy(hf_dirs, tmp_path, monkeypatch):
    """``hf:org/name`` is found by huggingface_hub (here its cache, offline: no network in
    tests); the model is keyed by its files, so a hub id and a local copy of the same snapshot
    share every cache key; an id the hub (or its cache) does not have is one error naming it."""
    from huggingface_hub import constants

    from tasks.model_spec import ModelSpec, ModelSpecError, load_model

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--lowerflow-tests--tiny-bert"
    shutil.copytree(hf_dirs["bert"], repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    options = {"hf": {"task": "fill-mask", "max_seq_len": 16}}
    hub = load_model(ModelSpec.parse("hf:lowerflow-tests/tiny-bert"), options)
    local = load_model(ModelSpec.parse(f"hf:{hf_dirs['bert']}"), options)
    assert hub.fingerprint.digest == local.fingerprint.digest
    assert hub.methods["forward"].fingerprint.digest == local.methods["forward"].fingerprint.digest
    program = load_hf("lowerflow-tests/tiny-bert", "fill-mask", max_seq_len=16)
    assert program.directory == (repo / "snapshots" / revision).resolve()

    with pytest.raises(ModelSpecError, match=r"model spec 'hf:lowerflow-tests/missing': not a local directory, "
                                             r"and the hub download failed"):
        load_model(ModelSpec.parse("hf:lowerflow-tests/missing"), options)
