"""Issue 32: a model input that is data never runs code.

Each crafted input carries a payload that creates a marker file when it is unpickled
(or evaluated): torch's own loader runs it (asserted, so the tests can fail), lowerflow
refuses the input in one line naming the file and the entry, and the marker never
appears.  The ``.pt2`` archives are a genuine ``torch.export.save`` of a ``Linear`` with
entries rewritten: a pickled weight (``use_pickle``), a pickled constant, an
``opaque_obj_`` constant, a legacy pickled state dict; also a symbolic size that is
Python code, compiled code (AOTInductor), a node calling ``torch.os.system``.  Then the
other inputs: hf: checkpoints, calibration files, ``lowerflow verify``'s, the store's.
Archives ``torch.export.save`` writes today still load, to the same ``.pte`` bytes.
"""

from __future__ import annotations

import io
import json
import pickle
import textwrap
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch

from flows.load_options import export_options, load_extras
from lowering import lower
from lowering.errors import TRUST_HINT, UntrustedInputError
from lowering.export import load as load_pt2
from tasks.model_spec import ModelSpec, ModelSpecError, load_model

RULE = f"lowerflow loads .pt2 files without running code ({TRUST_HINT})"
REPO = Path(__file__).resolve().parents[1]


class WritesMarker:
    """Unpickling it creates ``path``: the stand-in for an attacker's code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def torch_saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def saved_program(module: torch.nn.Module, inputs: tuple, dynamic_shapes=None) -> bytes:
    buffer = io.BytesIO()
    torch.export.save(torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes), buffer)
    return buffer.getvalue()


def linear_pt2() -> bytes:
    torch.manual_seed(0)
    return saved_program(torch.nn.Linear(4, 3), (torch.randn(2, 4),))


def rewrite(data: bytes, edit: Callable[[dict[str, bytes]], None]) -> bytes:
    """The archive with its entries (names without the archive's root folder) edited."""
    source = zipfile.ZipFile(io.BytesIO(data))
    root = source.namelist()[0].split("/")[0] + "/"
    entries = {name[len(root):]: source.read(name) for name in source.namelist()}
    edit(entries)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, payload in entries.items():
            archive.writestr(root + name, payload)
    return out.getvalue()


def edit_config(entries: dict[str, bytes], name: str, change: Callable[[dict], None]) -> None:
    config = json.loads(entries[name])
    change(config["config"])
    entries[name] = json.dumps(config).encode()


WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
CONSTANTS_CONFIG = "data/constants/model_constants_config.json"


def pickled_weight(payload) -> Callable[[dict], None]:
    """``weight`` marked ``use_pickle``, its file ``torch.save(payload)``."""
    def edit(entries: dict[str, bytes]) -> None:
        config = json.loads(entries[WEIGHTS_CONFIG])["config"]
        entries["data/weights/" + config["weight"]["path_name"]] = torch_saved(payload)
        edit_config(entries, WEIGHTS_CONFIG, lambda c: c["weight"].update(use_pickle=True))
    return edit


def pickled_constant(payload) -> Callable[[dict], None]:
    def edit(entries: dict[str, bytes]) -> None:
        meta = json.loads(entries[WEIGHTS_CONFIG])["config"]["bias"]["tensor_meta"]
        entries["data/constants/tensor_0"] = torch_saved(payload)
        edit_config(entries, CONSTANTS_CONFIG, lambda c: c.update(
            c={"path_name": "tensor_0", "is_param": False, "use_pickle": True, "tensor_meta": meta}))
    return edit


def opaque_constant(payload) -> Callable[[dict], None]:
    def edit(entries: dict[str, bytes]) -> None:
        entries["data/constants/opaque_obj_0"] = pickle.dumps(payload)
        edit_config(entries, CONSTANTS_CONFIG, lambda c: c.update(
            obj={"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}))
    return edit


def legacy_state_dict(payload) -> Callable[[dict], None]:
    def edit(entries: dict[str, bytes]) -> None:
        entries["data/weights/model.pt"] = torch_saved({"weight": payload, "bias": torch.zeros(3)})
    return edit


#: The issue's four archives: (file stem, how it is made, what lowerflow says).
CRAFTED = {
    "pickled_weight": (pickled_weight, "weight 'weight' is a pickle"),
    "pickled_constant": (pickled_constant, "constant 'c' is a pickle"),
    "opaque_constant": (opaque_constant, "constant 'obj' is a pickled Python object (opaque_obj_0)"),
    "legacy_state_dict": (legacy_state_dict, "entry 'data/weights/model.pt' (legacy weights) is a pickle of more "
                                             "than tensors"),
}


def crafted(tmp_path: Path, kind: str) -> tuple[Path, Path, str]:
    """(archive, marker, lowerflow's one line) of a CRAFTED kind, in ``tmp_path``."""
    make, why = CRAFTED[kind]
    marker = tmp_path / f"{kind}.marker"
    path = tmp_path / f"{kind}.pt2"
    path.write_bytes(rewrite(linear_pt2(), make(WritesMarker(marker))))
    return path, marker, f"{path}: {why}; {RULE}"


@pytest.mark.parametrize("kind", list(CRAFTED))
def test_torch_export_load_runs_the_payload_lowerflow_refuses_it_in_one_line(tmp_path, kind):
    path, marker, line = crafted(tmp_path, kind)
    with pytest.raises(UntrustedInputError) as refused:
        load_pt2(path.read_bytes(), name=str(path))
    assert str(refused.value) == line
    with pytest.raises(ModelSpecError) as failed:  # what a fleet's model load records
        load_model(ModelSpec.parse(str(path)), {"version": None})
    assert str(failed.value) == line
    assert not marker.exists()
    try:  # what lowerflow did before: torch's loader runs the payload (then fails or not)
        torch.export.load(io.BytesIO(path.read_bytes()))
    except Exception:
        pass
    assert marker.exists()


@pytest.mark.parametrize("kind", list(CRAFTED))
def test_lowerflow_lower_refuses_a_crafted_pt2_with_exit_2_and_writes_nothing(cli, tmp_path, kind):
    path, marker, line = crafted(tmp_path, kind)
    code, out, errors = cli("lower", path, "--store", tmp_path / "store", "-o", tmp_path / "out.pte")
    assert (code, errors) == (2, [f"lowerflow: error: {line}"]), out
    assert not marker.exists()
    assert not (tmp_path / "store").exists() and not (tmp_path / "out.pte").exists()


def test_a_fleet_fails_each_crafted_pt2_and_publishes_nothing_of_it(cli, prefect_api, tmp_path):
    """The four crafted archives fail in the fleet (nothing of theirs in outputs/ but the
    record of the failure); a trusted archive with a genuine pickled weight lowers beside
    them, its manifest and report saying it was trusted."""
    lines = {}
    for kind in CRAFTED:
        path, marker, lines[kind] = crafted(tmp_path, kind)
    trusted = tmp_path / "trusted.pt2"
    trusted.write_bytes(rewrite(linear_pt2(), pickled_weight(torch.nn.Parameter(torch.ones(3, 4)))))
    manifest = tmp_path / "fleet.yaml"
    manifest.write_text("store: ./store\ndefaults: {targets: [portable]}\nmodels:\n"
                        + "".join(f"  - {{model: '{tmp_path / kind}.pt2'}}\n" for kind in CRAFTED)
                        + f"  - {{model: '{trusted}', trust_pickle: true}}\n")
    code, out, errors = cli("fleet", manifest)
    assert code == 1 and len(errors) == 1 and "4 of 5 models failed" in errors[0], (out, errors)
    outputs = tmp_path / "store" / "outputs"
    for kind, line in lines.items():
        assert not (tmp_path / f"{kind}.marker").exists()
        record = json.loads((outputs / kind / "manifest.json").read_text())
        assert record["targets"]["portable"]["error"] == f"load: ModelSpecError: {line}"
        assert [p.name for p in (outputs / kind).iterdir() if p.suffix == ".pte"] == []
        assert "trust_pickle" not in record
    record = json.loads((outputs / "trusted" / "manifest.json").read_text())
    assert record["trust_pickle"] is True and record["targets"]["portable"]["ok"]
    assert (outputs / "trusted" / "portable.pte").is_file()
    from flows.reports import model_report_markdown

    assert "**trust_pickle:**" in model_report_markdown(record)


def test_trust_pickle_loads_the_genuine_pickled_weight_to_the_same_pte(cli, prefect_api, tmp_path):
    genuine = linear_pt2()
    program = torch.export.load(io.BytesIO(genuine))
    path = tmp_path / "linear.pt2"
    path.write_bytes(rewrite(genuine, pickled_weight(program.state_dict["weight"])))
    code, _, errors = cli("lower", path, "--store", tmp_path / "store", "-o", tmp_path / "refused.pte")
    assert (code, errors) == (2, [f"lowerflow: error: {path}: weight 'weight' is a pickle; {RULE}"])
    code, out, errors = cli("lower", path, "--trust-pickle", "--store", tmp_path / "store", "-o", tmp_path / "t.pte")
    assert code == 0, (out, errors)
    assert (tmp_path / "t.pte").read_bytes() == lower(program).pte
    published = json.loads((tmp_path / "store" / "outputs" / "linear" / "manifest.json").read_text())
    assert published["trust_pickle"] is True


def test_trust_pickle_enters_the_cache_key_only_when_set(tmp_path):
    path = tmp_path / "linear.pt2"
    path.write_bytes(linear_pt2())
    spec = ModelSpec.parse(str(path))
    assert load_extras() == {} and export_options("1", None, load_extras()) == {"version": "1"}
    plain = load_model(spec, export_options("1", None, load_extras()))
    from tasks.fingerprint import fingerprint_pt2

    assert plain.fingerprint.digest == fingerprint_pt2(path.read_bytes(), {"version": "1"}).digest
    assert not plain.trust_pickle
    trusted = load_model(spec, export_options("1", None, load_extras(trust_pickle=True)))
    assert trusted.trust_pickle and trusted.fingerprint.digest != plain.fingerprint.digest


# --------------------------------------------------------------------------- code in the JSON program


def test_a_symbolic_size_that_is_python_code_is_refused(tmp_path):
    """torch's deserializer ``sympy.sympify``s each symbolic size: Python's eval."""
    marker = tmp_path / "sym.marker"
    torch.manual_seed(0)
    data = saved_program(torch.nn.Linear(4, 3), (torch.randn(2, 4),),
                         dynamic_shapes=({0: torch.export.Dim("n", max=8)},))

    def edit(entries: dict[str, bytes]) -> None:
        text = entries["models/model.json"].decode()
        symbol = json.loads(text)["graph_module"]["graph"]["tensor_values"]["input"]["sizes"][0]["as_expr"]["expr_str"]
        entries["models/model.json"] = text.replace(
            json.dumps(symbol)[1:-1], f"__import__('builtins').open('{marker}', 'w') and {symbol}", 1).encode()

    evil = rewrite(data, edit)
    with pytest.raises(UntrustedInputError, match=r"^m.pt2: a symbolic size of the program calls or names "
                                                  r"'__import__': .*; lowerflow loads .pt2 files"):
        load_pt2(evil, name="m.pt2")
    assert not marker.exists()
    torch.export.load(io.BytesIO(evil))  # loads fine, having run the payload
    assert marker.exists()


def test_compiled_code_and_a_node_calling_a_python_function_never_run(tmp_path):
    """An AOTInductor entry (a shared library torch would load) is refused; a node whose
    target is ``torch.os.system`` is refused by torch's verifier while it deserializes."""
    data = linear_pt2()
    aoti = rewrite(data, lambda e: e.update({"data/aotinductor/model/model.so": b"\x7fELF"}))
    with pytest.raises(UntrustedInputError, match="entry 'data/aotinductor/model/model.so' is compiled code"):
        load_pt2(aoti, name="m.pt2")
    marker = tmp_path / "system.marker"

    def call_system(entries: dict[str, bytes]) -> None:
        program = json.loads(entries["models/model.json"])
        program["graph_module"]["graph"]["nodes"].insert(0, {
            "target": "torch.os.system", "name": "evil", "outputs": [], "metadata": {},
            "inputs": [{"name": "command", "arg": {"as_string": f"touch {marker}"}, "kind": 1}]})
        entries["models/model.json"] = json.dumps(program).encode()

    with pytest.raises(Exception, match="cannot load .pt2"):
        load_pt2(rewrite(data, call_system), name="m.pt2")
    assert not marker.exists()


# --------------------------------------------------------------------------- genuine archives


class Everything(torch.nn.Module):
    """Weights, a buffer, a lifted constant (a plain tensor attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("offset", torch.arange(3.0))
        self.scale = torch.tensor([0.5, 2.0, 1.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale + self.offset


def genuine_archives() -> dict[str, bytes]:
    from examples.models import buffer_mutation, lifted_constant, mlp

    torch.manual_seed(0)
    archives = {"everything": saved_program(Everything(), (torch.randn(2, 4),)),
                "dynamic": saved_program(Everything(), (torch.randn(2, 4),),
                                         dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=8)},))}
    for factory in (mlp, lifted_constant, buffer_mutation):
        archives[factory.__name__] = saved_program(*factory())
    return archives


def test_archives_torch_export_save_writes_load_to_the_same_pte_as_torch_export_load():
    for name, data in genuine_archives().items():
        program = load_pt2(data, name=name)
        assert lower(program).pte == lower(torch.export.load(io.BytesIO(data))).pte, name


# --------------------------------------------------------------------------- hf: checkpoints


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32))
    model.config.save_pretrained(directory)
    torch.save(model.state_dict(), directory / "pytorch_model.bin")  # a genuine pickle checkpoint
    return directory


def test_an_hf_pickle_checkpoint_loads_only_with_weights_only(cli, bert_dir, tmp_path):
    """A genuine pytorch_model.bin loads (weights_only=True); one whose pickle is more than
    tensors is refused in one line (exit 2), also by verify; the marker never appears."""
    from lowering.hf import load_hf

    genuine = load_hf(str(bert_dir), "fill-mask", max_seq_len=8)
    assert genuine.methods["forward"][0] is not None
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "config.json").write_bytes((bert_dir / "config.json").read_bytes())
    marker = tmp_path / "hf.marker"
    torch.save({"bert.embeddings.word_embeddings.weight": WritesMarker(marker)}, evil / "pytorch_model.bin")
    spec = f"hf:{evil}"
    line = (f"lowerflow: error: model spec {spec!r}: pytorch_model.bin is a pickle of more than tensors; "
            f"lowerflow loads checkpoints without running code ({TRUST_HINT})")
    code, _, errors = cli("lower", spec, "--task", "fill-mask", "--store", tmp_path / "store")
    assert (code, errors) == (2, [line])
    code, _, errors = cli("verify", tmp_path / "any.pte", "--model", spec, "--task", "fill-mask")
    assert (code, errors) == (2, [line])
    with pytest.raises(UntrustedInputError, match="pytorch_model.bin is a pickle of more than tensors"):
        load_hf(str(evil), "fill-mask")
    assert not marker.exists() and not (tmp_path / "store").exists()


def test_an_hf_config_asking_for_its_own_code_never_imports_it(bert_dir, tmp_path):
    from lowering.hf import HFError, load_hf

    remote = tmp_path / "remote"
    remote.mkdir()
    config = json.loads((bert_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForMaskedLM": "modeling_evil.EvilModel", "AutoConfig": "modeling_evil.EvilConfig"}
    (remote / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "remote.marker"
    (remote / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
    (remote / "pytorch_model.bin").write_bytes((bert_dir / "pytorch_model.bin").read_bytes())
    try:
        load_hf(str(remote), "fill-mask", max_seq_len=8)
    except HFError:
        pass
    assert not marker.exists()


# --------------------------------------------------------------------------- calibration, verify, the store


def test_calibration_pickles_are_refused_and_safetensors_never_unpickle(cli, tmp_path):
    marker = tmp_path / "calibration.marker"
    for name in ("batches.pt", "batches.safetensors"):
        (tmp_path / name).write_bytes(torch_saved([(WritesMarker(marker),)]))
    code, _, errors = cli("lower", "examples/models.py:cnn", "--quantize", "int8", "--calibration",
                          tmp_path / "batches.pt", "--store", tmp_path / "store")
    assert code == 2 and len(errors) == 1 and "batches.pt' is a pickle; lowerflow reads calibration data" in errors[0]
    from tasks.calibration import CalibrationError, read_calibration

    with pytest.raises(CalibrationError, match="cannot read"):
        read_calibration(str(tmp_path / "batches.safetensors"), "model 'cnn'")
    assert not marker.exists() and not (tmp_path / "store").exists()


def test_verify_reads_a_pte_without_unpickling_it(cli, tmp_path):
    marker = tmp_path / "pte.marker"
    pte = tmp_path / "evil.pte"
    pte.write_bytes(torch_saved(WritesMarker(marker)))
    code, _, errors = cli("verify", pte, "--model", "examples/models.py:mlp")
    assert code == 1 and len(errors) == 1 and f"cannot verify {str(pte)!r}" in errors[0]
    assert not marker.exists()


def test_a_stored_program_whose_graph_is_code_is_refused(tmp_path):
    """Whoever can write to the store cannot make a worker run code: the graph blob's
    symbolic sizes are checked before torch's deserializer evaluates them."""
    from lowering.export import export
    from lowering.serialize import blob_digest, canonical_json
    from tasks.store import ArtifactRef, ArtifactStore

    store = ArtifactStore(str(tmp_path / "store"))
    torch.manual_seed(0)
    program = export(torch.nn.Linear(4, 3), (torch.randn(2, 4),),
                     dynamic_shapes=({0: torch.export.Dim("n", max=8)},))
    ref = store.put_program(program)
    manifest = json.loads(store.get_bytes(ref))
    graph = store.read_object(manifest["graph"]).decode()
    marker = tmp_path / "store.marker"
    symbol = "Symbol('s"
    assert symbol in graph
    evil_graph = graph.replace(symbol, f"__import__('builtins').open('{marker}', 'w') and {symbol}", 1).encode()
    store.put_blobs([evil_graph])
    blobs = [b for b in manifest["blobs"] if b != manifest["graph"]] + [blob_digest(evil_graph)]
    evil = store.put_bytes(canonical_json({**manifest, "graph": blob_digest(evil_graph), "blobs": sorted(blobs)}),
                           "program")
    with pytest.raises(UntrustedInputError, match=r"stored program graph .*calls or names '__import__'.*"
                                                  r"lowerflow reads the store without running code$"):
        store.get_program(ArtifactRef(evil.uri, evil.sha256, evil.size, "program"))
    assert not marker.exists()
    assert len(store.get_program(ref).graph.nodes) == len(program.graph.nodes)  # the genuine one, dynamic, loads


@pytest.mark.parametrize("expr", [
    "Symbol('s77', positive=True, integer=True)",
    "FloorDiv(Add(Symbol('s0', positive=True, integer=True), Integer(-1)), Integer(2))",
    "StrictLessThan(Max(Integer(1), Symbol('u0', integer=True)), oo)",
    "Float('0.5', precision=53)",
    "2*s0 + 1",  # the str() form of older archives
])
def test_plain_sympy_sizes_pass(expr):
    from lowering.untrusted import check_sym_expr

    assert check_sym_expr(expr) is None


@pytest.mark.parametrize("expr", [
    "__import__('os').system('true')",
    "exec(chr(49))",
    "Symbol('s0').__class__",
    "FloorDiv('__import__(1)', 2)",  # a function's argument is sympify()d again
    "Symbol(f'{1}')",
    "Poly('x')",
    "[s0 for s0 in ()]",
    "Symbol('s0', **{})",
    "ｅｘｅｃ(1)",
])
def test_code_in_a_size_is_refused(expr):
    from lowering.untrusted import check_program_bytes, check_sym_expr

    assert check_sym_expr(expr) is not None
    escaped = json.dumps({"size": {"expr\\u005fstr": expr}}).replace("\\\\u005f", "\\u005f").encode()
    with pytest.raises(UntrustedInputError, match="a symbolic size of the program"):
        check_program_bytes(escaped, "m.pt2")  # the key spelled with a JSON escape is found too


def test_every_entry_torch_reads_as_a_program_is_checked():
    """torch reads every models/ entry as a program (its name cut by len('.json')), not
    only the *.json ones; an entry torch.export.save never writes is refused too."""
    data = linear_pt2()
    for name, why in (("models/evil.txt", "entry 'models/evil.txt' is not a program"),
                      ("payload.bin", "entry 'payload.bin' is not part of a torch.export.save archive")):
        with pytest.raises(UntrustedInputError, match=why):
            load_pt2(rewrite(data, lambda e: e.update({name: b"{}"})), name="m.pt2")
