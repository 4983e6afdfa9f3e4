"""autopar's entry points: `plan` (no processes needed) and `parallelize` (on a DeviceMesh)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.passes import torch_compat
from autopar.passes.meta_copies import meta_copy
from autopar.passes.pipeline_split import layer_count
from autopar.passes.trace import trace
from autopar.solver.specs import compute_dtype

from .collector import planning
from .inputs import batch_of, microbatch, on_meta, split_call
from .mesh import MeshSpec
from .options import PlanOptions
from .originals import release
from .parallelized import Parallelized, PlanMismatchError, batch_size, pipeline_tracer
from .pipeline_plan import refuse_options, relaxed_step, solve_pipeline_plan
from .plan import Plan
from .planner import plan_round, solve_accumulated, start_rounds
from .progress import Progress
from .search import Cluster, search_mesh

__all__ = ["PlanMismatchError", "parallelize", "plan"]


@planning
def plan(model: nn.Module, mesh: MeshSpec | Cluster, example_inputs=(), loss_fn=None, *,
         example_kwargs: dict | None = None, options: PlanOptions | None = None,
         **option_fields) -> Plan:
    """Plan `model` for `mesh` without running it: trace, enumerate strategies, solve.

    `example_inputs` are the model's inputs followed by the target when `loss_fn` is given
    (exactly what `step` will receive; with `per_rank_inputs`, the global batch); they and the
    model may live on the meta device. `example_kwargs` are keyword inputs of the model (a
    Hugging Face batch; `example_inputs` may then be left out). A model without `loss_fn` is
    planned for inference, or, when it returns its own loss (a scalar, or an output with a
    `loss` field), for training on that loss.

    `options` (a PlanOptions), or its fields as keyword arguments, set the memory budget,
    forced styles, solver, optimizer and precision priced, pipeline settings and inputs (see
    autopar.PlanOptions). A mesh dimension named "pp" runs pipeline stages: the model is cut
    by depth into stages, each planned on the other dimensions.

    With an `autopar.Cluster` (a device count) instead of a mesh, the planner chooses the mesh
    too: it plans every candidate shape (autopar.search) and returns the fastest plan, whose
    `mesh_search` ranks all it tried.
    """
    if not isinstance(mesh, (MeshSpec, Cluster)) and not hasattr(mesh, "device_type"):
        raise TypeError(f"mesh is a {type(mesh).__name__}; pass an autopar.MeshSpec (e.g. "
                        "autopar.MeshSpec((2, 4), ('dp', 'tp'), hardware='h100')), a torch "
                        "DeviceMesh, or an autopar.Cluster for the planner to choose the mesh")
    options = PlanOptions.of(options, **option_fields)
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
        else (example_inputs,)
    # Traced as parallelize traces it: without storage, for the device the model is on.
    device = next((t.device for t in [*model.parameters(), *model.buffers()]
                   if t.device.type != "meta"), None)
    source, model = model, meta_copy(model)  # (a loss_fn reading `source` is traced on it)
    dtype = compute_dtype(options.precision)
    call = on_meta(split_call(example_inputs, dict(example_kwargs or {}),
                              with_target=loss_fn is not None))
    traces: dict[int, object] = {}
    # A deep model's check that its layers are copies (passes/trace.py `beside`) runs in a
    # forked child while this process plans from the trace of two layers copied; the plan is
    # returned (or its error raised) once every check holds. Not for a mesh search, whose
    # workers trace for themselves.
    pending: list | None = None if isinstance(mesh, Cluster) else []
    whole = []  # set when a check failed: trace every layer

    report = Progress(options.progress)

    def trace_at(m: int):  # one trace per microbatch count, for every mesh
        if m not in traces:
            report("tracing the model" + (f" at 1/{m} of the batch" if m > 1 else ""))
            part = microbatch(call, m)
            # the layers found copies at one batch (or being checked, the plan waiting for
            # the check) are not checked again at another
            copies = any(t.folded for t in traces.values())
            traces[m] = trace(model, part.args, loss_fn, part.target, kwargs=dict(part.kwargs),
                              output_loss="auto", device=device, compute_dtype=dtype,
                              fold=not whole, beside=True, deferred=pending, copies=copies,
                              source=source)
        return traces[m]

    pipeline_trace = pipeline_tracer(model, example_inputs, loss_fn, device, dtype=dtype,
                                     source=source)

    def plan_on(spec: MeshSpec, beat: float | None = None) -> Plan:
        if spec.pipeline_dim is not None:
            return solve_pipeline_plan(pipeline_trace, batch_size(example_inputs), spec,
                                       options, beat=beat)
        _no_pipeline_options(options)
        return solve_accumulated(trace_at, batch_of(call), spec, options)[0]

    def plan_step(spec: MeshSpec, rounds, beat):  # a mesh search's step: one microbatch count
        if spec.pipeline_dim is not None:
            return plan_on(spec, beat), None
        _no_pipeline_options(options)
        rounds = plan_round(trace_at, spec, options,
                            rounds or start_rounds(batch_of(call), options))
        return (rounds.result()[0], None) if rounds.done else (None, rounds.shipped())

    if isinstance(mesh, Cluster):
        trace_at(1)  # before the search forks its workers: they share this trace
        return search_mesh(mesh, plan_step, options, _layers(pipeline_trace, options, mesh),
                           lambda spec: relaxed_step(pipeline_trace, batch_size(example_inputs),
                                                     spec, options))
    if not isinstance(mesh, MeshSpec):
        mesh = MeshSpec.from_device_mesh(mesh)
    try:
        try:
            result = plan_on(mesh)
        except Exception:
            if _layers_are_copies(pending):
                raise
        else:
            if _layers_are_copies(pending):
                return result
    finally:
        for check in pending:  # interrupted: stop the children
            check.cancel()
    # a stack whose layers are not copies (the check's verdict): plan from every layer traced
    report("the model's repeated layers differ: tracing every layer")
    traces.clear()
    whole.append(True)
    return plan_on(mesh)


def _layers(pipeline_trace, options: PlanOptions, cluster: Cluster) -> int | None:
    """The model's number of layers, from its pipelined trace (every layer traced), made
    before a mesh search forks its workers so that its pipelined candidates share it; None
    when that trace fails (each pipelined candidate then says why on its row, where the
    cluster asks for them), or when the cluster tries no pipelines, or by default where the
    options are ones pipelines do not take (pipeline_plan.py `refuse_options`)."""
    if cluster.pipeline is False:
        return None
    if cluster.pipeline is None:
        try:
            refuse_options(options)
        except ValueError:
            return None
    try:
        return layer_count(pipeline_trace(options.microbatches or 1))
    except Exception:  # noqa: BLE001 - reported per candidate, by the same trace
        return None


def _layers_are_copies(pending: list) -> bool:
    """Waits for the layer checks still running beside the planning (passes/trace.py
    `deferred`): whether every one says its stack's layers are copies; raises what a check
    raised (forward changing the model's state). Empties `pending`."""
    try:
        return all([check.result() for check in pending])  # a list: every child answers
    finally:
        for check in pending:
            check.cancel()
        pending.clear()


def parallelize(model: nn.Module, mesh=None, *, loss_fn=None, example_inputs=None,
                example_kwargs: dict | None = None, plan: Plan | None = None, hardware=None,
                init_fn=None, options: PlanOptions | None = None,
                **option_fields) -> Parallelized:
    """Parallelize `model` over a torch `DeviceMesh`; every rank calls this with its model.

    Every rank starts from rank 0's parameters and buffers (broadcast, as DistributedDataParallel
    does), whatever its own model holds. A model built on the meta device is initialized shard
    by shard: module by module, each rank materializes one module's own tensors, initializes
    them with `init_fn(module)` (as `model.apply(init_fn)` would) or the module's
    `reset_parameters()`, keeps its blocks and drops the rest; all ranks draw from rank 0's
    random state. Returns an `autopar.Parallelized` module:
    `step(*inputs, target)` (forward + backward, returns the loss; or `step(*inputs, **kwargs)`
    for a model that returns its own loss), `__call__` (inference; returns what the model
    returns), `parameters()` / `named_parameters()` (this rank's shards as DTensors, by the
    model's names, for any optimizer), `train()` / `eval()`, `state_dict()` and `.plan`.
    `model` itself becomes that module, in place, as FSDP2's `fully_shard` makes it:
    `model(x)`, `model.step`, `model.state_dict()` and, once built, `model.parameters()` are
    the parallelized model's (the model's parameters and buffers are its tensors; its full
    tensors are freed).

    Without `mesh`, the mesh `plan` names is built (a plan for an autopar.Cluster chose it).
    Without `example_inputs` or `example_kwargs` the plan is made at the first call. The plan
    is solved on rank 0 and broadcast (or taken from `plan=`); all ranks compare its hash
    before the model's first collective. `options` (or its fields as keyword arguments) are
    those of `autopar.plan`; `hardware` names the profile the planner prices the mesh with.
    """
    if not dist.is_initialized():
        raise RuntimeError("parallelize needs torch.distributed initialized (torchrun, or "
                           "init_process_group); use autopar.plan to plan without processes")
    if mesh is None:
        mesh = mesh_of(plan)
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"the device mesh has {mesh.size()} devices {tuple(mesh.shape)} but the "
                         f"world has {dist.get_world_size()} ranks; build the mesh over the "
                         "whole world, e.g. init_device_mesh(device, shape) with prod(shape) = "
                         "world size")
    options = PlanOptions.of(plan.options if plan is not None and options is None
                             and not option_fields else options, **option_fields)
    dtype = compute_dtype(options.precision)
    if dtype == torch.bfloat16 and mesh.device_type == "cuda" and \
            not torch.cuda.is_bf16_supported():
        raise ValueError(f"precision={options.precision!r} computes in bfloat16, which this GPU "
                         "does not support; use precision=\"fp32\"")
    spec = MeshSpec.from_device_mesh(mesh, hardware)
    if plan is not None and tuple(plan.mesh.shape) != tuple(mesh.shape):
        raise ValueError(f"the plan is for mesh {plan.mesh.shape}, the device mesh is "
                         f"{tuple(mesh.shape)}")
    if spec.pipeline_dim is None:
        _no_pipeline_options(options)
    pmodel = Parallelized(model, mesh, spec, options, loss_fn, plan, init_fn)
    if example_inputs is not None or example_kwargs is not None:  # (or a keyword batch)
        try:
            pmodel.build(tuple(example_inputs or ()), example_kwargs)
        except BaseException:
            release(model)  # its own again, unless the build replaced its tensors
            raise
    return pmodel


def mesh_of(plan: Plan | None):
    """The DeviceMesh a plan names (the planner may have chosen it: autopar.Cluster), on the
    devices of the default process group's backend, its groups under the default group's
    timeout (torch gives a mesh's new groups its own default, 30 minutes)."""
    if plan is None:
        raise ValueError("parallelize needs a device mesh, or a plan= whose mesh it builds")
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if plan.mesh.size != dist.get_world_size():
        raise ValueError(f"the plan is for {plan.mesh.size} devices {tuple(plan.mesh.shape)}; "
                         f"the world has {dist.get_world_size()} ranks")
    mesh = init_device_mesh(device, tuple(plan.mesh.shape), mesh_dim_names=plan.mesh.names)
    for k in range(mesh.ndim):
        if mesh.get_group(k) is not dist.group.WORLD:
            torch_compat.set_timeout(mesh.get_group(k), torch_compat.default_timeout())
    return mesh


def _no_pipeline_options(options: PlanOptions) -> None:
    given = [n for n in ("schedule", "virtual_stages") if getattr(options, n) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply to pipelined plans: name a mesh dimension "
                         '"pp" (of size > 1) to cut the model into pipeline stages '
                         "(microbatches= alone accumulates gradients on any mesh)")

