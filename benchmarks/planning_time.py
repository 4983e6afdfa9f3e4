"""Planning time: Llama-3-8B-shaped models (hidden 4096, 32 heads, 8 KV heads, FFN 14336,
vocab 128256, sequence 4096, batch 8) on the meta device, planned for simulated H100 meshes.

    python -m benchmarks.planning_time                 # 2, 8, 32 layers on (8,), (2, 4), (8, 8)
    python -m benchmarks.planning_time --layers 2 --meshes 8x8

Prints a markdown table: seconds to trace, to enumerate strategies, to cluster and build the
ILP, to solve it, and for the whole `autopar.plan` call (which adds describing the plan), plus
the planner's peak memory and the ILP's size. Each row runs in a fresh process, so "peak MiB"
is that process's peak resident set beyond what it held after importing torch, transformers
and autopar and building the meta-device model.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

import autopar
from autopar.passes import strategies
from autopar.passes.cluster import cluster
from autopar.passes.trace import trace
from autopar.solver.cost import CostModel
from autopar.solver.ilp import solve
from autopar.zoo import hf_llama, lm_loss

REPO_ROOT = Path(__file__).resolve().parents[1]


def llama8b(layers: int):
    """Hugging Face Llama at Llama-3-8B widths with `layers` layers, on the meta device."""
    with torch.device("meta"):
        return hf_llama(num_hidden_layers=layers, hidden_size=4096, num_attention_heads=32,
                        num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                        max_position_embeddings=8192)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(layers: int, mesh: tuple[int, ...]) -> dict:
    model = llama8b(layers)
    ids = torch.randint(0, 128256, (8, 4096), device="meta")
    spec = autopar.MeshSpec(mesh, hardware="h100")
    before = rss_mib()
    t0 = time.perf_counter()
    program = trace(model, (ids,), lm_loss, ids)
    t1 = time.perf_counter()
    graph = strategies.build(program, mesh)
    t2 = time.perf_counter()
    clusters = cluster(graph, program.graph_module)
    # planning speed, not feasibility: no memory budget (8 x 4096 tokens of Llama-8B do not fit
    # 8 devices without pipeline stages)
    sol = solve(graph, CostModel(spec), clustering=clusters)
    t3 = time.perf_counter()
    start = time.perf_counter()
    plan = autopar.plan(model, spec, (ids, ids), loss_fn=lm_loss, memory_budget=float("inf"))
    whole = time.perf_counter() - start
    return {"layers": layers, "mesh": "x".join(map(str, mesh)), "nodes": len(graph.nodes),
            "owners": len(clusters.owners()), "vars": sol.num_variables,
            "trace": t1 - t0, "strategies": t2 - t1, "build+solve": t3 - t2,
            "solver": sol.solve_time, "plan()": whole, "peak MiB": rss_mib() - before,
            "step ms": plan.cost.step_time * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="2,8,32")
    ap.add_argument("--meshes", default="8,2x4,8x8")
    ap.add_argument("--one", action="store_true", help="(internal) one row, printed as JSON")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run(int(args.layers), tuple(int(s) for s in args.meshes.split("x")))))
        return
    rows = []
    for layers in map(int, args.layers.split(",")):
        for m in args.meshes.split(","):
            out = subprocess.run([sys.executable, "-m", "benchmarks.planning_time", "--one",
                                  "--layers", str(layers), "--meshes", m], cwd=REPO_ROOT,
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    cols = ["layers", "mesh", "nodes", "owners", "vars", "trace", "strategies", "build+solve",
            "plan()", "peak MiB", "step ms"]
    print("\n| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c])
                                for c in cols) + " |")


if __name__ == "__main__":
    main()
