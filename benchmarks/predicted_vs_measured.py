"""Predicted vs measured step time of several plans of one model on a gloo world.

    python -m benchmarks.predicted_vs_measured              # GPT on 4 ranks, 8 plans
    python -m benchmarks.predicted_vs_measured --tiny       # seconds: checks the mechanics
    python -m benchmarks.predicted_vs_measured --memory     # bytes per rank, measured vs model

1. Calibrate the world (autopar.calibrate on a 1-D and a 2-D mesh: links per mesh dimension and
   per-rank compute, every rank busy at once).
2. Plan the model for each configuration with the calibrated profile: forced styles on a 1-D
   mesh (data, fsdp, tensor), their 2-D combinations, and the solver's own choices.
3. Run every plan on the ranks, interleaved in rounds so that other load on the machine hits
   every plan alike, and take the median step time (forward, backward, gradient sync: what the
   cost model prices; the optimizer step is not part of it).
4. Print a markdown table (predicted = compute + communication, measured, error) and the
   Spearman rank correlation of predicted and measured times.

Timings depend on the machine and what else runs on it; they are never asserted by the tests
(tests/test_cost_model.py runs this script on a tiny configuration for its mechanics only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import autopar
from autopar.hardware import HardwareProfile
from tests import cost_tasks
from tests.world import World

CONFIGS = [
    ((4,), "data"),
    ((4,), "fsdp"),
    ((4,), "tensor"),
    ((2, 2), {"dp": "data", "tp": "tensor"}),
    ((2, 2), {"dp": "fsdp", "tp": "tensor"}),
    ((2, 2), "fsdp"),
    ((4,), None),
    ((2, 2), None),
]
MODELS = {
    "gpt": ("gpt", {"vocab_size": 512, "block_size": 64, "n_layer": 2, "n_head": 4,
                    "n_embd": 128, "batch": 8}),
    "mid": ("gpt", {"vocab_size": 2048, "block_size": 128, "n_layer": 2, "n_head": 4,
                    "n_embd": 256, "batch": 8}),
    "tiny": ("gpt", {"vocab_size": 64, "block_size": 16, "n_layer": 1, "n_head": 4,
                     "n_embd": 32, "batch": 4}),
}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else 0.0


def label(shape, force) -> str:
    if force is None:
        return f"{'x'.join(map(str, shape))} solver"
    if isinstance(force, str):
        return f"{'x'.join(map(str, shape))} {force}"
    return f"{'x'.join(map(str, shape))} " + "+".join(f"{k}:{v}" for k, v in force.items())


def names(shape) -> tuple[str, ...]:
    return ("dp",) if len(shape) == 1 else ("dp", "tp")


def run(model: str = "gpt", world_size: int = 4, rounds: int = 5, steps: int = 3,
        configs=None, min_time: float = 0.02, sizes=None, out=print, world=None,
        ops: bool = False) -> dict:
    """Calibrate, plan, measure; print the table; return the rows and the statistics. A
    running `world` (tests.world.World) of `world_size` ranks is used if given. With `ops`,
    the same plans are also priced with op times measured on the ranks (autopar.profile)."""
    spec = MODELS[model]
    configs = configs or CONFIGS
    own = world is None
    world = world or World(world_size)
    load = os.getloadavg()
    try:
        world.start()
        t0 = time.perf_counter()
        profiles: dict = {}
        for shape in sorted({s for s, _ in configs}, key=len):
            # Links per mesh; per-rank compute measured once, for every mesh alike.
            kwargs = {"min_time": min_time, "compute_time": max(0.01, 5 * min_time),
                      "compute": not profiles}
            if sizes:
                kwargs["sizes"] = sizes
            prof = HardwareProfile.from_dict(
                world.run(cost_tasks.calibrated_profile, shape, **kwargs)[0])
            if profiles:
                first = next(iter(profiles.values()))
                prof = replace(prof, flops=first.flops, memory_bandwidth=first.memory_bandwidth,
                               launch=first.launch, view_launch=first.view_launch,
                               measured={**prof.measured,
                                         "compute": first.measured.get("compute")})
            profiles[shape] = prof
        calibration = time.perf_counter() - t0
        net, loss_fn, (x, y) = cost_tasks.build(spec)
        plans = []
        for shape, force in configs:
            mesh = autopar.MeshSpec(shape, names=names(shape), hardware=profiles[shape])
            plans.append(autopar.plan(net, mesh, (x, y), loss_fn=loss_fn, force=force))
        by_ops = None
        if ops:
            times = world.run(cost_tasks.op_times, spec, list(profiles),
                              next(iter(profiles.values())).to_dict())[0]
            by_ops = [reprice(p, net, (x, y), loss_fn, times) for p in plans]
        times = world.run(cost_tasks.compare_plans, spec,
                          [(shape, p.to_dict()) for (shape, _), p in zip(configs, plans)],
                          rounds=rounds, steps=steps)[0]
    finally:
        if own:
            world.close()
    rows = []
    for i, ((shape, force), p, ts) in enumerate(zip(configs, plans, times)):
        measured = statistics.median(ts)
        row = {"plan": label(shape, force), "hash": p.hash(),
               "predicted": p.cost.step_time, "compute": p.cost.compute,
               "communication": p.cost.communication_total, "measured": measured,
               "error": p.cost.step_time / measured - 1}
        if by_ops:
            row["predicted_ops"] = by_ops[i].step_time
            row["error_ops"] = by_ops[i].step_time / measured - 1
        rows.append(row)
    rho = spearman([r["predicted"] for r in rows], [r["measured"] for r in rows])
    worst = max(abs(r["error"]) for r in rows)

    for shape, prof in profiles.items():
        links = prof.measured["links"]
        out(f"calibration on mesh {shape}: " + "; ".join(
            f"dim {k}: alpha {d['alpha'] * 1e6:.0f} us, bandwidth {d['bandwidth'] / 1e9:.2f} GB/s"
            for k, d in links.items()) + f"; per rank: float32 {prof.flops['float32'] / 1e9:.1f} "
            f"GFLOP/s, memory {prof.memory_bandwidth / 1e9:.1f} GB/s, op "
            f"{prof.launch * 1e6:.1f} us, view {prof.view_launch * 1e6:.1f} us")
        link = prof.intra_node
        out("  link " + link.name + ": " + ", ".join(
            f"{k} alpha {a * 1e6:.0f} us bw {b / 1e9:.2f} GB/s" for k, a, b in link.per_kind))
    out(f"(calibration took {calibration:.1f} s)")
    out("")
    out(f"model {model} {spec[1]}, {world_size} gloo ranks on {os.cpu_count()} cores, median "
        f"of {rounds} x {steps} steps; load average before/after: {load[0]:.1f}/"
        f"{os.getloadavg()[0]:.1f}")
    out("")
    extra = " predicted with measured ops ms | error |" if by_ops else ""
    out("| plan | predicted ms | compute ms | comm ms | measured ms | error |" + extra)
    out("| --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if by_ops else ""))
    for r in rows:
        more = f" {r['predicted_ops'] * 1e3:.2f} | {r['error_ops'] * 100:+.0f}% |" \
            if by_ops else ""
        out(f"| {r['plan']} | {r['predicted'] * 1e3:.2f} | {r['compute'] * 1e3:.2f} | "
            f"{r['communication'] * 1e3:.2f} | {r['measured'] * 1e3:.2f} | "
            f"{r['error'] * 100:+.0f}% |" + more)
    out("")
    out(f"Spearman rank correlation {rho:.3f}; largest error {worst * 100:.0f}%")
    result = {"rows": rows, "spearman": rho, "worst_error": worst,
              "profiles": {str(k): v.to_dict() for k, v in profiles.items()}}
    if by_ops:
        result["spearman_ops"] = spearman([r["predicted_ops"] for r in rows],
                                          [r["measured"] for r in rows])
        result["worst_error_ops"] = max(abs(r["error_ops"]) for r in rows)
        out(f"with measured op times: Spearman {result['spearman_ops']:.3f}; largest error "
            f"{result['worst_error_ops'] * 100:.0f}%")
    return result


def reprice(plan, model, example, loss_fn, op_times: dict):
    """The cost of the same plan with measured op times in place of the roofline."""
    from autopar.choice import choice_from_plan
    from autopar.describe import describe
    from autopar.passes import strategies
    from autopar.passes.trace import trace_example
    from autopar.solver.cost import CostModel
    program = trace_example(model, example, loss_fn)
    graph = strategies.build(program, plan.mesh.shape)
    measured = {k: tuple(v) for k, v in op_times.items() if v is not None}
    cost = CostModel(plan.mesh, graph=graph, measured=measured)
    return describe(program, graph, plan.mesh, cost, choice_from_plan(plan, graph)).cost


MEMORY_CASES = [("gpt", (4,), "data"), ("gpt", (4,), "fsdp"), ("gpt", (4,), "tensor"),
                ("gpt", (2, 2), {"dp": "fsdp", "tp": "tensor"}), ("hf_llama", (4,), "data"),
                ("hf_llama", (4,), "fsdp"), ("hf_llama", (4,), "tensor"),
                ("hf_llama", (2, 2), {"dp": "fsdp", "tp": "tensor"})]


def memory_table(world_size: int = 4, cases=None, out=print, world=None) -> list[dict]:
    """Bytes per rank after one AdamW step, measured (parameters, gradients and optimizer
    state summed over the rank's tensors; activations: distinct storages autograd saved) and
    predicted by the plan, as a markdown table."""
    own = world is None
    world = world or World(world_size)
    rows = []
    try:
        world.start()
        for name, shape, force in cases or MEMORY_CASES:
            r = world.run(cost_tasks.measured_memory, name, shape, force)[0]
            rows.append({"model": name, "plan": label(shape, force), **{
                f"{k}_{w}": r[w][k] for k in r["measured"] for w in ("measured", "predicted")}})
    finally:
        if own:
            world.close()
    kinds = ("parameters", "gradients", "optimizer", "activations")
    out("| model | plan | " + " | ".join(f"{k} measured / predicted" for k in kinds) + " |")
    out("| --- | --- |" + " ---: |" * len(kinds))
    for r in rows:
        cells = []
        for k in kinds:
            m, p = r[f"{k}_measured"], r[f"{k}_predicted"]
            cells.append(f"{m:,.0f} / {p:,.0f}" + ("" if m == p else f" ({p / m - 1:+.1%})"))
        out(f"| {r['model']} | {r['plan']} | " + " | ".join(cells) + " |")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mid", choices=sorted(MODELS))
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ops", action="store_true",
                        help="also price the plans with op times measured on the ranks")
    parser.add_argument("--memory", action="store_true",
                        help="instead: measured vs predicted memory per rank after a step")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model, two plans, one round: checks the mechanics")
    args = parser.parse_args(argv)
    if args.memory:
        memory_table(args.world)
    elif args.tiny:
        run("tiny", args.world, rounds=1, steps=1,
            configs=[((args.world,), "data"), ((args.world,), "tensor")], min_time=0.001,
            sizes=(2**12, 2**16))
    else:
        run(args.model, args.world, args.rounds, args.steps, ops=args.ops)


if __name__ == "__main__":
    main()
