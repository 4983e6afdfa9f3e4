"""The `autopar` command: plan a model, show and explain saved plans, calibrate a machine.

    autopar plan llama3-8b --mesh 8x8 --names dp,tp --hardware h100 --batch 64 --seq 2048 \\
        --precision bf16-mixed -o plan.json --html plan.html
    autopar plan path/to/config.json --devices 64          # the planner chooses the mesh
    autopar plan mypkg.models:build --mesh 4                 # a function that builds the model
    autopar show plan.json [--detail ops]
    autopar explain plan.json layers.0.self_attn
    torchrun --nproc-per-node 8 -m autopar.cli calibrate --mesh 2x4 -o profile.json

A Hugging Face model (a preset name or a config.json) is built on the meta device (no
weights, no downloads) and planned for training on its own loss: `input_ids` and `labels`
of shape (batch, seq). A `module:function` returns a model taking `input_ids` and `labels`
likewise, or a tuple `(model, example_inputs, loss_fn)` planned as `autopar.plan` would.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

PRESETS = {
    "llama3-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8,
                  "max_position_embeddings": 8192, "rope_theta": 500000.0},
    "llama3-70b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
                   "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0},
    "gpt2": {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12,
             "n_head": 12, "n_positions": 1024},
}


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); returns the exit status."""
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, KeyError, FileNotFoundError, ImportError) as e:
        print(f"autopar {args.command}: {e.args[0] if isinstance(e, KeyError) else e}",
              file=sys.stderr)
        return 2


def parser() -> argparse.ArgumentParser:
    """The command line's parser, one subcommand each: plan, show, explain, calibrate."""
    top = argparse.ArgumentParser(prog="autopar", description="Plan, inspect and calibrate "
                                  "autopar parallelization plans.")
    sub = top.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a model for a mesh or a number of devices")
    p.add_argument("model", help=f"a preset ({', '.join(PRESETS)}), a Hugging Face "
                   "config.json, or module:function returning a model")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--mesh", help="mesh shape, e.g. 8x8")
    where.add_argument("--devices", type=int, help="a device count: the planner chooses "
                       "the mesh")
    p.add_argument("--names", help="mesh dimension names, e.g. dp,tp (default: dp; dp,tp; "
                   "pp,dp,tp)")
    p.add_argument("--hardware", default="h100", help="a built-in profile (a100, h100, h200, "
                   "cpu) or a profile JSON written by calibrate (default h100)")
    p.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's, at "
                   "most 2048)")
    p.add_argument("--precision", default="bf16-mixed", choices=("fp32", "bf16-mixed"))
    p.add_argument("--memory-budget", type=float, help="GiB per device (default: the "
                   "hardware's memory less its reserve)")
    p.add_argument("--force", help="pin mesh dimensions to a style, e.g. dp=fsdp,tp=tensor")
    p.add_argument("--time-limit", type=float, default=60.0, help="solver seconds")
    p.add_argument("-o", "--output", help="write the plan JSON here")
    p.add_argument("--html", help="write the plan's HTML report here (Plan.to_html)")
    p.add_argument("--detail", choices=("modules", "ops"), default="modules")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=run_plan)

    s = sub.add_parser("show", help="print a saved plan")
    s.add_argument("plan", help="a plan JSON (autopar plan -o, or Plan.save)")
    s.add_argument("--detail", choices=("modules", "ops"), default="modules")
    s.set_defaults(run=run_show)

    e = sub.add_parser("explain", help="why a saved plan runs an op or module as it does")
    e.add_argument("plan", help="a plan JSON")
    e.add_argument("name", help="an op, a parameter or a module (e.g. layers.0.self_attn)")
    e.set_defaults(run=run_explain)

    c = sub.add_parser("calibrate", help="measure this machine's links and compute (run "
                       "under torchrun, every rank) and write a hardware profile")
    c.add_argument("--mesh", help="mesh shape (default: the whole world, one dimension)")
    c.add_argument("--names", help="mesh dimension names")
    c.add_argument("--hardware", help="the profile to start from (default: cpu or h100)")
    c.add_argument("-o", "--output", default="profile.json", help="where rank 0 writes it")
    c.add_argument("--no-compute", action="store_true", help="measure the links only")
    c.set_defaults(run=run_calibrate)
    return top


def run_plan(args) -> int:
    """`autopar plan`: build the model, plan it, write the JSON, print the table."""
    import autopar

    model, inputs, kwargs, loss_fn = build(args.model, args.batch, args.seq)
    hardware = profile_arg(args.hardware)
    if args.devices is not None:
        mesh = autopar.Cluster(args.devices, hardware=hardware)
    else:
        shape = mesh_shape(args.mesh)
        mesh = autopar.MeshSpec(shape, names=dim_names(args.names, len(shape)),
                                hardware=hardware)
    options = autopar.PlanOptions(
        precision=args.precision, time_limit=args.time_limit, force=force_arg(args.force),
        memory_budget=args.memory_budget * 2**30 if args.memory_budget else None,
        progress=False if args.quiet else None)
    plan = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_kwargs=kwargs,
                        options=options)
    if args.output:
        plan.save(args.output)
    if args.html:
        plan.to_html(args.html)
    print(plan.table(detail=args.detail))
    for path in (args.output, args.html):
        if path:
            print(f"\nwrote {path}")
    return 0


def run_show(args) -> int:
    """`autopar show`: print a saved plan."""
    from autopar.plan import Plan

    print(Plan.load(args.plan).table(detail=args.detail))
    return 0


def run_explain(args) -> int:
    """`autopar explain`: print why a saved plan runs `name` as it does."""
    from autopar.plan import Plan

    print(Plan.load(args.plan).explain(args.name))
    return 0


def run_calibrate(args) -> int:
    """`autopar calibrate`: every rank measures; rank 0 writes the profile."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    if "RANK" not in os.environ and not dist.is_initialized():
        raise ValueError("calibrate measures a real mesh: run it under torchrun, e.g. "
                         "torchrun --nproc-per-node 8 -m autopar.cli calibrate -o profile.json")
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    shape = mesh_shape(args.mesh) if args.mesh else (dist.get_world_size(),)
    mesh = init_device_mesh("cuda" if cuda else "cpu", shape,
                            mesh_dim_names=dim_names(args.names, len(shape)))
    profile = autopar.calibrate(mesh, args.hardware, compute=not args.no_compute)
    if dist.get_rank() == 0:
        profile.save(args.output)
        print(f"wrote {args.output}")
    dist.destroy_process_group()
    return 0


# -- arguments -----------------------------------------------------------------------------

def mesh_shape(text: str) -> tuple[int, ...]:
    """"8x8" -> (8, 8)."""
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh {text!r}: give sizes joined by x, e.g. 8x8") from None
    if not shape or min(shape) < 1:
        raise ValueError(f"--mesh {text!r}: sizes must be positive")
    return shape


def dim_names(text: str | None, ndim: int) -> tuple[str, ...]:
    """Mesh dimension names from "dp,tp", or the defaults for `ndim` dimensions."""
    if text is None:
        return {1: ("dp",), 2: ("dp", "tp"), 3: ("pp", "dp", "tp")}.get(
            ndim, tuple(f"d{k}" for k in range(ndim)))
    names = tuple(n.strip() for n in text.split(","))
    if len(names) != ndim:
        raise ValueError(f"--names {text!r} names {len(names)} dimensions; the mesh has {ndim}")
    return names


def force_arg(text: str | None) -> dict | None:
    """"dp=fsdp,tp=tensor" -> {"dp": "fsdp", "tp": "tensor"}."""
    if not text:
        return None
    pairs = [p.split("=", 1) for p in text.split(",")]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"--force {text!r}: give dimension=style pairs, e.g. dp=fsdp,tp=tensor")
    return {k.strip(): v.strip() for k, v in pairs}


def profile_arg(text: str):
    """A built-in profile's name, or a profile loaded from a JSON file."""
    if text.endswith(".json") or os.path.exists(text):
        from autopar.hardware import HardwareProfile

        return HardwareProfile.load(text)
    return text


# -- models ----------------------------------------------------------------------------------

def build(spec: str, batch: int, seq: int | None):
    """(model, example inputs, example kwargs, loss_fn) for a preset, a config.json or a
    module:function (see the module docstring)."""
    if spec in PRESETS or spec.endswith(".json") or os.path.isfile(spec):
        model = hf_model(PRESETS[spec] if spec in PRESETS else _read(spec), spec)
        ids = token_ids(batch, seq or min(2048, _positions(model.config)))
        return model, (), {"input_ids": ids, "labels": ids}, None
    if ":" not in spec:
        raise ValueError(f"model {spec!r} is neither a preset ({', '.join(PRESETS)}), a "
                         "config.json nor a module:function")
    module, _, name = spec.partition(":")
    sys.path.insert(0, os.getcwd())  # as `python -m` would find the user's modules
    built = getattr(importlib.import_module(module), name)()
    if isinstance(built, tuple):
        model, inputs, loss_fn = built
        return model, tuple(inputs), None, loss_fn
    ids = token_ids(batch, seq or 1024)
    return built, (), {"input_ids": ids, "labels": ids}, None


def hf_model(config: dict, name: str = "the config"):
    """A Hugging Face causal LM from a config dict (`name`: the preset or file it came from),
    on the meta device (transformers is imported here, when needed)."""
    import torch

    from .zoo import import_transformers

    transformers = import_transformers(name)
    AutoConfig, AutoModelForCausalLM = transformers.AutoConfig, transformers.AutoModelForCausalLM
    d = dict(config)
    if "model_type" not in d:
        raise ValueError("the config has no model_type (a Hugging Face config.json has one)")
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    cfg.use_cache = False
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(cfg, k, None)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def token_ids(batch: int, seq: int):
    """Token ids of shape (batch, seq) on the meta device."""
    import torch

    return torch.zeros(batch, seq, dtype=torch.long, device="meta")


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _positions(config) -> int:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions",
                                                                       2048)


if __name__ == "__main__":
    sys.exit(main())
