"""Functions the gloo ranks run for the cost-model tests and benchmarks (module level, so ranks
import them by name): measured memory per rank, step times, calibration."""

from __future__ import annotations

import copy
import ctypes
import gc
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autopar
from autopar import zoo
from tests.rank_tasks import build as build_named
from tests.rank_tasks import mesh_for


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def heap_bytes() -> int | None:
    """Bytes this process holds allocated from glibc malloc (the main arena's chunks in use
    and every mmapped block: where torch's CPU allocator puts tensors), whichever thread frees
    them; None without glibc. The profiler's memory events miss frees done on a collective
    backend's threads (gloo), so plans with collectives are measured this way too."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def build(name):
    """A model, its loss and a batch, identical on every rank: the equivalence tests' models
    (tests.rank_tasks.build), or ("gpt", config dict with "batch") for a GPT of any size."""
    if isinstance(name, (tuple, list)) and name[0] == "gpt":
        cfg = dict(name[1])
        batch = cfg.pop("batch")
        torch.manual_seed(0)
        model = zoo.GPT(zoo.GPTConfig(**cfg))
        x = torch.randint(0, cfg["vocab_size"], (batch, cfg["block_size"]))
        return model, zoo.lm_loss, (x, torch.roll(x, -1, 1))
    return build_named(name)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of `t` (a DTensor parameter, gradient or optimizer state), or `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def _optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state dict (AdamW: exp_avg, exp_avg_sq, step)."""
    return sum(_bytes(v) for state in opt.state_dict()["state"].values()
               for v in state.values() if isinstance(v, torch.Tensor))


class SavedTensors:
    """Counts the distinct storages autograd saves for backward (parameters' own storages
    excluded: they are counted as parameters)."""

    def __init__(self, held):
        self.exclude = {local(t).untyped_storage().data_ptr() for t in held}
        self.storages: dict[int, int] = {}
        self.shapes: dict[int, list] = {}

    def pack(self, t: torch.Tensor):
        s = t.untyped_storage()
        if s.data_ptr() not in self.exclude:
            self.storages[s.data_ptr()] = s.nbytes()
            self.shapes.setdefault(s.data_ptr(), []).append((tuple(t.shape), str(t.dtype)))
        return t

    @staticmethod
    def unpack(t):
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def measured_memory(name, mesh_shape, force, optimizer: str = "adamw",
                    precision: str = "fp32") -> dict:
    """After one training step of the planned model, the bytes this rank holds: parameters,
    gradients and optimizer state summed over its tensors, and the activations autograd saved
    in the step. Returns them with the plan's prediction (rank 0's plan)."""
    model, loss_fn, (x, y) = build(name)
    mesh = mesh_for(mesh_shape)
    pm = autopar.parallelize(model, mesh, loss_fn=loss_fn, example_inputs=(x, y), force=force,
                             precision=precision)
    params = list(pm.parameters())
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-3)
    elif optimizer == "sgd-momentum":
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    else:
        raise ValueError(optimizer)
    saved = SavedTensors(params + [x, y])  # parameters and user inputs are held anyway
    opt.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        pm.step(x, y)
    opt.step()
    got = {"parameters": sum(_bytes(p) for p in params),
           "gradients": sum(_bytes(p.grad) for p in params if p.grad is not None),
           "optimizer": _optimizer_bytes(opt),
           "activations": saved.total}
    return {"measured": got, "predicted": dict(pm.plan.cost.memory),
            "saved": [(n, saved.shapes[k]) for k, n in saved.storages.items()],
            "plan": pm.plan.to_dict() if dist.get_rank() == 0 else None}


def measured_activations(name, mesh_shape, force, recompute: str,
                         options: dict | None = None) -> dict:
    """The bytes a training step allocates from the start of its forward to the start of its
    backward and still holds then (tensor allocations less frees, from the profiler's memory
    events), after a warm-up step, with the plan's predicted memory: what forward keeps is
    its "activations" (the block backward recomputes, "recomputed", is live only later).
    "heap" is the same span measured as the growth of the process's malloc heap (see
    `heap_bytes`). `options`: more PlanOptions fields."""
    from torch.profiler import ProfilerActivity, profile, record_function

    model, loss_fn, (x, y) = build(name)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn,
                             example_inputs=(x, y), force=force, recompute=recompute,
                             microbatches=1, **(options or {}))
    pm.step(x, y)
    backward = torch.Tensor.backward

    heap: dict[str, int | None] = {}

    def forward_starts(module, args):  # the first module a step calls is its program
        heap.setdefault("forward", heap_bytes())
        with record_function("forward starts"):
            pass

    def backward_starts(self, *args, **kwargs):
        heap.setdefault("backward", heap_bytes())
        with record_function("backward starts"):
            pass
        return backward(self, *args, **kwargs)

    hook = torch.nn.modules.module.register_module_forward_pre_hook(forward_starts)
    torch.Tensor.backward = backward_starts
    # Python's cycle collector frees what earlier steps left in reference cycles whenever it
    # runs: within the measured span, that would read as a step holding less
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            pm.step(x, y)
    finally:
        if collecting:
            gc.enable()
        torch.Tensor.backward = backward
        hook.remove()
    events = prof.events()
    start = min(e.time_range.start for e in events if e.name == "forward starts")
    end = min(e.time_range.start for e in events if e.name == "backward starts")
    # What every op allocated less what it freed itself, and the frees outside any op (of
    # tensors Python let go), between the marks.
    held = sum(e.self_cpu_memory_usage if e.name != "[memory]" else e.cpu_memory_usage
               for e in events if start <= e.time_range.start < end)
    grown = None if heap.get("forward") is None else heap["backward"] - heap["forward"]
    return {"measured": held, "heap": grown, "predicted": dict(pm.plan.cost.memory),
            "mode": pm.plan.recompute.mode, "step_time": pm.plan.cost.step_time,
            "resharded": list(pm.plan.resharded)}


def calibrated_profile(mesh_shape, **kwargs) -> dict:
    """autopar.calibrate on a mesh of the world (every rank returns the same profile)."""
    profile = autopar.calibrate(mesh_for(mesh_shape), **kwargs)
    return profile.to_dict()


def compare_plans(name, plans: list, rounds: int = 3, steps: int = 3, warmup: int = 2
                  ) -> list[list[float]]:
    """Step seconds of several plans (list of (mesh shape, plan dict)) of one model, measured in
    interleaved rounds (so that load on the machine affects every plan alike): for each plan,
    `rounds` x `steps` step times."""
    model, loss_fn, (x, y) = build(name)
    pms = []
    for shape, plan in plans:
        pm = autopar.parallelize(copy.deepcopy(model), mesh_for(shape), loss_fn=loss_fn,
                                 example_inputs=(x, y), plan=autopar.Plan.from_dict(plan))
        for _ in range(warmup):
            pm.step(x, y)
        pms.append(pm)
    out: list[list[float]] = [[] for _ in plans]
    flag = torch.zeros(1)
    for _ in range(rounds):
        for i, pm in enumerate(pms):
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                pm.step(x, y)
                flag[0] = time.perf_counter() - start
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                out[i].append(float(flag[0]))
    return out


def op_times(name, mesh_shapes: list, profile: dict, min_time: float = 0.002) -> dict:
    """Measured (forward, backward) seconds of every op of the model's strategy graphs on the
    given meshes, timed on every rank at once (ranks sharing a machine share its cores, as in a
    step); returns rank 0's times by op key."""
    from autopar.passes import strategies
    from autopar.passes.trace import trace_example
    from autopar.profile import OpProfiler
    from autopar.solver.cost import CostModel
    model, loss_fn, (x, y) = build(name)
    program = trace_example(model, (x, y), loss_fn)
    profiler = OpProfiler("cpu", cache_dir=False, min_time=min_time, samples=3)
    hw = autopar.HardwareProfile.from_dict(profile)
    for shape in mesh_shapes:
        graph = strategies.build(program, tuple(shape))
        profiler.measure(graph, CostModel(autopar.MeshSpec(tuple(shape), hardware=hw),
                                          graph=graph))
    return profiler.times


def storage_bytes(name, mesh_shape, force, options: dict | None = None) -> dict:
    """The bytes this rank holds of parameters (the memory of every live tensor whose
    storage overlaps a parameter's, once: a ZeRO shard lives in its whole copy), of
    gradients (what the parameters carry once a step has synchronized them) and of AdamW's
    state (after its first step), measured from the tensors themselves, with the plan's
    prediction and the model's parameter count."""
    model, loss_fn, (x, y) = build(name)
    count = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn,
                             example_inputs=(x, y), force=force, microbatches=1,
                             **(options or {}))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)

    held = _held_memory([local(p.detach()) for p in pm.parameters()])
    pm.step(x, y)
    grads = sum(local(p.grad).numel() * p.grad.element_size() for p in pm.parameters()
                if p.grad is not None)
    opt.step()
    state = sum(local(t).numel() * t.element_size() for st in opt.state.values()
                for t in st.values() if isinstance(t, torch.Tensor))
    return {"measured": {"parameters": held, "gradients": grads,
                         "optimizer": state},
            "predicted": {k: pm.plan.cost.memory[k]
                          for k in ("parameters", "gradients", "optimizer")},
            "zero": dict(pm.plan.zero), "params": count, "tensors": tensors}


def _held_memory(tensors: list[torch.Tensor]) -> int:
    """Bytes of the memory `tensors` live in: the union of the storages of every live tensor
    (found by the garbage collector) that overlaps one of theirs, so that a tensor whose
    storage aliases part of a larger one counts the larger one, once."""
    def span(t):
        s = t.untyped_storage()
        return s.data_ptr(), s.data_ptr() + s.nbytes()

    mine = [span(t) for t in tensors]
    spans = list(mine)
    for obj in gc.get_objects():
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.device.type != "cpu":
            continue  # (fake and meta tensors of traces have no memory)
        lo, hi = span(obj)
        if hi > lo and any(lo < b and a < hi for a, b in mine):
            spans.append((lo, hi))
    total, end = 0, 0
    for lo, hi in sorted(spans):
        total += max(0, hi - max(lo, end))
        end = max(end, hi)
    return total


def issued_collectives(name, mesh_shape, force, recompute: str) -> dict:
    """The collectives one training step issues (after a warm-up step), counted by where:
    "forward" or "backward", and inside a recomputed run or not: {"backward/run/all_reduce":
    count, ...}; with the plan's recomputation mode and its collectives (kind, phase)."""
    from autopar.passes import recompute_regions, torch_compat

    model, loss_fn, (x, y) = build(name)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn,
                             example_inputs=(x, y), force=force, recompute=recompute,
                             microbatches=1)
    pm.step(x, y)
    depth = [0]
    counts: dict[str, int] = {}
    real_checkpoint = recompute_regions.checkpoint

    def counted_checkpoint(fn, *args, **kwargs):
        def inside(*a):
            depth[0] += 1
            try:
                return fn(*a)
            finally:
                depth[0] -= 1
        return real_checkpoint(inside, *args, **kwargs)

    def counting(kind, call):
        def issue(*args, **kwargs):
            phase = "forward" if torch._C._current_graph_task_id() == -1 else "backward"
            key = f"{phase}/{'run' if depth[0] else 'outside'}/{kind}"
            counts[key] = counts.get(key, 0) + 1
            return call(*args, **kwargs)
        return issue

    kinds = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_to_all_single")
    real = {k: getattr(torch_compat, k) for k in kinds}
    recompute_regions.checkpoint = counted_checkpoint
    for k in kinds:
        setattr(torch_compat, k, counting(k.replace("_single", ""), real[k]))
    try:
        pm.step(x, y)
    finally:
        recompute_regions.checkpoint = real_checkpoint
        for k in kinds:
            setattr(torch_compat, k, real[k])
    plan = pm.plan
    return {"counts": counts, "mode": plan.recompute.mode,
            "planned": [(c.kind, c.phase) for c in plan.collectives]}
