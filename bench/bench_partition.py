"""Stage 3 scaling: fusing N partitions into submodules, lowerflow vs ExecuTorch.

The graph is a chain of N blocks ``x = sin(x + c)`` with every ``add`` in its
own partition, so a graph of N partitions has ~2N operator nodes.  lowerflow
fuses all tags in one pass and sorts the graph once
(:func:`lowering.submodule.create_submodules`); ExecuTorch calls
``create_submodule_from_nodes`` once per partition, each re-sorting the graph.
Both are timed on fresh copies of the same tagged graph in this process.

    python bench/bench_partition.py [N ...]      (default: 24 48 96)
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

from lowering import export
from lowering.partition import TAG
from lowering.submodule import create_submodules


class Chain(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x):
        for i in range(self.n):
            x = torch.sin(x + float(i))
        return x


def tagged_graph(n: int) -> tuple[torch.fx.GraphModule, list[str]]:
    program = export(Chain(n), (torch.randn(4),))
    gm = program.graph_module
    tags = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.add.Tensor:
            tag = f"p{len(tags)}"
            node.meta[TAG] = tag
            tags.append(tag)
    return gm, tags


def time_ours(gm, tags) -> float:
    gm = copy.deepcopy(gm)
    start = time.perf_counter()
    calls = create_submodules(gm, tags)
    elapsed = time.perf_counter() - start
    assert len(calls) == len(tags)
    return elapsed


def time_executorch(gm, tags) -> float | None:
    try:
        from executorch.exir.lowered_backend_module import create_submodule_from_nodes
    except ImportError:
        return None
    gm = copy.deepcopy(gm)
    start = time.perf_counter()
    for tag in tags:
        nodes = [n for n in gm.graph.nodes if n.meta.get(TAG) == tag and n.op == "call_function"]
        create_submodule_from_nodes(gm, nodes, tag)
    return time.perf_counter() - start


def main(sizes: list[int]) -> None:
    print(f"{'partitions':>10} {'lowerflow s':>12} {'executorch s':>13} {'ratio':>7}")
    for n in sizes:
        gm, tags = tagged_graph(n)
        ours = statistics.median(time_ours(gm, tags) for _ in range(3))
        theirs = time_executorch(gm, tags)
        if theirs is None:
            print(f"{n:>10} {ours:>12.4f} {'(no executorch)':>13}")
        else:
            print(f"{n:>10} {ours:>12.4f} {theirs:>13.4f} {ours / theirs:>7.3f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [24, 48, 96])
