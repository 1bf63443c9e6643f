"""LLMs at real size (issue 27): ``lowerflow lower hf:`` against optimum-executorch 1.1.0.

Per model (random weights, seed 0, published configs: bench/llm_checkpoints.py, built into
``--models-dir`` when absent) and recipe (``fp32``, ``8da4w``), max_seq_len 1024, XNNPACK:

* lowerflow: ``lowerflow lower hf:DIR --task text-generation --max-seq-len 1024 -t xnnpack
  [--quantize 8da4w] -o OUT --store S`` (this checkout, fresh store and PREFECT_HOME; then the
  same command again on the same store, OUT left in place as a nightly rerun finds it: the warm
  rerun, and the seconds to hash the checkpoint's files, which the issue's 5 s leaves out);
* optimum: ``optimum-cli export executorch --model DIR --task text-generation --recipe xnnpack
  --use_custom_sdpa --use_custom_kv_cache [--qlinear 8da4w] --max_seq_len 1024 --output_dir OUT``
  in its own virtual environment (``--optimum-venv``, created when absent: torch 2.13.0, then
  executorch 1.5.1 and optimum-executorch 1.1.0, which pins transformers 5.0.0rc1).

Each command runs under ``/usr/bin/time -v``: wall seconds, its peak RSS (the largest single
process, as ``time -v`` reports it) and the peak of the whole process tree's summed RSS
(sampled every 0.5 s from /proc); ``.pte`` bytes; the store's bytes after the cold run.
Qwen-size and larger runs hold ``--lock`` (``flock``; waiting is not timed).

Then one process per model x recipe loads both programs on the ExecuTorch runtime
(``executorch.runtime``) and runs them interleaved call by call (bench_llm.measure): a
16-token prefill and ``--decode`` greedy steps per round, the first round dropped; prefill
and decode tokens/s of the median call.  Each program's greedy tokens are compared with its
own eager reference: fp32, the transformers model (no cache); 8da4w, the tool's own quantized
eager model (lowerflow: its quantize stage's program run in PyTorch; optimum: its
``quantize_model_`` on the transformers model, in its venv).  On random weights 8da4w
decorrelates the logits and the tools' scale algorithms differ, so their 8da4w tokens
differ; at fp32 both programs' tokens must be equal.

Ratios are lowerflow / optimum (``cpu s``: the cold lowering's user + system seconds, less
load-sensitive than wall seconds); the issue's targets: lower s <= 0.5, peak RSS <= 1 (tree),
bytes <= 1, decode >= 0.95.  The JSON (``--json``) keeps every figure;
``--reuse-optimum JSON`` takes optimum's figures from an earlier run of the same model
config, recipe, max_seq_len and optimum-executorch version instead of exporting again (its
``.pte`` is measured interleaved again when it is still there).

    ./run bench llm_scale [--models smollm2,qwen] [--recipes fp32,8da4w] [--include-1b]
        [--tools lowerflow,optimum] [--reuse-optimum JSON] [--lowerflow-args '--verify quick']
        [--scratch DIR] [--models-dir DIR] [--optimum-venv DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from llm_checkpoints import CHECKPOINTS, checkpoint  # noqa: E402

MAX_SEQ_LEN = 1024
PROMPT = 16
#: Models run under the big-run lock (larger than SmolLM2-135M).
BIG = {"qwen", "llama1b"}
OPTIMUM_PINS = ("executorch==1.5.1", "optimum-executorch==1.1.0")
DEFAULT_SCRATCH = Path(os.environ.get("LOWERFLOW_BENCH_SCRATCH", Path.home() / ".cache" / "lowerflow-bench"))
PAGE = os.sysconf("SC_PAGE_SIZE")
GB = 1e9


# --------------------------------------------------------------------------- measuring a command


def _children() -> dict[int, list[int]]:
    """``{ppid: [pid, ...]}`` of every process now (from /proc/PID/stat)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def tree_rss(root: int) -> int:
    """The summed resident bytes of ``root`` and all its descendants."""
    tree, pending, total = _children(), [root], 0
    while pending:
        pid = pending.pop()
        pending += tree.get(pid, [])
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    return total


def run_measured(cmd: list[str], env: dict, log: Path, cwd: Path | None = None) -> dict:
    """Run ``cmd`` under ``/usr/bin/time -v``: seconds, CPU seconds (user + system, of the
    command and its children: less noisy than wall seconds on a loaded machine), rc, peak RSS
    (largest process) and the process tree's peak summed RSS (sampled every 0.5 s; the
    timeline, seconds and GB, goes to ``log`` with suffix ``.rss.tsv``); stdout and stderr go to ``log``."""
    timing = log.with_suffix(".time")
    peak, done = [0], threading.Event()
    with open(log, "w") as out, open(log.with_suffix(".rss.tsv"), "w") as timeline:
        start = time.perf_counter()
        proc = subprocess.Popen(["/usr/bin/time", "-v", "-o", str(timing), *cmd], env=env, cwd=cwd,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def sample() -> None:
            while not done.wait(0.5):
                now = tree_rss(proc.pid)
                peak[0] = max(peak[0], now)
                timeline.write(f"{time.perf_counter() - start:.1f}\t{now / GB:.3f}\n")

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            rc = proc.wait()
        finally:  # the bench stopped (SIGTERM, ^C): its command and that command's children too
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
    text = timing.read_text()
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    cpu = [float(v) for v in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", text)]
    return {"seconds": round(seconds, 1), "cpu_seconds": round(sum(cpu), 1) if len(cpu) == 2 else None, "rc": rc,
            "rss": int(found.group(1)) * 1024 if found else None, "tree_rss": peak[0], "log": str(log),
            "load_average": round(os.getloadavg()[0], 2)}


@contextlib.contextmanager
def big_run_lock(path: Path | None) -> Iterator[None]:
    """Hold ``flock(path)`` (what ``flock /tmp/bigrun.lock CMD`` takes); nothing when ``path`` is None."""
    if path is None:
        yield
        return
    with open(path, "a") as handle:
        print(f"  waiting for {path} ...", flush=True)
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tree_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (each inode once)."""
    seen, total = set(), 0
    for folder, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(folder, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


# --------------------------------------------------------------------------- the two tools


def checkpoint_id(directory: Path) -> dict:
    """What identifies a checkpoint cheaply: its config's sha256 and its weights' size plus the
    sha256 of their first 16 MB (random weights: a different seed changes it)."""
    weights = sorted(directory.glob("*.safetensors"))
    head = hashlib.sha256()
    for path in weights:
        with open(path, "rb") as handle:
            head.update(handle.read(16 << 20))
    return {"config_sha256": hashlib.sha256((directory / "config.json").read_bytes()).hexdigest(),
            "weights_bytes": sum(p.stat().st_size for p in weights), "weights_head_sha256": head.hexdigest()}


def lowerflow_env(prefect_home: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(prefect_home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}


def supported_flags(extra: list[str]) -> list[str]:
    """``extra`` less the flags (and their values) ``lowerflow lower`` does not know, each named."""
    help_text = subprocess.run([sys.executable, "-m", "flows.cli", "lower", "--help"], capture_output=True,
                               text=True, env=lowerflow_env(Path(tempfile.gettempdir())), cwd=ROOT).stdout
    known, i, kept = set(re.findall(r"(--[a-z][a-z0-9-]*)", help_text)), 0, []
    while i < len(extra):
        flag = extra[i]
        value = extra[i + 1:i + 2] if i + 1 < len(extra) and not extra[i + 1].startswith("-") else []
        if flag.startswith("--") and flag.split("=")[0] not in known:
            print(f"  lowerflow lower has no {flag}: left out ({' '.join([flag, *value])})")
        else:
            kept += [flag, *value]
        i += 1 + len(value)
    return kept


def run_lowerflow(ckpt: Path, recipe: str, work: Path, extra: list[str]) -> dict:
    """Cold lowering (fresh store and PREFECT_HOME), then the warm rerun on the same store."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    store, home, out = work / "store", work / "prefect-home", work / "lowerflow.pte"
    home.mkdir()
    cmd = [sys.executable, "-m", "flows.cli", "lower", f"hf:{ckpt}", "--task", "text-generation",
           "--max-seq-len", str(MAX_SEQ_LEN), "-t", "xnnpack", "-o", str(out), "--store", str(store)]
    cmd += ["--quantize", recipe] if recipe != "fp32" else []
    cmd += extra
    cold = run_measured(cmd, lowerflow_env(home), work / "cold.log", cwd=ROOT)
    result = {"command": shlex.join(cmd), "cold": cold}
    if cold["rc"] != 0:
        result["error"] = _last_line(Path(cold["log"]))
        return result
    result.update(pte=str(out), pte_bytes=out.stat().st_size, store_bytes=tree_bytes(store))
    warm = run_measured(cmd, lowerflow_env(home), work / "warm.log", cwd=ROOT)
    result["warm"] = warm
    result["hash_seconds"] = hash_seconds(ckpt)
    if warm["rc"] != 0:
        result["error"] = "warm rerun: " + _last_line(Path(warm["log"]))
    return result


def hash_seconds(directory: Path) -> float:
    """Wall seconds to hash the checkpoint's files as a cached rerun does (tasks.fingerprint.hf_files),
    right after the warm rerun: the issue's budget for a cached rerun is 5 s plus this."""
    from tasks.fingerprint import hf_files  # imported before the clock starts

    start = time.perf_counter()
    hf_files(directory)
    return round(time.perf_counter() - start, 2)


def ensure_optimum_venv(venv: Path) -> Path:
    """``venv/bin/optimum-cli``, after creating the venv when it has none (a few minutes)."""
    cli = venv / "bin" / "optimum-cli"
    if cli.exists():
        return cli
    print(f"creating optimum-executorch's venv {venv} (torch 2.13.0, {', '.join(OPTIMUM_PINS)}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "-q"]
    index = os.environ.get("LOWERFLOW_TORCH_INDEX_URL")  # as ./run: a CPU wheel index where needed
    subprocess.run(pip + (["--index-url", index] if index else []) + ["torch==2.13.0"], check=True)
    subprocess.run(pip + list(OPTIMUM_PINS), check=True)
    if not cli.exists():
        raise SystemExit(f"bench_llm_scale: {venv}: optimum-cli is missing after the install")
    return cli


def optimum_versions(venv: Path) -> dict:
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
            "('optimum-executorch', 'optimum', 'executorch', 'torch', 'transformers', 'torchao')}))")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def optimum_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "HF_HUB_OFFLINE": "1"}


def run_optimum(cli: Path, ckpt: Path, recipe: str, work: Path) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cmd = [str(cli), "export", "executorch", "--model", str(ckpt), "--task", "text-generation",
           "--recipe", "xnnpack", "--use_custom_sdpa", "--use_custom_kv_cache",
           *(["--qlinear", recipe] if recipe != "fp32" else []),
           "--max_seq_len", str(MAX_SEQ_LEN), "--output_dir", str(work / "out")]
    run = run_measured(cmd, optimum_env(), work / "export.log")
    result = {"command": shlex.join(cmd), "cold": run}
    ptes = sorted((work / "out").glob("*.pte"))
    if run["rc"] != 0 or not ptes:
        result["error"] = _last_line(Path(run["log"]))
        return result
    result.update(pte=str(ptes[0]), pte_bytes=ptes[0].stat().st_size)
    return result


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["(no output)"])[-1].strip()[:400]


# --------------------------------------------------------------------------- eager references

#: lowerflow's references (this venv): fp32, the transformers model without a cache; 8da4w, the
#: quantize stage's program of lowerflow's decoder (KV cache buffers), run in PyTorch.
_LOWERFLOW_REF = textwrap.dedent(
    """
    import json, sys, torch
    directory, recipe, prompt, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    with torch.no_grad():
        if recipe == "fp32":
            import transformers
            model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
            ids = list(prompt)
            for _ in range(steps + 1):
                logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
                ids.append(int(logits[0, -1].argmax()))
        else:
            from lowering.export import export
            from lowering.hf import load_hf
            from lowering.quantize import quantize
            module, example, dynamic = load_hf(directory, "text-generation", max_seq_len=%d).methods["forward"]
            step = quantize(export(module, example, dynamic_shapes=dynamic), recipe).module()
            ids, pos = list(prompt), 0
            for _ in range(steps + 1):
                new = ids[pos:]
                logits = step(torch.tensor([new]), torch.arange(pos, pos + len(new)))
                pos += len(new)
                ids.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
    print(json.dumps(ids[len(prompt):]))
    """ % MAX_SEQ_LEN
)

#: optimum's 8da4w reference (its venv): its own quantize_model_ on the transformers model, no cache.
_OPTIMUM_REF = textwrap.dedent(
    """
    import json, sys, torch, transformers
    from optimum.exporters.executorch.quantization import quantize_model_
    directory, recipe, prompt, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        quantize_model_(model, qlinear_config=recipe)
        ids = list(prompt)
        for _ in range(steps + 1):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
            ids.append(int(logits[0, -1].argmax()))
    print(json.dumps(ids[len(prompt):]))
    """
)


def reference_tokens(python: str, code: str, env: dict, ckpt: Path, recipe: str, prompt: list[int],
                     steps: int) -> list[int] | str:
    """The greedy tokens of an eager reference (``steps + 1`` after the prompt), or an error line."""
    done = subprocess.run([python, "-c", code, str(ckpt), recipe, json.dumps(prompt), str(steps)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        return "error: " + (done.stderr.strip().splitlines() or ["?"])[-1][:300]
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the runtime


def measure_runtime(ptes: dict[str, str], prompt: list[int], steps: int, rounds: int) -> dict:
    """Both programs in one fresh process on the ExecuTorch runtime, interleaved call by call."""
    done = subprocess.run([sys.executable, __file__, "--measure", json.dumps(
        {"ptes": ptes, "prompt": prompt, "steps": steps, "rounds": rounds})],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure_main(spec: dict) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (llama::*.out kernels)
    import executorch.kernels.quantized  # noqa: F401  (quantized_decomposed::*.out kernels)
    from bench_llm import measure

    names = list(spec["ptes"])
    results = measure([spec["ptes"][n] for n in names], torch.tensor([spec["prompt"]]), spec["steps"],
                      spec["rounds"], prefills=5)
    print(json.dumps({n: {"prefill_tok_s": round(r["prefill"], 2), "decode_tok_s": round(r["decode"], 2),
                          "tokens": r["tokens"]} for n, r in zip(names, results)}))


# --------------------------------------------------------------------------- one row


def prompt_ids(vocab: int) -> list[int]:
    import torch

    return torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()


def reused_optimum(path: Path | None, model: str, recipe: str, ident: dict, version: str | None) -> dict | None:
    """optimum's figures for (model, recipe) from an earlier run's JSON, when its config matches."""
    if path is None:
        return None
    earlier = json.loads(path.read_text())
    for row in earlier["rows"]:
        if (row["model"], row["recipe"], row.get("max_seq_len")) != (model, recipe, MAX_SEQ_LEN):
            continue
        if row["checkpoint"]["config_sha256"] != ident["config_sha256"] or "pte_bytes" not in row.get("optimum", {}):
            continue
        had = earlier["versions"].get("optimum", {}).get("optimum-executorch")
        if version is not None and had != version:
            print(f"  {path}: optimum-executorch {had} there, {version} here: not reused")
            return None
        same = row["checkpoint"] == ident
        pte = row["optimum"].get("pte")
        live = same and pte and Path(pte).is_file() and Path(pte).stat().st_size == row["optimum"].get("pte_bytes")
        return {**row["optimum"], "reused_from": str(path), "reused_date": earlier.get("date"),
                "pte": pte if live else None, "earlier_runtime": row.get("runtime", {}).get("optimum"),
                "earlier_reference": row.get("reference", {}).get("optimum"),
                "earlier_prompt": row.get("prompt"), "earlier_steps": row.get("decode_steps")}
    return None


def bench_row(args, model: str, recipe: str, versions: dict, save) -> dict:
    """One model x recipe: both tools' lowerings, the references, the runtime; ``save(row)`` after each."""
    ckpt = checkpoint(args.models_dir, model)
    ident = checkpoint_id(ckpt)
    vocab = CHECKPOINTS[model][2]["vocab_size"]
    prompt = prompt_ids(vocab)
    work = args.scratch / "llm_scale" / f"{model}-{recipe}"
    lock = args.lock if model in BIG else None
    row = {"model": model, "recipe": recipe, "max_seq_len": MAX_SEQ_LEN, "checkpoint": ident,
           "directory": str(ckpt), "prompt": prompt, "decode_steps": args.decode}
    optimum = reused_optimum(args.reuse_optimum, model, recipe, ident, versions.get("optimum", {}).get(
        "optimum-executorch")) if "optimum" in args.tools else None
    if optimum:
        print(f"  optimum: reused from {optimum['reused_from']} ({optimum['reused_date']})", flush=True)
    elif "optimum" in args.tools:
        print("  optimum export ...", flush=True)
        with big_run_lock(lock):
            optimum = run_optimum(args.optimum_cli, ckpt, recipe, work / "optimum")
    if optimum:
        row["optimum"] = optimum
        save(row)
    if "lowerflow" in args.tools:
        print("  lowerflow lower (cold, then warm) ...", flush=True)
        with big_run_lock(lock):
            row["lowerflow"] = run_lowerflow(ckpt, recipe, work / "lowerflow", args.lowerflow_args)
        save(row)
    for tool in ("optimum", "lowerflow"):
        if "error" in row.get(tool, {}):
            print(f"  {tool}: FAILED: {row[tool]['error']}", flush=True)
    ptes = {tool: row[tool]["pte"] for tool in ("optimum", "lowerflow") if row.get(tool, {}).get("pte")}
    with big_run_lock(lock):
        row["reference"] = references(args, ckpt, recipe, prompt, row, optimum)
        save(row)
        if ptes:
            print(f"  runtime: {', '.join(ptes)} interleaved ...", flush=True)
            row["runtime"] = measure_runtime(ptes, prompt, args.decode, args.rounds)
    if optimum and not optimum.get("pte") and optimum.get("earlier_runtime"):
        row.setdefault("runtime", {})["optimum"] = {**optimum["earlier_runtime"], "earlier_run": True}
    if row.get("lowerflow", {}).get("pte"):
        Path(row["lowerflow"]["pte"]).unlink()  # the program is GBs; its figures are kept
    return row


def references(args, ckpt: Path, recipe: str, prompt: list[int], row: dict, optimum: dict | None) -> dict:
    """Each tool's eager greedy tokens (fp32: one transformers reference for both)."""
    steps, refs = args.decode, {}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if "lowerflow" in row or recipe == "fp32":
        refs["lowerflow"] = reference_tokens(sys.executable, _LOWERFLOW_REF, env, ckpt, recipe, prompt, steps)
    if recipe == "fp32":
        refs["optimum"] = refs["lowerflow"]
    elif optimum and isinstance(optimum.get("earlier_reference"), list) and (
            optimum.get("earlier_prompt"), optimum.get("earlier_steps")) == (prompt, steps):
        refs["optimum"] = optimum["earlier_reference"]
    elif optimum:
        python = str(args.optimum_venv / "bin" / "python")
        refs["optimum"] = reference_tokens(python, _OPTIMUM_REF, optimum_env(), ckpt, recipe, prompt, steps)
    return refs


# --------------------------------------------------------------------------- the table


def ratios(row: dict) -> dict:
    """lowerflow / optimum of the issue's measures (None where a side is missing)."""
    lf, op, rt = row.get("lowerflow", {}), row.get("optimum", {}), row.get("runtime", {})

    def div(a, b):
        return round(a / b, 3) if a is not None and b else None

    return {"lower_s": div(lf.get("cold", {}).get("seconds"), op.get("cold", {}).get("seconds")),
            "lower_cpu_s": div(lf.get("cold", {}).get("cpu_seconds"), op.get("cold", {}).get("cpu_seconds")),
            "tree_rss": div(lf.get("cold", {}).get("tree_rss"), op.get("cold", {}).get("tree_rss")),
            "rss": div(lf.get("cold", {}).get("rss"), op.get("cold", {}).get("rss")),
            "bytes": div(lf.get("pte_bytes"), op.get("pte_bytes")),
            "decode": div(rt.get("lowerflow", {}).get("decode_tok_s"), rt.get("optimum", {}).get("decode_tok_s")),
            "prefill": div(rt.get("lowerflow", {}).get("prefill_tok_s"), rt.get("optimum", {}).get("prefill_tok_s"))}


def token_check(row: dict, tool: str) -> str:
    """``n/N`` leading tokens equal to the tool's own eager reference."""
    got = row.get("runtime", {}).get(tool, {}).get("tokens")
    ref = row.get("reference", {}).get(tool)
    if got is None or not isinstance(ref, list):
        return "-" if got is None else f"ref {ref}"
    same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    return f"{same}/{len(got)}"


def print_row(row: dict) -> None:
    fields = []
    for tool in ("optimum", "lowerflow"):
        side = row.get(tool)
        if not side:
            continue
        cold = side.get("cold", {})
        rt = row.get("runtime", {}).get(tool, {})
        fields.append((tool + (" (reused)" if side.get("reused_from") else ""), cold.get("seconds"),
                       _warm(side), _gb(cold.get("rss")), _gb(cold.get("tree_rss")),
                       _mb(side.get("pte_bytes")), _gb(side.get("store_bytes")), rt.get("prefill_tok_s"),
                       rt.get("decode_tok_s") if not rt.get("earlier_run") else f"{rt.get('decode_tok_s')}*",
                       token_check(row, tool), side.get("error", ""), cold.get("cpu_seconds")))
    for f in fields:
        print(f"{row['model']:>8} {row['recipe']:>6} {f[0]:>18} {_s(f[1]):>7} {_s(f[11]):>7} {_s(f[2]):>11} {_s(f[3]):>6} "
              f"{_s(f[4]):>6} {_s(f[5]):>8} {_s(f[6]):>6} {_s(f[7]):>8} {_s(f[8]):>8} {f[9]:>7}  {f[10]}")
    r = ratios(row)
    rt = row.get("runtime", {})
    same = (rt.get("optimum", {}).get("tokens") == rt.get("lowerflow", {}).get("tokens")
            if "optimum" in rt and "lowerflow" in rt else None)
    print(f"{'':>8} {'':>6} {'lowerflow/optimum':>18} {_s(r['lower_s']):>7} {_s(r['lower_cpu_s']):>7} {'':>11} {_s(r['rss']):>6} "
          f"{_s(r['tree_rss']):>6} {_s(r['bytes']):>8} {'':>6} {_s(r['prefill']):>8} {_s(r['decode']):>8}"
          + (f"  fp32 tokens equal: {same}" if row["recipe"] == "fp32" and same is not None else ""))
    sys.stdout.flush()


HEADER = (f"{'model':>8} {'recipe':>6} {'tool':>18} {'lower s':>7} {'cpu s':>7} {'warm/hash s':>11} {'RSS GB':>6} {'tree':>6} "
          f"{'.pte MB':>8} {'store':>6} {'pre t/s':>8} {'dec t/s':>8} {'tokens':>7}")


def _warm(side: dict) -> str | None:
    """The warm rerun's seconds, and of them the checkpoint's hashing when measured: ``4.2/0.3``."""
    warm = side.get("warm", {}).get("seconds")
    return warm if warm is None or side.get("hash_seconds") is None else f"{warm}/{side['hash_seconds']}"


def _gb(v):
    return None if v is None else round(v / GB, 2)


def _mb(v):
    return None if v is None else round(v / 1e6, 1)


def _s(v):
    return "-" if v is None else str(v)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,qwen", help="of: " + ", ".join(CHECKPOINTS))
    parser.add_argument("--recipes", default="fp32,8da4w")
    parser.add_argument("--include-1b", action="store_true", help="add the Llama-3.2-1B-shaped model")
    parser.add_argument("--tools", default="lowerflow,optimum", help="lowerflow, optimum or both")
    parser.add_argument("--reuse-optimum", type=Path, help="an earlier run's JSON: optimum's figures from it")
    parser.add_argument("--lowerflow-args", default="", help="extra flags for lowerflow lower (unknown ones dropped)")
    parser.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH,
                        help="work files, kept programs (default $LOWERFLOW_BENCH_SCRATCH or ~/.cache/lowerflow-bench)")
    parser.add_argument("--models-dir", type=Path, help="the checkpoints (default SCRATCH/models; built when absent)")
    parser.add_argument("--optimum-venv", type=Path, help="optimum-executorch's venv (default SCRATCH/optimum-venv)")
    parser.add_argument("--lock", type=Path, default=Path("/tmp/bigrun.lock"), help="flock for Qwen-size runs")
    parser.add_argument("--decode", type=int, default=32, help="greedy decode steps per round")
    parser.add_argument("--rounds", type=int, default=6,
                        help="interleaved rounds; the first is dropped (2 kept rounds once gave SmolLM2 8da4w 0.898, 5 kept 1.014)")
    parser.add_argument("--json", type=Path, help="output JSON (default SCRATCH/llm_scale-<UTC time>.json)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # stopped with SIGTERM: unwind, so a running lowering (and its children) is stopped too, not left
    # running without the big-run lock (run_measured's finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.measure:
        _measure_main(json.loads(args.measure))
        return
    args.models_dir = args.models_dir or args.scratch / "models"
    args.optimum_venv = args.optimum_venv or args.scratch / "optimum-venv"
    args.tools = [t for t in args.tools.split(",") if t]
    args.lowerflow_args = supported_flags(shlex.split(args.lowerflow_args)) if args.lowerflow_args else []
    models = [m for m in args.models.split(",") if m] + (["llama1b"] if args.include_1b else [])
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [m for m in models if m not in CHECKPOINTS] + [r for r in recipes if r not in ("fp32", "8da4w")]
    if unknown or not set(args.tools) <= {"lowerflow", "optimum"}:
        parser.error(f"unknown model, recipe or tool: {unknown or args.tools}")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    args.json = args.json or args.scratch / f"llm_scale-{date}.json"
    args.scratch.mkdir(parents=True, exist_ok=True)
    versions = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    if "optimum" in args.tools and not (args.reuse_optimum and not args.optimum_venv.exists()):
        args.optimum_cli = ensure_optimum_venv(args.optimum_venv)
        versions["optimum"] = optimum_versions(args.optimum_venv)
    report = {"date": date, "versions": versions, "lowerflow_args": args.lowerflow_args, "rows": []}
    print(f"max_seq_len {MAX_SEQ_LEN}, XNNPACK; {PROMPT}-token prompt, {args.decode} decode steps, "
          f"{args.rounds} rounds (first dropped); optimum {versions.get('optimum', '(reused)')}")
    print(HEADER)
    print("-" * len(HEADER))
    for model in models:
        for recipe in recipes:
            print(f"{model} {recipe}:", flush=True)
            def save(row: dict) -> None:
                row["ratios"] = ratios(row)
                args.json.write_text(json.dumps({**report, "rows": report["rows"] + [row]}, indent=1))

            row = bench_row(args, model, recipe, versions, save)
            save(row)
            report["rows"].append(row)
            print_row(row)
    print(f"\nJSON: {args.json}\ntargets: lower s <= 0.5, RSS (tree) <= 1, bytes <= 1, decode >= 0.95; "
          "* = decode from the earlier run (not interleaved)")


if __name__ == "__main__":
    main()
