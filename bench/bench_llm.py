"""LLM decode on the ExecuTorch runtime: lowerflow's decoder program vs ExecuTorch's custom-ops program.

The same random-weight transformers Llama (hidden 256, 4 layers, 8 q / 4 kv heads,
head_dim 32, FFN 512, vocabulary 2048; ``--tied`` ties the embedding and the lm_head),
fp32, XNNPACK, per KV-cache length (``--cache``, default 128 and 1024):

* lowerflow: ``lowering.llm.decoder_module(hf, max_seq_len=L)`` (``llama::update_cache``
  on ``[1, L, H_kv, D]`` buffers + ``llama::custom_sdpa``) with ``decoder_example(L)``,
  ``lowering.lower(..., partitioner=partitioner_for("xnnpack"))``;
* ExecuTorch: the recipe of optimum-executorch / LLM-EXPORT.md 1.1, 1.3, 2.2: the same HF
  model with ExecuTorch's own ``CustomKVCache`` (``llama::update_cache``) per layer and a
  ``llama::custom_sdpa`` transformers attention function, ``forward(input_ids[1,S],
  cache_position[S]) -> logits[1,S,V]``, one ``Dim(max=L-1)``, ``torch.export(strict=True)``,
  ``RemoveRedundantTransposes`` + re-export, ``to_edge_transform_and_lower(XnnpackPartitioner())``,
  ``to_executorch(extract_delegate_segments, alloc_graph_input=False)`` (optimum's
  ``RemovePaddingIdxEmbeddingPass`` is not in ExecuTorch and Llama has no padding index).

Each side lowers in a fresh subprocess (ExecuTorch's custom-ops library aborts a process
where lowerflow already defined the llama ops; lowerflow's lowering time is also measured
with its own op definitions, as a user gets them), after a warm-up lowering of a small MLP
(one-time costs).  Lowering seconds include export.  The measuring process loads ExecuTorch's
custom-ops library first and runs both programs: per round, ten 8-token prefills then
``--decode`` greedy decode steps, the two programs interleaved call by call (:func:`measure`);
the first round is dropped; tokens/s of the median call.  Columns: lowering seconds, .pte bytes, prefill and decode tokens/s, the
prefill logits' max |Δ| against eager transformers (no cache), and whether both programs
generate the same tokens.

    python bench/bench_llm.py [--cache 128 1024] [--rounds 6] [--decode 100] [--tied]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench_xnnpack's warm-up flows

CONFIG = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=32, max_position_embeddings=2048,
)
PROMPT = 8
ET_ATTENTION = "executorch_custom_sdpa"


def hf_model(tied: bool) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config).eval()


# --------------------------------------------------------------------------- ExecuTorch's side


def _executorch_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """optimum's ``custom_sdpa`` attention with ExecuTorch's ``CustomKVCache`` as the cache:
    ``query``/``key``/``value`` ``[B, H, S, D]`` (new tokens); returns ``([B, S, Hq, D], None)``."""
    input_pos = kwargs["position_ids"][0]
    k_cache, v_cache = module.__dict__["_executorch_kv"].update(input_pos, key, value)  # [B, H, L, D]
    out = torch.ops.llama.custom_sdpa(
        query.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
        input_pos[0].item(), None, 0.0, True, scaling,
    )
    return out, None


class ExecuTorchDecoder(torch.nn.Module):
    """The HF model with one ExecuTorch ``CustomKVCache`` per layer: ``forward(input_ids, cache_position)``."""

    def __init__(self, hf: torch.nn.Module, max_seq_len: int):
        super().__init__()
        from executorch.examples.models.llama.source_transformation.custom_kv_cache import CustomKVCache
        from transformers import AttentionInterface

        AttentionInterface.register(ET_ATTENTION, _executorch_attention)
        config = hf.config
        self.model = hf
        self.kv = torch.nn.ModuleList(
            CustomKVCache(1, max_seq_len, config.num_key_value_heads, config.head_dim)
            for _ in range(config.num_hidden_layers)
        )
        for module in hf.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "q_proj"):
                module.__dict__["_executorch_kv"] = self.kv[module.layer_idx]  # not a submodule twice
        config._attn_implementation = ET_ATTENTION

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=cache_position.unsqueeze(0), use_cache=False).logits


def lower_executorch(max_seq_len: int, tied: bool) -> tuple[float, bytes]:
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (llama ops, ExecuTorch's definitions)
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.extension.llm.export.export_passes import RemoveRedundantTransposes

    module = ExecuTorchDecoder(hf_model(tied), max_seq_len).eval()
    seq = torch.export.Dim("seq_length_dim", max=max_seq_len - 1)
    example = (torch.zeros(1, 3, dtype=torch.long), torch.arange(3, dtype=torch.long))
    dynamic = {"input_ids": {1: seq}, "cache_position": {0: seq}}
    start = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(module, example, dynamic_shapes=dynamic, strict=True)
        cleaned = RemoveRedundantTransposes()(ep.module()).graph_module
        ep = torch.export.export(cleaned, example, dynamic_shapes=dynamic, strict=True)
        edge = to_edge_transform_and_lower(
            ep, partitioner=[XnnpackPartitioner()],
            compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
        )
        program = edge.to_executorch(ExecutorchBackendConfig(
            extract_delegate_segments=True, do_quant_fusion_and_const_prop=True,
            memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
        ))
        pte = bytes(program.buffer)
    return time.perf_counter() - start, pte


# --------------------------------------------------------------------------- lowerflow's side


def lower_lowerflow(max_seq_len: int, tied: bool) -> tuple[float, bytes]:
    from lowering.llm import decoder_example, decoder_module
    from lowering.lower import lower
    from lowering.targets import partitioner_for

    module = decoder_module(hf_model(tied), max_seq_len=max_seq_len).eval()
    example, dynamic = decoder_example(max_seq_len)
    start = time.perf_counter()
    with torch.no_grad():
        pte = lower(module, example, partitioner=partitioner_for("xnnpack"), dynamic_shapes=dynamic).pte
    return time.perf_counter() - start, pte


SIDES = {"executorch": lower_executorch, "lowerflow": lower_lowerflow}


def lower_in_subprocess(side: str, max_seq_len: int, tied: bool, out: Path) -> float:
    """Lower in a fresh process (after a warm-up lowering of a small MLP); returns its seconds."""
    cmd = [sys.executable, __file__, "--lower", side, "--cache", str(max_seq_len), "--out", str(out)]
    done = subprocess.run(cmd + (["--tied"] if tied else []), capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"{side} lowering (cache {max_seq_len}) failed, exit {done.returncode}:\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def _lower_main(side: str, max_seq_len: int, tied: bool, out: Path) -> None:
    import logging

    import bench_xnnpack
    from examples.models import MODELS

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    warm = bench_xnnpack.lower_executorch if side == "executorch" else bench_xnnpack.lower_lowerflow
    warm(MODELS["mlp"])
    seconds, pte = SIDES[side](max_seq_len, tied)
    out.write_bytes(pte)
    print(json.dumps({"seconds": seconds}))


# --------------------------------------------------------------------------- measuring


def _call(method, ids: torch.Tensor, start: int) -> tuple[float, torch.Tensor]:
    """One ``forward(input_ids, cache_position)`` call: (seconds, logits)."""
    positions = torch.arange(start, start + ids.shape[1], dtype=torch.long)
    begin = time.perf_counter()
    (logits,) = method.execute([ids, positions])
    return time.perf_counter() - begin, logits


def _last_row(logits: torch.Tensor) -> torch.Tensor:
    """The last position's logits of ``[1, S, V]`` or ``[1, V]`` (a last-token-logits program)."""
    return logits.reshape(-1, logits.shape[-1])[-1]


def measure(ptes: list[bytes | str], prompt: torch.Tensor, steps: int, rounds: int, prefills: int = 10) -> list[dict]:
    """Per program (its bytes or a path): prefill and decode tokens/s from the median call.

    Interleaved call by call, so a burst of load from elsewhere falls on both
    programs alike: per round, ``prefills`` prefills of each program in turn (the
    same positions, rewritten), then decode step ``i`` of each program in turn
    (the order flips every call); the first round is dropped.
    """
    from executorch.runtime import Runtime

    runtime = Runtime.get()
    programs = [runtime.load_program(p) for p in ptes]  # kept alive: a Method needs its Program
    methods = [p.load_method("forward") for p in programs]
    order = list(range(len(methods)))
    prefill: list[list[float]] = [[] for _ in methods]
    decode: list[list[float]] = [[] for _ in methods]
    results: list[dict] = [{} for _ in methods]
    for r in range(rounds):
        tokens: list[list[int]] = [[] for _ in methods]
        for _ in range(prefills):
            order.reverse()
            for i in order:
                seconds, logits = _call(methods[i], prompt, 0)
                prefill[i] += [seconds] * bool(r)
                results[i]["logits"] = logits.clone()
        for i in order:
            tokens[i].append(int(_last_row(results[i]["logits"]).argmax()))
        for step in range(steps):
            order.reverse()
            for i in order:
                seconds, logits = _call(methods[i], torch.tensor([[tokens[i][-1]]]), prompt.shape[1] + step)
                decode[i] += [seconds] * bool(r)
                tokens[i].append(int(_last_row(logits).argmax()))
        for i, result in enumerate(results):
            result["tokens"] = tokens[i]
    for i, result in enumerate(results):
        result.update(prefill=prompt.shape[1] / statistics.median(prefill[i]),
                      decode=1 / statistics.median(decode[i]))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds; the first is dropped")
    parser.add_argument("--decode", type=int, default=100, help="greedy decode steps after the prefill")
    parser.add_argument("--tied", action="store_true", help="tie the embedding and the lm_head")
    parser.add_argument("--lower", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.lower:
        _lower_main(args.lower, args.cache[0], args.tied, args.out)
        return
    warnings.filterwarnings("ignore")
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (llama::*.out kernels, first)

    torch.manual_seed(1)
    prompt = torch.randint(0, CONFIG["vocab_size"], (1, PROMPT))
    with torch.no_grad():
        expected = hf_model(args.tied)(input_ids=prompt, use_cache=False).logits
    print(f"Llama {CONFIG}, tied={args.tied}, fp32 XNNPACK; {PROMPT}-token prefill + {args.decode} greedy steps; "
          f"median calls of {args.rounds - 1} rounds, interleaved call by call\n")
    header = (f"{'cache':>5}   {'ET s':>6} {'LF s':>6} {'time':>6}   {'ET bytes':>10} {'LF bytes':>10} {'bytes':>6}   "
              f"{'ET pre/s':>8} {'LF pre/s':>8} {'ET dec/s':>8} {'LF dec/s':>8} {'decode':>6}   "
              f"{'ET |Δ|':>8} {'LF |Δ|':>8} same")
    print(header)
    print("-" * len(header))
    for cache in args.cache:
        if PROMPT + args.decode > cache:
            raise SystemExit(f"cache {cache} < {PROMPT} + {args.decode} tokens")
        with tempfile.TemporaryDirectory(prefix="bench_llm_") as tmp:
            et_s = lower_in_subprocess("executorch", cache, args.tied, Path(tmp, "et.pte"))
            lf_s = lower_in_subprocess("lowerflow", cache, args.tied, Path(tmp, "lf.pte"))
            et_pte, lf_pte = Path(tmp, "et.pte").read_bytes(), Path(tmp, "lf.pte").read_bytes()
        et, lf = measure([et_pte, lf_pte], prompt, args.decode, args.rounds)
        et_err, lf_err = (float((r["logits"] - expected).abs().max()) for r in (et, lf))
        print(f"{cache:5}   {et_s:6.2f} {lf_s:6.2f} {lf_s / et_s:6.3f}   {len(et_pte):10,} {len(lf_pte):10,} "
              f"{len(lf_pte) / len(et_pte):6.3f}   {et['prefill']:8.0f} {lf['prefill']:8.0f} "
              f"{et['decode']:8.0f} {lf['decode']:8.0f} {lf['decode'] / et['decode']:6.3f}   "
              f"{et_err:8.1e} {lf_err:8.1e} {et['tokens'] == lf['tokens']}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
