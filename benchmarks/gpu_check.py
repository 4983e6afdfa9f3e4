"""The cost model against one GPU: op times, whole steps, and autopar's NCCL path on a world
of one.

    python -m benchmarks.gpu_check --out DIR          # on a machine with one CUDA GPU
    python -m benchmarks.gpu_check --small --out DIR  # tiny sizes: checks the mechanics (CPU)

Each part prints a markdown table and all of it lands in DIR/gpu_check.json (and the op
profile in DIR, autopar.profile's cache file); a part that fails prints its traceback and the
others still run.

1. `device`: the GPU, and its ceilings measured here: a bf16 8192^3 product and a copy.
2. `gemm`: bf16 products of the shapes Llama-3 8B and 70B training runs (torchtitan's local
   batches: 2 x 8192 tokens; 70B with 8-way tensor parallelism), plus skinny ones, each
   timed against the cost model's price (autopar.solver.efficiency on the built-in profile of
   this GPU: "h100", or "h200" for an H200).
3. `sweep`: a grid of GEMM shapes (rows 256 to 65,536, widths 128 to 16,384) timed back to
   back, twice in shuffled orders: the measured shares autopar/measured.py keeps.
4. `kernels`: attention by SDPA backend (default, flash, cuDNN, memory-efficient),
   cross-entropy over a 128k vocabulary in bf16 and float32, an embedding's lookup.
5. `attention`: causal SDPA (the default backend), head dimension 128, 16,384 tokens per
   call at several sequence lengths, forward and backward, against the profile's table.
6. `ops`: every op of a Llama-3 8B-wide model (torchtitan's, autopar.zoo.Llama3, two layers)
   at 2 x 8192 tokens, traced in bf16 as the planner traces it, timed by
   `autopar.profile.OpProfiler` on this GPU, against the cost model's price of the same op;
   summed by kind.
7. `steps`: forward + backward of that model with 2 and 4 layers in plain PyTorch eager (bf16
   parameters, the loss on float32 logits) against the plan's predicted compute, priced on
   the roofline and on the measured op times: what a whole step adds to the sum of its ops.
8. `nccl`: autopar on a world of one GPU over NCCL: a small Llama in fp32 (TF32 off) and in
   bf16-mixed against the same model on one device (loss and gradients), gradient
   accumulation over two microbatches with unevenly padded targets (fp32) against the whole
   batch, then the 8B-wide two-layer model built on the meta device, materialized by
   `autopar.parallelize` on the GPU and trained (forward + backward + AdamW) in bf16-mixed:
   measured step and peak memory against the plan's prediction and against plain PyTorch.
9. `recompute`: the 8B-wide model with four layers trained by autopar under each
   recomputation mode: step and peak memory against the plan's.
10. `layers` (not in the default list): torchtitan's 8B per-GPU step on one GPU,
   extrapolated from 4 and 8 layers under selective recomputation, with the default
   attention kernel and with FlashAttention-2.
11. `timeline` (not in the default list): one forward + backward of the 8B-wide model with
   four layers under `torch.profiler`, plain eager and autopar (bf16-mixed, selective
   recomputation): kernel time by phase (forward, or the autograd function whose backward
   ran it), aten op and input shapes, against the step's wall time; and the bandwidth of
   casts and copies (`copy_rates`: what autopar/measured.py keeps as COPY_H200).
12. `power` (not in the default list; needs nvidia-smi): power draw and clocks while the GPU
   runs bf16 products and plain eager steps for a few seconds each.
13. `titan` (not in the default list): torchtitan's 8B per-GPU step less FSDP, extrapolated
   from 4 and 8 layers: plain eager with its op-level selective checkpointing and
   FlashAttention-2.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

import autopar
from autopar.calibrate import device_sync, time_per_call
from autopar.hardware import get_profile
from autopar.passes import strategies
from autopar.passes.trace import trace
from autopar.profile import OpProfiler
from autopar.solver.cost import CostModel
from autopar.solver.efficiency import attention_rate, matmul_efficiency
from autopar.solver.flops import facts, is_view
from autopar.zoo import Llama3, Llama3Config, lm_loss

BIG = dict(dim=4096, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336)
SMALL = dict(dim=256, n_heads=4, n_kv_heads=2, vocab_size=1024, ffn_dim=512)


def timed(fn, device, warmup: int = 2, repeat: int = 5) -> float:
    """Median seconds of `fn` over `repeat` calls after `warmup`, each waited for."""
    sync = device_sync(device)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_for(device: torch.device):
    """The built-in profile of this device (the CPU profile off GPUs)."""
    if device.type != "cuda":
        return get_profile("cpu")
    return get_profile("h200" if "H200" in torch.cuda.get_device_name(device) else "h100")


# -- device ---------------------------------------------------------------------------------------
def device_part(device, small: bool) -> dict:
    """The device and its ceilings: a bf16 product's TFLOP/s and a copy's bandwidth."""
    n = 512 if small else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm = timed(lambda: a @ b, device, 3, 10)
    numel = 2**22 if small else 2**30
    x = torch.empty(numel, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_s = timed(lambda: y.copy_(x), device, 3, 10)
    out = {"torch": torch.__version__, "device": str(device),
           "bf16_matmul_tflops": 2 * n**3 / mm / 1e12,
           "copy_GBps": 2 * x.numel() * x.element_size() / copy_s / 1e9}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out.update(name=p.name, sms=p.multi_processor_count, memory_GiB=p.total_memory / 2**30)
    print("\n## device\n")
    for k, v in out.items():
        print(f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}")
    return out


# -- gemm -----------------------------------------------------------------------------------------
def gemm_shapes(small: bool) -> list[tuple[str, int, int, int]]:
    """(label, M, N, K): Llama-3 8B's products at 2 x 8192 tokens (forward; backward's input
    gradient is M x K x N and weight gradient N x K x M), 70B's under 8-way tensor
    parallelism at 16 x 8192 tokens, and skinny ones."""
    if small:
        return [("small", 256, 256, 256), ("skinny", 16, 256, 256)]
    t8, t70 = 2 * 8192, 16 * 8192
    return [
        ("8B wq/wo", t8, 4096, 4096), ("8B wk/wv", t8, 1024, 4096),
        ("8B w1/w3", t8, 14336, 4096), ("8B w2", t8, 4096, 14336),
        ("8B output", t8, 128256, 4096),
        ("8B w1 input grad", t8, 4096, 14336), ("8B w1 weight grad", 14336, 4096, t8),
        ("8B wk weight grad", 1024, 4096, t8), ("8B output weight grad", 128256, 4096, t8),
        ("70B/tp8 wq", t70, 1024, 8192), ("70B/tp8 wk", t70, 128, 8192),
        ("70B/tp8 w1", t70, 3584, 8192), ("70B/tp8 w2", t70, 8192, 3584),
        ("70B/tp8 w1 weight grad", 3584, 8192, t70),
        ("skinny 1k tokens", 1024, 4096, 4096), ("skinny 256 tokens", 256, 4096, 4096),
        ("narrow N", 16384, 512, 4096), ("short K", 16384, 4096, 256),
        ("MAMF shape", 6144, 17920, 2816), ("square 8k", 8192, 8192, 8192),
    ]


def gemm_part(device, hw, small: bool) -> list[dict]:
    """Each of `gemm_shapes` timed against the cost model's price of it."""
    rows = []
    peak = hw.peak_flops(torch.bfloat16)
    for label, m, n, k in gemm_shapes(small):
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        t = timed(lambda a=a, b=b: a @ b, device, 3, 10)
        flops = 2 * m * n * k
        moved = 2 * (m * k + k * n + m * n) / (hw.memory_bandwidth * hw.memory_efficiency)
        pred = max(flops / (peak * matmul_efficiency(hw, m, n, k)), moved) + hw.launch
        rows.append({"shape": label, "M": m, "N": n, "K": k, "measured_ms": t * 1e3,
                     "predicted_ms": pred * 1e3, "measured_tflops": flops / t / 1e12,
                     "model_share": matmul_efficiency(hw, m, n, k)})
        del a, b
    print("\n## gemm (bf16)\n\n| shape | M x N x K | measured ms | TFLOP/s | share of peak | "
          "predicted ms | predicted / measured |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['M']} x {r['N']} x {r['K']} | {r['measured_ms']:.3f} | "
              f"{r['measured_tflops']:.0f} | {r['measured_tflops'] * 1e12 / peak:.2f} "
              f"(model {r['model_share']:.2f}) | {r['predicted_ms']:.3f} | "
              f"{r['predicted_ms'] / r['measured_ms']:.2f} |")
    return rows


def sweep_shapes(small: bool) -> list[tuple[int, int, int]]:
    """A grid of (M, N, K) for the measured GEMM table: rows (tokens) from a few hundred to
    65,536, widths and inner sizes from 256 to 16,384, and the model shapes of `gemm_shapes`."""
    if small:
        return [(m, n, k) for m in (64, 256) for n in (64, 256) for k in (64, 256)]
    widths = (128, 256, 1024, 4096, 16384)
    grid = [(m, n, k) for m in (256, 1024, 4096, 16384, 65536) for n in widths for k in widths]
    return grid + [(m, n, k) for _, m, n, k in gemm_shapes(small)]


def sweep_part(device, hw, small: bool) -> list[dict]:
    """Every shape of `sweep_shapes` timed twice, in a shuffled order each time (so that the
    clocks a long run of large products brings down hit every shape alike), keeping the faster:
    the share of the bf16 peak each reaches. Calls run back to back (about 20 ms of them
    between synchronizations), as a step issues them: a small product's time is its kernel's,
    not a launch and a synchronization."""
    import random
    shapes = sweep_shapes(small)
    best: dict[tuple, float] = {}
    rng = random.Random(0)
    for _ in range(2):
        order = shapes[:]
        rng.shuffle(order)
        for m, n, k in order:
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
            t = time_per_call(lambda a=a, b=b: a @ b, 0.02, device_sync(device), rounds=3)
            best[m, n, k] = min(best.get((m, n, k), math.inf), t)
            del a, b
    peak = hw.peak_flops(torch.bfloat16)
    rows = [{"M": m, "N": n, "K": k, "seconds": t, "share": 2 * m * n * k / t / peak,
             "model_share": matmul_efficiency(hw, m, n, k)} for (m, n, k), t in best.items()]
    print(f"\n## GEMM sweep ({len(rows)} shapes, bf16, share of {peak / 1e12:.0f} TFLOP/s)\n")
    print("| M x N x K | measured share | model share |\n|---|---|---|")
    for r in rows:
        print(f"| {r['M']} x {r['N']} x {r['K']} | {r['share']:.3f} | {r['model_share']:.3f} |")
    return rows


def kernels_part(device, small: bool) -> dict:
    """Attention by SDPA backend, cross-entropy in bf16 and float32, an embedding's lookup:
    forward and backward milliseconds."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out: dict = {"attention": []}
    heads, d = (4, 64) if small else (32, 128)
    tokens = 1024 if small else 16384
    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for seq in ((256,) if small else (1024, 4096, 8192)):
        b = max(1, tokens // seq)
        q, k, v = (torch.randn(b, heads, seq, d, device=device, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        g = torch.randn_like(q)
        flops = 4 * b * heads * seq * seq * d / 2
        for name, backend in backends.items():
            ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
            try:
                with ctx:
                    def fwd(q=q, k=k, v=v):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                    def both(q=q, k=k, v=v, g=g, fwd=fwd):
                        torch.autograd.grad(fwd(), (q, k, v), g)

                    tf, tb = timed(fwd, device, 2, 7), timed(both, device, 2, 7)
            except RuntimeError as e:
                out["attention"].append({"seq": seq, "backend": name, "error": str(e)[:200]})
                continue
            out["attention"].append({"seq": seq, "backend": name, "forward_ms": tf * 1e3,
                                     "backward_ms": (tb - tf) * 1e3,
                                     "forward_tflops": flops / tf / 1e12,
                                     "backward_tflops": 2.5 * flops / max(tb - tf, 1e-9) / 1e12})
    rows, vocab = (512, 1024) if small else (16384, 128256)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, vocab, device=device, dtype=dtype, requires_grad=True)
        y = torch.randint(0, vocab, (rows,), device=device)
        tf = timed(lambda x=x, y=y: F.cross_entropy(x, y), device, 2, 7)
        tb = timed(lambda x=x, y=y: F.cross_entropy(x, y).backward(), device, 2, 7)
        out[f"cross_entropy_{str(dtype)[6:]}"] = {
            "forward_ms": tf * 1e3, "backward_ms": (tb - tf) * 1e3,
            "input_GB": x.numel() * x.element_size() / 1e9}
    hidden = 256 if small else 4096
    w = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.randint(0, vocab, (2, 256 if small else 8192), device=device)
    tf = timed(lambda: F.embedding(idx, w), device, 2, 7)
    gout = torch.randn(*idx.shape, hidden, device=device, dtype=torch.bfloat16)
    tb = timed(lambda: torch.autograd.grad(F.embedding(idx, w), w, gout), device, 2, 7)
    out["embedding"] = {"forward_ms": tf * 1e3, "backward_ms": (tb - tf) * 1e3,
                        "table_GB": w.numel() * 2 / 1e9}
    print("\n## kernels\n")
    print(json.dumps(out, indent=1))
    return out


# -- attention ------------------------------------------------------------------------------------
def attention_part(device, hw, small: bool) -> list[dict]:
    """Causal SDPA (the default backend) by sequence length against the profile's table."""
    rows = []
    heads, d = (4, 64) if small else (32, 128)
    tokens = 1024 if small else 16384
    for seq in ((128, 256) if small else (1024, 2048, 4096, 8192, 16384)):
        b = max(1, tokens // seq)
        q, k, v = (torch.randn(b, heads, seq, d, device=device, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        g = torch.randn(b, heads, seq, d, device=device, dtype=torch.bfloat16)

        def fwd(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both(q=q, k=k, v=v, g=g):
            torch.autograd.grad(fwd(q, k, v), (q, k, v), g)

        tf, tb = timed(fwd, device, 3, 10), timed(both, device, 3, 10)
        flops = 4 * b * heads * seq * seq * d / 2  # causal: half, the FlashAttention count
        row = {"seq": seq, "batch": b, "forward_ms": tf * 1e3,
               "backward_ms": (tb - tf) * 1e3, "forward_tflops": flops / tf / 1e12,
               "backward_tflops": 2.5 * flops / max(tb - tf, 1e-9) / 1e12}
        for name, back in (("forward", False), ("backward", True)):
            rate = attention_rate(hw, seq, causal=True, backward=back)
            row[f"{name}_model_tflops"] = rate / 1e12 if rate else None
        rows.append(row)
        del q, k, v, g
    print("\n## attention (causal SDPA, bf16)\n\n| seq | batch | forward ms | TFLOP/s (model) "
          "| backward ms | TFLOP/s (model) |\n|---|---|---|---|---|---|")
    for r in rows:
        def model(x):
            return f"{x:.0f}" if x else "-"
        print(f"| {r['seq']} | {r['batch']} | {r['forward_ms']:.3f} | {r['forward_tflops']:.0f}"
              f" ({model(r['forward_model_tflops'])}) | {r['backward_ms']:.3f} | "
              f"{r['backward_tflops']:.0f} ({model(r['backward_model_tflops'])}) |")
    return rows


# -- ops ------------------------------------------------------------------------------------------
def llama(layers: int, small: bool, device="meta") -> Llama3:
    """torchtitan's Llama 3 at 8B width (or tiny, `small`) with `layers` layers."""
    with torch.device(device):
        return Llama3(Llama3Config(n_layers=layers, **(SMALL if small else BIG)))


def batch(small: bool, device="meta") -> torch.Tensor:
    """Token ids of torchtitan's 8B local batch, 2 x 8192 (2 x 256 when `small`)."""
    vocab = (SMALL if small else BIG)["vocab_size"]
    shape = (2, 256) if small else (2, 8192)
    if str(device) == "meta":
        return torch.zeros(shape, dtype=torch.long, device="meta")
    return torch.randint(0, vocab, shape, device=device)


def kind_of(node) -> str:
    """How the cost model prices the op: view, product, attention or memory-bound."""
    if is_view(node):
        return "view"
    if facts(node).product is not None:
        return "product"
    if facts(node).kernel == "attention":
        return "attention"
    return "memory-bound"


def ops_part(device, hw, small: bool, profiler: OpProfiler) -> dict:
    """Every op of the two-layer model timed by `profiler` against the cost model's price."""
    ids = batch(small)
    program = trace(llama(2, small), (ids,), lm_loss, ids, compute_dtype=torch.bfloat16)
    graph = strategies.build(program, (1,))  # traced in bf16, as the planner traces
    spec = autopar.MeshSpec((1,), hardware=hw)
    cost = CostModel(spec, graph=graph, precision="bf16-mixed")
    start = time.perf_counter()
    measured = profiler.measure(graph, cost)
    took = time.perf_counter() - start
    rows, kinds = [], {}
    for v in graph.nodes.values():
        if not cost.is_measurable(v):
            continue
        s = v.strategies[0]
        pf, pb = cost.compute_times(v, s)
        got = measured.get(cost.op_key(v, s))
        if got is None:
            continue
        mf, mb = got[0], (got[1] if pb else 0.0)
        kind = kind_of(v)
        rows.append({"op": v.op, "node": v.name, "kind": kind,
                     "shapes": [list(x) for x in v.in_shapes],
                     "predicted_ms": [pf * 1e3, pb * 1e3], "measured_ms": [mf * 1e3, mb * 1e3]})
        k = kinds.setdefault(kind, [0, 0.0, 0.0])
        k[0] += 1
        k[1] += pf + pb
        k[2] += mf + mb
    print(f"\n## ops of a 2-layer Llama-3 8B-wide model, bf16 ({len(rows)} ops, "
          f"{profiler.measured_now} timed in {took:.0f} s)\n")
    print("| kind | ops | predicted ms | measured ms | predicted / measured |\n"
          "|---|---|---|---|---|")
    for kind, (n, p, m) in sorted(kinds.items(), key=lambda kv: -kv[1][2]):
        print(f"| {kind} | {n} | {p * 1e3:.2f} | {m * 1e3:.2f} | {p / max(m, 1e-12):.2f} |")
    print("\n| op | kind | input shapes | predicted fwd / bwd ms | measured fwd / bwd ms |\n"
          "|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: -sum(r["measured_ms"]))[:25]:
        print(f"| {r['op']} | {r['kind']} | {r['shapes']} | "
              f"{r['predicted_ms'][0]:.3f} / {r['predicted_ms'][1]:.3f} | "
              f"{r['measured_ms'][0]:.3f} / {r['measured_ms'][1]:.3f} |")
    return {"rows": rows, "kinds": kinds, "seconds": took}


# -- steps ----------------------------------------------------------------------------------------
def eager_step(model, ids):
    """A plain PyTorch forward + backward of `model` on `ids`."""
    def step():
        model.zero_grad(set_to_none=True)
        lm_loss(model(ids).float(), ids).backward()  # as torchtitan (and autopar) do
    return step


def autopar_step(pmodel, ids):
    """autopar's forward + backward on `ids` as a training loop runs it: the gradients of the
    step before are dropped first (zero_grad(set_to_none=True)), so that no step adds into
    them (an addition a real loop never runs, which timing bare steps back to back would)."""
    def step():
        pmodel.zero_grad(set_to_none=True)
        pmodel.step(ids, ids)
    return step


def steps_part(device, hw, small: bool, profiler: OpProfiler) -> list[dict]:
    """Eager forward + backward of the model with 2 and 4 layers against the plans'."""
    rows = []
    spec = autopar.MeshSpec((1,), hardware=hw)
    for layers in (2, 4):
        ids_meta = batch(small)
        kw = dict(loss_fn=lm_loss, precision="bf16-mixed", recompute="none",
                  memory_budget=float("inf"), progress=False)
        roof = autopar.plan(llama(layers, small), spec, (ids_meta, ids_meta), **kw)
        prof = autopar.plan(llama(layers, small), spec, (ids_meta, ids_meta), profile=profiler,
                            **kw)
        torch.manual_seed(0)
        model = llama(layers, small, device).to(torch.bfloat16)
        ids = batch(small, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t = timed(eager_step(model, ids), device, 2, 5)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        rows.append({"layers": layers, "eager_s": t, "roofline_s": roof.cost.compute,
                     "profiled_s": prof.cost.compute, "eager_peak_GiB": peak / 2**30,
                     "plan_peak_GiB": roof.cost.peak_memory / 2**30})
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if len(rows) == 2:
        a, b = rows
        per = {k: (b[k] - a[k]) / 2 for k in ("eager_s", "roofline_s", "profiled_s")}
        rows.append({"layers": "per layer (4 - 2) / 2", **per})
    print("\n## forward + backward, plain PyTorch eager (bf16) against the plan's compute\n\n"
          "| layers | eager s | predicted, roofline s (ratio) | predicted, measured ops s "
          "(ratio) | peak GiB, eager / plan |\n|---|---|---|---|---|")
    for r in rows:
        peak = f"{r['eager_peak_GiB']:.1f} / {r['plan_peak_GiB']:.1f}" \
            if "eager_peak_GiB" in r else ""
        print(f"| {r['layers']} | {r['eager_s']:.4f} | {r['roofline_s']:.4f} "
              f"({r['roofline_s'] / r['eager_s']:.2f}) | {r['profiled_s']:.4f} "
              f"({r['profiled_s'] / r['eager_s']:.2f}) | {peak} |")
    return rows


# -- nccl -----------------------------------------------------------------------------------------
def init_world(device) -> None:
    """A process group of this one process: NCCL on a GPU, gloo on a CPU."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)


def accumulation_check(device, mesh, hw) -> dict:
    """Gradient accumulation on the GPU: two microbatches whose targets are padded unevenly
    (ignore_index), against the whole batch on one device: the loss weights read from the
    program must make the sum of the microbatches the big batch's mean."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama3(Llama3Config(n_layers=2, **SMALL))
    ref = copy.deepcopy(model)
    ids = torch.randint(0, SMALL["vocab_size"], (4, 128), device=device)
    targets = ids.clone()
    targets[:2, 16:] = -100  # the first microbatch counts far fewer targets than the second
    pmodel = autopar.parallelize(model, mesh, loss_fn=lm_loss, microbatches=2,
                                 example_inputs=(ids, targets), progress=False, hardware=hw)
    loss = pmodel.step(ids, targets).item()
    grads = pmodel.full_grads()
    ref_loss = lm_loss(ref(ids), targets)
    ref_loss.backward()
    worst = max((grads[n] - p.grad).abs().max().item() / max(p.grad.abs().max().item(), 1e-12)
                for n, p in ref.named_parameters())
    return {"loss": loss, "reference_loss": ref_loss.item(), "max_relative_grad_error": worst}


def nccl_part(device, hw, small: bool) -> dict:
    """autopar on a world of one: exactness against one device, then a step's time and peak
    memory against the plan's and plain PyTorch's."""
    from torch.distributed.device_mesh import init_device_mesh
    init_world(device)
    mesh = init_device_mesh(device.type, (1,))
    out = {}
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        for precision in ("fp32", "bf16-mixed"):
            torch.manual_seed(0)
            with torch.device(device):
                model = Llama3(Llama3Config(n_layers=2, **SMALL))
            ref = copy.deepcopy(model)
            ids = torch.randint(0, SMALL["vocab_size"], (4, 128), device=device)
            pmodel = autopar.parallelize(model, mesh, loss_fn=lm_loss, precision=precision,
                                         example_inputs=(ids, ids), progress=False,
                                         hardware=hw)
            loss = pmodel.step(ids, ids).item()
            grads = pmodel.full_grads()
            run = copy.deepcopy(ref).to(torch.bfloat16) if precision == "bf16-mixed" else ref
            ref_loss = lm_loss(run(ids).float(), ids)
            ref_loss.backward()
            worst = max((grads[n].float() - p.grad.float()).abs().max().item()
                        / max(p.grad.float().abs().max().item(), 1e-12)
                        for n, p in run.named_parameters())
            out[precision] = {"loss": loss, "reference_loss": ref_loss.item(),
                              "max_relative_grad_error": worst}
            del pmodel, model, ref, run
        out["fp32, 2 microbatches, padded targets"] = accumulation_check(device, mesh, hw)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    print("\n## autopar on a world of one (NCCL on GPUs), against one device\n\n"
          "| precision | loss | reference loss | largest gradient error (relative to the "
          "tensor's largest) |\n|---|---|---|---|")
    for k, r in out.items():
        print(f"| {k} | {r['loss']:.6f} | {r['reference_loss']:.6f} | "
              f"{r['max_relative_grad_error']:.2e} |")

    # The 8B-wide two-layer model: built on meta, materialized on the GPU, bf16-mixed.
    ids = batch(small, device)
    torch.manual_seed(0)
    pmodel = autopar.parallelize(llama(2, small), mesh, loss_fn=lm_loss,
                                 precision="bf16-mixed", recompute="none",
                                 example_inputs=(ids, ids), progress=False, hardware=hw)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def train(pmodel=pmodel, opt=opt):
        pmodel.step(ids, ids)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step = timed(autopar_step(pmodel, ids), device, 2, 5)
    whole = timed(train, device, 2, 5)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    plan = pmodel.plan
    pmodel = opt = train = None  # the GPU's memory back for the plain model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = llama(2, small, device).to(torch.bfloat16)
    eager = timed(eager_step(model, ids), device, 2, 5)
    del model
    out["train"] = {"step_s": step, "step_with_adamw_s": whole, "eager_bf16_step_s": eager,
                    "predicted_step_s": plan.cost.step_time, "peak_GiB": peak / 2**30,
                    "predicted_peak_GiB": plan.cost.peak_memory / 2**30}
    r = out["train"]
    print("\n| 2-layer 8B-wide Llama, bf16-mixed | seconds |\n|---|---|\n"
          f"| autopar step (forward + backward) | {r['step_s']:.4f} |\n"
          f"| ... with AdamW | {r['step_with_adamw_s']:.4f} |\n"
          f"| plain PyTorch eager, bf16 parameters | {r['eager_bf16_step_s']:.4f} |\n"
          f"| predicted step (plan) | {r['predicted_step_s']:.4f} |\n"
          f"| autopar / eager | {r['step_s'] / r['eager_bf16_step_s']:.3f} |\n"
          f"| peak memory GiB, measured / predicted | {r['peak_GiB']:.1f} / "
          f"{r['predicted_peak_GiB']:.1f} |")
    return out


def recompute_part(device, hw, small: bool) -> list[dict]:
    """The 8B-wide model with four layers trained by autopar on a world of one in bf16-mixed
    under each recomputation mode: forward + backward seconds and peak memory (after AdamW's
    state exists) against the plan's."""
    from torch.distributed.device_mesh import init_device_mesh
    init_world(device)
    mesh = init_device_mesh(device.type, (1,))
    ids = batch(small, device)
    rows = []
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        pmodel = autopar.parallelize(llama(4, small), mesh, loss_fn=lm_loss,
                                     precision="bf16-mixed", recompute=mode,
                                     example_inputs=(ids, ids), progress=False, hardware=hw)
        opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-4)
        pmodel.step(ids, ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        step = timed(autopar_step(pmodel, ids), device, 1, 5)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        cost = pmodel.plan.cost
        rows.append({"recompute": mode, "step_s": step, "predicted_s": cost.step_time,
                     "peak_GiB": peak / 2**30, "predicted_GiB": cost.peak_memory / 2**30,
                     "predicted_split_GiB": {k: v / 2**30 for k, v in cost.memory.items()}})
        pmodel = opt = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\n## recomputation, autopar on one GPU (4-layer 8B-wide Llama, bf16-mixed)\n\n"
          "| recompute | step s | predicted s (ratio) | peak GiB | predicted GiB (ratio) |\n"
          "|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recompute']} | {r['step_s']:.4f} | {r['predicted_s']:.4f} "
              f"({r['predicted_s'] / r['step_s']:.2f}) | {r['peak_GiB']:.1f} | "
              f"{r['predicted_GiB']:.1f} ({r['predicted_GiB'] / max(r['peak_GiB'], 1e-9):.2f}) |")
    return rows


def layers_part(device, hw, small: bool) -> list[dict]:
    """torchtitan's 8B per-GPU step on one GPU, by extrapolation: the 8B-wide model with 4 and
    8 layers trained by autopar (bf16-mixed, selective recomputation, 2 x 8192 tokens), with
    the default attention kernel and with FlashAttention-2 (SDPA's flash backend, what
    PyTorch ran on H100s in 2024); forward + backward seconds, per layer, and the 32-layer
    step they extrapolate to."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention import SDPBackend, sdpa_kernel
    init_world(device)
    mesh = init_device_mesh(device.type, (1,))
    ids = batch(small, device)
    rows = []
    for layers in (4, 8):
        torch.manual_seed(0)
        # for time alone: under an 80 GB budget the 8-layer plan accumulates over two
        # microbatches (the optimizer's state counted), and the slope would mix the two
        pmodel = autopar.parallelize(llama(layers, small), mesh, loss_fn=lm_loss,
                                     precision="bf16-mixed", recompute="selective",
                                     example_inputs=(ids, ids), progress=False, hardware=hw,
                                     memory_budget=float("inf"))
        row = {"layers": layers, "predicted_s": pmodel.plan.cost.step_time,
               "predicted_GiB": pmodel.plan.cost.peak_memory / 2**30,
               "microbatches": pmodel.plan.accumulation}
        for name, backend in (("default", None), ("flash", SDPBackend.FLASH_ATTENTION)):
            ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
            with ctx:
                row[f"{name}_s"] = timed(autopar_step(pmodel, ids), device, 1, 5)
        if device.type == "cuda":  # whether the caching allocator had to free and retry
            stats = torch.cuda.memory_stats(device)
            row.update(peak_GiB=stats["allocated_bytes.all.peak"] / 2**30,
                       reserved_GiB=stats["reserved_bytes.all.peak"] / 2**30,
                       alloc_retries=stats["num_alloc_retries"])
            print(f"({layers} layers, {row['microbatches']} microbatch(es): peak "
                  f"{row['peak_GiB']:.1f} GiB allocated, "
                  f"{row['reserved_GiB']:.1f} reserved, {row['alloc_retries']} allocator "
                  f"retries; predicted {row['predicted_GiB']:.1f} GiB)")
            torch.cuda.reset_peak_memory_stats(device)
        rows.append(row)
        pmodel = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    four, eight = rows
    per = {k: (eight[k] - four[k]) / 4 for k in ("predicted_s", "default_s", "flash_s")}
    rows.append({"layers": "per layer", **per})
    rows.append({"layers": 32, **{k: four[k] + 28 * per[k] for k in per}})
    print("\n## the 8B-wide model under selective recomputation, autopar on one GPU\n\n"
          "| layers | predicted s | measured s, default attention | measured s, "
          "FlashAttention-2 |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['predicted_s']:.4f} | {r['default_s']:.4f} | "
              f"{r['flash_s']:.4f} |")
    return rows


# -- titan ----------------------------------------------------------------------------------------
_SAC_SAVE = {"mm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "abs", "max"}


def _op_sac_context():
    """torchtitan's op-level selective checkpointing policy (its parallelize_llama.py,
    December 2024): keep the outputs of the ops of its `_save_list` (matrix products, flash
    and memory-efficient attention, abs, max), but only every second matrix product's;
    recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        name = func.__name__.split(".")[0]  # "mm" of aten.mm.default
        mode = "recompute" if ctx.is_recompute else "forward"
        if name == "mm":
            counts[mode] += 1
        keep = name in _SAC_SAVE and not (name == "mm" and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


class _Checkpointed(torch.nn.Module):
    """A block run under torchtitan's op-level selective checkpointing."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=_op_sac_context,
                          preserve_rng_state=False)


def titan_part(device, hw, small: bool) -> list[dict]:
    """torchtitan's per-GPU 8B step as torchtitan runs it, less FSDP: plain PyTorch eager with
    bf16 parameters, every block under its op-level selective checkpointing, SDPA's flash
    backend (FlashAttention-2, as on H100s in December 2024), the loss on float32 logits; 4
    and 8 layers at 2 x 8192 tokens, forward + backward, extrapolated to 32 layers. Without
    checkpointing too (4 layers), for what the recomputation costs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ids = batch(small, device)
    rows = []
    for layers in (4, 8):
        torch.manual_seed(0)
        model = llama(layers, small, device).to(torch.bfloat16)
        row = {"layers": layers}
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            if layers == 4:  # before the blocks are wrapped: the step runs the same model
                row["no_checkpoint_s"] = timed(eager_step(model, ids), device, 2, 5)
            model.layers = torch.nn.ModuleList(_Checkpointed(b) for b in model.layers)
            row["op_sac_s"] = timed(eager_step(model, ids), device, 2, 5)
        if device.type == "cuda":
            row["peak_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
        rows.append(row)
        model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    four, eight = rows
    per = (eight["op_sac_s"] - four["op_sac_s"]) / 4
    rows.append({"layers": "per layer", "op_sac_s": per})
    rows.append({"layers": 32, "op_sac_s": four["op_sac_s"] + 28 * per})
    print("\n## torchtitan's step less FSDP: eager, op-level selective checkpointing, "
          "FlashAttention-2\n\n| layers | op-SAC s | no checkpointing s |\n|---|---|---|")
    for r in rows:
        plain_s = f"{r['no_checkpoint_s']:.4f}" if "no_checkpoint_s" in r else ""
        print(f"| {r['layers']} | {r['op_sac_s']:.4f} | {plain_s} |")
    return rows


# -- power ----------------------------------------------------------------------------------------
def _sampled(work, device, seconds: float) -> dict:
    """Run `work` back to back for `seconds` while nvidia-smi samples the GPU every 100 ms:
    calls per second and the median power draw, SM and memory clocks of the samples."""
    import subprocess
    query = "power.draw,power.limit,clocks.sm,clocks.mem,temperature.gpu"
    sync = device_sync(device)
    work()
    sync()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        work()
        sync()
        calls += 1
    elapsed = time.perf_counter() - start
    smi.terminate()
    rows = [[float(x) for x in line.split(",")] for line in smi.communicate()[0].splitlines()
            if line.strip() and "N/A" not in line]
    rows = rows[len(rows) // 5:]  # the first samples are of the start
    med = [statistics.median(r[i] for r in rows) for i in range(5)] if rows else [math.nan] * 5
    return {"calls_per_s": calls / elapsed, "samples": len(rows), "power_W": med[0],
            "power_limit_W": med[1], "sm_MHz": med[2], "mem_MHz": med[3], "temp_C": med[4]}


def power_part(device, hw, small: bool) -> list[dict]:
    """What the GPU draws and at what clocks it runs sustained work: bf16 8192^3 products, and
    forward + backward of the 8B-wide model with four layers in plain eager, each for a few
    seconds (against an idle second). Whether a lower power limit (torchtitan's 500 W H100s)
    binds for this work, and how far the clocks already drop at this GPU's limit."""
    n = 512 if small else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))

    def products():
        for _ in range(20):
            a @ b
    ids = batch(small, device)
    torch.manual_seed(0)
    model = llama(4, small, device).to(torch.bfloat16)
    rows = [{"work": "idle", **_sampled(lambda: time.sleep(0.05), device, 1.5)},
            {"work": f"bf16 {n}^3 products x 20", **_sampled(products, device, 5.0)},
            {"work": "eager 8B-wide step, 4 layers", **_sampled(eager_step(model, ids), device,
                                                                 5.0)}]
    rows[1]["tflops"] = 20 * 2 * n**3 * rows[1]["calls_per_s"] / 1e12
    rows[2]["step_s"] = 1 / rows[2]["calls_per_s"]
    print("\n## power and clocks under sustained work\n\n| work | rate | power W (limit) | "
          "SM MHz | memory MHz | temp C |\n|---|---|---|---|---|---|")
    for r in rows:
        rate = (f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r else
                f"{r['step_s']:.4f} s/step" if "step_s" in r else "")
        print(f"| {r['work']} | {rate} | {r['power_W']:.0f} ({r['power_limit_W']:.0f}) | "
              f"{r['sm_MHz']:.0f} | {r['mem_MHz']:.0f} | {r['temp_C']:.0f} |")
    return rows


# -- timeline -------------------------------------------------------------------------------------
def _owner(event) -> str:
    """The autograd function whose backward ran `event`, or "forward"."""
    p = event.cpu_parent
    while p is not None:
        if p.name.startswith("autograd::engine::evaluate_function: "):
            return p.name.split(": ", 1)[1]
        p = p.cpu_parent
    return "forward"


def _kernel_table(step, device) -> dict:
    """One profiled call of `step`: device time by (phase, aten op, input shapes), the sum of
    the kernels' times and the call's wall time."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = device_sync(device)
    for _ in range(2):
        step()
    sync()
    wall = timed(step, device, 0, 3)
    with profile(activities=acts, record_shapes=True) as prof:
        step()
        sync()
    table, kernels, busy = {}, 0, 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU:
            t = e.self_device_time_total if cuda else e.self_cpu_time_total
            if t <= 0 or not e.name.startswith("aten::"):
                continue
            key = (_owner(e), e.name, str(e.input_shapes))
            row = table.setdefault(key, [0, 0.0])
            row[0] += 1
            row[1] += t
        elif cuda:
            kernels += 1
            busy += e.device_time if hasattr(e, "device_time") else e.cuda_time
    rows = [{"phase": k[0], "op": k[1], "shapes": k[2], "count": v[0], "us": v[1]}
            for k, v in sorted(table.items(), key=lambda kv: -kv[1][1])]
    return {"wall_s": wall, "kernels": kernels, "kernel_us": busy,
            "attributed_us": sum(r["us"] for r in rows), "rows": rows}


def copy_rates(device, small: bool) -> dict:
    """GB/s (bytes read + written) of casts and copies the cost model prices by their bytes,
    over 2^28 elements, each writing into a tensor allocated before (as the device part's
    copy): the faster of two medians of 10."""
    n = 2**20 if small else 2**28
    x16, y16 = (torch.randn(n, device=device, dtype=torch.bfloat16) for _ in range(2))
    x32, y32 = (torch.randn(n, device=device, dtype=torch.float32) for _ in range(2))
    wide = torch.randn(n // 128, 2, 64, device=device, dtype=torch.float32)
    half = wide[:, 0]
    out_half = torch.empty(n // 128, 64, device=device, dtype=torch.float32)
    out_wide = torch.empty(n // 64, 64, device=device, dtype=torch.float32)
    cos = torch.randn(1, 64, device=device, dtype=torch.float32)
    kv = torch.randn(n // 512, 1, 128, device=device, dtype=torch.bfloat16)
    cases = {"copy bf16": (lambda: y16.copy_(x16), 4 * n),
             "copy fp32": (lambda: y32.copy_(x32), 8 * n),
             "cast bf16 -> fp32": (lambda: y32.copy_(x16), 6 * n),
             "cast fp32 -> bf16": (lambda: y16.copy_(x32), 6 * n),
             "mul strided half x broadcast (fp32)": (
                 lambda: torch.mul(half, cos, out=out_half), 8 * n // 2),
             "mul contiguous x broadcast (fp32)": (
                 lambda: torch.mul(wide.view(-1, 64), cos, out=out_wide), 8 * n),
             "repeat_interleave 4 (bf16)": (lambda: kv.repeat_interleave(4, dim=1),
                                            2 * n // 4 + 2 * n)}
    rates = {}
    for name, (fn, nbytes) in cases.items():
        t = min(timed(fn, device, 2, 10) for _ in range(2))
        rates[name] = {"us": t * 1e6, "GBps": nbytes / t / 1e9}
    print("\n## casts and copies\n\n| kernel | us | GB/s |\n|---|---|---|")
    for k, v in rates.items():
        print(f"| {k} | {v['us']:.1f} | {v['GBps']:.0f} |")
    return rates


def timeline_part(device, hw, small: bool) -> dict:
    """Where a step's device time goes, by op and phase (torch.profiler): plain eager and
    autopar under selective recomputation, the 8B-wide model with 4 layers (and autopar's
    with 8, for what a layer adds); and the
    bandwidth of casts and copies the cost model prices as one pass."""
    from torch.distributed.device_mesh import init_device_mesh
    out = {"bandwidth": copy_rates(device, small)}
    ids = batch(small, device)
    torch.manual_seed(0)
    model = llama(4, small, device).to(torch.bfloat16)
    out["eager"] = _kernel_table(eager_step(model, ids), device)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    init_world(device)
    mesh = init_device_mesh(device.type, (1,))
    for layers, name in ((4, "selective"), (8, "selective, 8 layers")):
        pmodel = autopar.parallelize(llama(layers, small), mesh, loss_fn=lm_loss,
                                     precision="bf16-mixed", recompute="selective",
                                     example_inputs=(ids, ids), progress=False, hardware=hw)
        out[name] = _kernel_table(autopar_step(pmodel, ids), device)
        out[name]["predicted_s"] = pmodel.plan.cost.step_time
        pmodel = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for name in ("eager", "selective", "selective, 8 layers"):
        r = out[name]
        print(f"\n## {name}: wall {r['wall_s'] * 1e3:.1f} ms, {r['kernels']} kernels "
              f"{r['kernel_us'] / 1e3:.1f} ms, attributed {r['attributed_us'] / 1e3:.1f} ms\n")
        print("| phase | op | shapes | count | ms |\n|---|---|---|---|---|")
        for row in r["rows"][:45]:
            print(f"| {row['phase']} | {row['op']} | {row['shapes'][:70]} | {row['count']} | "
                  f"{row['us'] / 1e3:.3f} |")
    return out


def main() -> None:
    """Run the parts asked for, each on its own: a failing one prints its traceback."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check")
    ap.add_argument("--small", action="store_true", help="tiny sizes (checks the mechanics)")
    ap.add_argument("--parts",
                    default="device,gemm,sweep,kernels,attention,ops,steps,nccl,recompute")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    hw = profile_for(device)
    profiler = OpProfiler(device, cache_dir=out)
    parts = {
        "device": lambda: device_part(device, a.small),
        "gemm": lambda: gemm_part(device, hw, a.small),
        "sweep": lambda: sweep_part(device, hw, a.small),
        "kernels": lambda: kernels_part(device, a.small),
        "attention": lambda: attention_part(device, hw, a.small),
        "ops": lambda: ops_part(device, hw, a.small, profiler),
        "steps": lambda: steps_part(device, hw, a.small, profiler),
        "nccl": lambda: nccl_part(device, hw, a.small),
        "recompute": lambda: recompute_part(device, hw, a.small),
        "layers": lambda: layers_part(device, hw, a.small),
        "timeline": lambda: timeline_part(device, hw, a.small),
        "power": lambda: power_part(device, hw, a.small),
        "titan": lambda: titan_part(device, hw, a.small),
    }
    results = {"profile": hw.name}
    for name in a.parts.split(","):
        start = time.perf_counter()
        try:
            results[name] = parts[name]()
        except Exception:  # noqa: BLE001 - report it and run the other parts
            traceback.print_exc()
            results[name] = {"error": traceback.format_exc()}
        print(f"\n({name}: {time.perf_counter() - start:.0f} s)", flush=True)
        with open(out / "gpu_check.json", "w") as f:
            json.dump(results, f, indent=1, default=str)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    with contextlib.suppress(Exception):
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
