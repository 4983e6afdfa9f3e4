"""Planning time: Llama-3-shaped models (8B: hidden 4096, 32 heads, 8 KV heads, FFN 14336; 70B:
hidden 8192, 64 heads, 8 KV heads, FFN 28672; 405B (126 layers): hidden 16384, 128 heads, 8 KV
heads, FFN 53248; vocabulary 128256, sequence 4096, batch 8) on the meta device, planned for
simulated H100 meshes.

    python -m benchmarks.planning_time                      # 8B 2 and 32 layers, 70B 80, (8, 8)
    python -m benchmarks.planning_time --rows 8b:32:8x8,70b:80:8x8
    python -m benchmarks.planning_time --search 8b:32:64,70b:80:1024   # the mesh search
    python -m benchmarks.planning_time --search 70b:80:1024 --flat  # without pp meshes

Prints a markdown table: seconds to trace, to enumerate strategies, to cluster and build the
ILP and solve it, for the whole `autopar.plan` call under the H100's memory (where the planner
searches recomputation and microbatches; the process's first call, cold, as a user's is), with
what that plan chose, and for the whole call without a memory budget (after the others, warm),
plus the planner's peak memory and the ILP's size. Each row runs in a
fresh process, so "peak MiB" is that process's peak resident set beyond what it held after
importing torch, transformers and autopar and building the meta-device model.
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


SHAPES = {
    "8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336),
    "70b": dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=28672),
    "405b": dict(hidden_size=16384, num_attention_heads=128, num_key_value_heads=8,
                 intermediate_size=53248),
}


def llama(size: str, layers: int):
    """Hugging Face Llama at Llama-3 `size` ("8b", "70b") widths with `layers` layers, on the
    meta device."""
    with torch.device("meta"):
        return hf_llama(num_hidden_layers=layers, vocab_size=128256,
                        max_position_embeddings=8192, **SHAPES[size])


def llama8b(layers: int):
    """Hugging Face Llama at Llama-3-8B widths with `layers` layers, on the meta device."""
    return llama("8b", layers)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(size: str, layers: int, mesh: tuple[int, ...]) -> dict:
    model = llama(size, layers)
    ids = torch.randint(0, 128256, (8, 4096), device="meta")
    spec = autopar.MeshSpec(mesh, hardware="h100")
    before = rss_mib()
    start = time.perf_counter()  # first, cold: what a user's one call takes
    plan = autopar.plan(model, spec, (ids, ids), loss_fn=lm_loss)
    budgeted = time.perf_counter() - start
    t0 = time.perf_counter()
    program = trace(model, (ids,), lm_loss, ids)
    t1 = time.perf_counter()
    graph = strategies.build(program, mesh, zero=True)
    t2 = time.perf_counter()
    clusters = cluster(graph, program.graph_module)
    sol = solve(graph, CostModel(spec, graph=graph), clustering=clusters)
    t3 = time.perf_counter()
    start = time.perf_counter()
    free = autopar.plan(model, spec, (ids, ids), loss_fn=lm_loss, memory_budget=float("inf"))
    whole = time.perf_counter() - start
    return {"model": size, "layers": layers, "mesh": "x".join(map(str, mesh)),
            "nodes": len(graph.nodes), "owners": len(clusters.owners()),
            "vars": sol.num_variables, "trace": t1 - t0, "strategies": t2 - t1,
            "build+solve": t3 - t2, "plan() no budget": whole, "plan() 80 GB": budgeted,
            "chose": f"{plan.accumulation} microbatch(es), recompute {plan.recompute.mode}, "
                     f"peak {plan.cost.peak_memory / 2**30:.1f} GiB",
            "peak MiB": rss_mib() - before, "step ms": free.cost.step_time * 1e3,
            "folded": program.folded}


def search(size: str, layers: int, devices: int, pipeline: bool | None = None) -> None:
    """Time the mesh search for `devices` H100s (8 per node), one 4096-token sequence per
    device, bf16-mixed, under the H100's memory (`pipeline`: `Cluster.pipeline`, whether
    pipelined meshes are among the candidates); print the ranking of the shapes tried."""
    model = llama(size, layers)
    ids = torch.randint(0, 128256, (devices, 4096), device="meta")
    start = time.perf_counter()
    plan = autopar.plan(model, autopar.Cluster(devices, hardware="h100", pipeline=pipeline),
                        (ids, ids),
                        loss_fn=lm_loss, precision="bf16-mixed")
    took = time.perf_counter() - start
    print(f"\n{size} ({layers} layers) on {devices} H100s: mesh search {took:.1f} s, chose "
          f"{'x'.join(map(str, plan.mesh.shape))} {plan.mesh.names}\n")
    print("| mesh | names | step s | peak GiB | plan s | why not |\n|---|---|---|---|---|---|")
    for row in plan.mesh_search:
        step = f"{row['step_time']:.3f}" if row.get("step_time") else "-"
        peak = f"{row['peak_memory'] / 2**30:.1f}" if row.get("peak_memory") else "-"
        print(f"| {'x'.join(map(str, row['shape']))} | {','.join(row['names'])} | {step} | "
              f"{peak} | {row['seconds']:.1f} | {row['why']} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8b:2:8x8,8b:32:8x8,70b:80:8x8",
                    help="model:layers:mesh, comma-separated")
    ap.add_argument("--search", help="model:layers:devices, comma-separated: time the mesh "
                                     "search instead (e.g. 8b:32:64,70b:80:1024)")
    ap.add_argument("--flat", action="store_true", help="with --search: no pipelined meshes "
                    "(pp x dp x tp) among the candidates (by default they are, as in Cluster)")
    ap.add_argument("--pipeline", action="store_true", help="(the default; kept for the "
                    "commands RESULTS.md gives)")
    ap.add_argument("--one", help="(internal) one row, printed as JSON")
    args = ap.parse_args()
    if args.search:
        for row in args.search.split(","):
            size, layers, devices = row.split(":")
            search(size, int(layers), int(devices), False if args.flat else None)
        return
    if args.one:
        size, layers, mesh = args.one.split(":")
        print(json.dumps(run(size, int(layers), tuple(int(s) for s in mesh.split("x")))))
        return
    rows = []
    for row in args.rows.split(","):
        out = subprocess.run([sys.executable, "-m", "benchmarks.planning_time", "--one", row],
                             cwd=REPO_ROOT, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    cols = ["model", "layers", "mesh", "nodes", "owners", "vars", "trace", "strategies",
            "build+solve", "plan() no budget", "plan() 80 GB", "chose", "peak MiB"]
    print("\n| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c])
                                for c in cols) + " |")


if __name__ == "__main__":
    main()
