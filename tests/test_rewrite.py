"""The per-rank programs of one plan are the same program: identical ops and collectives in
identical order on every rank (only constants such as slice offsets differ). Backward issues
collectives in autograd-graph order, so programs of different shape could deadlock."""

import itertools
import math
import random

import pytest
import torch

import autopar
from autopar.passes import strategies
from autopar.passes.emitted import META_KEY, Emitted, emitted
from autopar.passes.rewrite import rewrite
from autopar.passes.trace import trace
from autopar.solver.cost import CostModel
from autopar.solver.ilp import random_choice
from tests import rank_tasks


class RecordingComm:
    """Stands in for the runtime's collectives; only its identity matters here."""

    def all_gather(self, x, dim, mesh_dim):
        raise AssertionError("not run")

    reduce_scatter = all_reduce = all_to_all = all_gather_many = all_gather_start = all_gather


def signature(gm: torch.fx.GraphModule) -> list[str]:
    out = []
    for n in gm.graph.nodes:
        target = getattr(n.target, "__name__", str(n.target))
        out.append(f"{n.op}:{target}:{len(n.args)}")
    return out


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)])
@pytest.mark.parametrize("name", ["mlp", "gpt", "hf_llama", "odd"])
def test_every_rank_runs_the_same_program(name, mesh):
    model, loss_fn, (x, y) = rank_tasks.build(name)
    program = trace(model, (x,), loss_fn, y)
    graph = strategies.build(program, mesh)
    cost = CostModel(autopar.MeshSpec(mesh, hardware="cpu"))
    comm = RecordingComm()
    for seed in range(2 if name == "hf_llama" else 4):  # (a Llama's rewrites take seconds)
        drawn = random_choice(graph, cost, random.Random(seed))
        choice = {n: graph.nodes[n].strategies[i] for n, i in drawn.items()}
        programs = [rewrite(program, graph, choice, coords, comm)
                    for coords in itertools.product(*(range(s) for s in mesh))]
        train = [signature(p.train) for p in programs]
        infer = [signature(p.infer) for p in programs]
        assert all(t == train[0] for t in train), f"seed {seed}: rank programs differ"
        assert all(i == infer[0] for i in infer), f"seed {seed}: rank programs differ"


def test_fsdp_gathers_are_prefetched_in_buckets(monkeypatch):
    """Under FSDP the first bucket's all-gather starts before the first op, each next one just
    before the program waits for the one before it (one bucket in flight ahead of the one in
    use), and each is waited for just before its first use; buckets stay within BUCKET_BYTES
    (shrunk here to split a GPT)."""
    from autopar.passes import rewrite as rewrite_mod
    from autopar.planner import choice_from_plan, solve_plan

    monkeypatch.setattr(rewrite_mod, "BUCKET_BYTES", 16 * 1024)
    model, loss_fn, (x, y) = rank_tasks.build("gpt")
    program = trace(model, (x,), loss_fn, y)
    plan, graph = solve_plan(program, autopar.MeshSpec((2,), names=("dp",), hardware="cpu"),
                             autopar.PlanOptions(force="fsdp"))
    choice = choice_from_plan(plan, graph)

    class Named(RecordingComm):
        def all_gather_start(self, xs, dims, mesh_dim):
            raise AssertionError("not run")

        def all_gather_many(self, xs, dims, mesh_dim, started=None, reshard=()):
            raise AssertionError("not run")

    train = rewrite(program, graph, choice, (0,), Named()).train.graph
    nodes = list(train.nodes)
    role = {n: emitted(n).role for n in nodes if n.op != "output"}
    starts = [i for i, n in enumerate(nodes) if role.get(n) == "gather_start"]
    waits = [n for n in nodes if role.get(n) == "gather_wait"]
    assert len(starts) == len(waits) > 1
    assert all(nodes[i].target.__name__ == "all_gather_start" for i in starts)
    first_op = min(i for i, n in enumerate(nodes) if role.get(n) == "op")
    assert starts[0] < first_op  # the first gather is in flight before any compute
    for j, w in enumerate(waits[:-1]):  # the next bucket starts as this one is waited for
        assert nodes.index(w) - 1 == starts[j + 1]
        assert waits[j + 1].args[3] is nodes[starts[j + 1]]
    for w in waits:
        started = w.args[3]
        assert role[started] == "gather_start" and started.args[0] == w.args[0]
        gathered = sum(math.prod(graph.nodes[p.name].out_shapes[0]) * 4 for p in w.args[0])
        assert len(w.args[0]) == 1 or gathered <= 16 * 1024
        # waited for right before the first use of one of its parameters
        users = [u for item in w.users for u in item.users]
        assert all(role[item] == "gathered" for item in w.users)
        assert users and nodes.index(w) < min(nodes.index(u) for u in users)
        between = nodes[nodes.index(w) + 1:min(nodes.index(u) for u in users)]
        # (only the unpacking of gathered values and the consumer's other inputs' resharding)
        assert all(role[n] in ("gathered", "getitem", "collective", "slice", "gather_wait",
                               "gather_start")
                   for n in between)

class ShapeComm:
    """Collectives of a mesh whose other ranks hold copies of this rank's values: the shapes
    and dtypes are those of the real collectives (the values are not)."""

    def __init__(self, mesh_shape):
        self.n = mesh_shape

    def all_gather(self, x, dim, mesh_dim):
        return torch.cat([x] * self.n[mesh_dim], dim)

    def reduce_scatter(self, x, dim, mesh_dim):
        return x.narrow(dim, 0, x.shape[dim] // self.n[mesh_dim]).clone()

    def all_reduce(self, x, mesh_dim):
        return x.clone()

    def all_to_all(self, x, split_dim, cat_dim, mesh_dim):
        n = self.n[mesh_dim]
        return torch.cat([x.narrow(split_dim, 0, x.shape[split_dim] // n)] * n, cat_dim)

    def all_gather_start(self, xs, dims, mesh_dim):
        return "started"

    def all_gather_many(self, xs, dims, mesh_dim, started=None, reshard=()):
        assert started == "started"
        return tuple(self.all_gather(x, d, mesh_dim) for x, d in zip(xs, dims))


def _run_checking_records(gm: torch.fx.GraphModule) -> None:
    """Run `gm` on zeros of the shapes its placeholders' records give, and check that every
    node's value has the shape and dtype its record says."""

    class Checking(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "output":
                return out
            rec = emitted(n)
            if rec.shape is None:
                assert not isinstance(out, torch.Tensor), f"{n.name}: {rec}"
            else:
                assert (tuple(out.shape), out.dtype) == (rec.shape, rec.dtype), \
                    f"{n.name} holds {tuple(out.shape)} {out.dtype}, its record says {rec}"
            return out

    args = [torch.zeros(emitted(n).shape, dtype=emitted(n).dtype)
            for n in gm.graph.nodes if n.op == "placeholder"]
    Checking(gm).run(*args)


@pytest.mark.parametrize("name,mesh", [("gpt", (2, 2)), ("hf_llama", (2,)), ("mlp", (2, 2))])
def test_every_emitted_node_records_what_it_is(name, mesh):
    """Every node of both programs carries an Emitted record whose local shape and dtype are
    those the node computes (run with collectives of the right shapes), whose collective is the
    one called, on the mesh dimension called; the training program's collectives are the
    plan's forward collectives, kind and mesh dimension."""
    from autopar.describe import describe

    model, loss_fn, (x, y) = rank_tasks.build(name)
    program = trace(model, (x,), loss_fn, y)
    graph = strategies.build(program, mesh)
    spec = autopar.MeshSpec(mesh, hardware="cpu")
    cost = CostModel(spec)
    choices = [{n: graph.nodes[n].strategies[i] for n, i in
                random_choice(graph, cost, random.Random(seed)).items()} for seed in range(3)]
    fsdp, _ = _fsdp_plan(program, mesh)
    roles = set()
    for choice in [*choices, fsdp]:
        plan = describe(program, graph, spec, cost.copy(graph=graph), choice)
        comm = ShapeComm(mesh)
        programs = rewrite(program, graph, choice, (1,) * len(mesh), comm)
        for gm in (programs.train, programs.infer):
            for n in gm.graph.nodes:
                if n.op == "output":
                    continue
                rec = n.meta.get(META_KEY)
                assert isinstance(rec, Emitted), f"{n.name} ({n.target}) has no record"
                roles.add(rec.role)
                assert rec.origin is None or rec.origin in graph.nodes or \
                    rec.role == "placeholder"
                if rec.role in ("collective", "gather_wait", "gather_start"):
                    called = n.target.__name__
                    assert called.startswith(rec.collective), (called, rec)
                    assert n.args[2 if rec.role != "collective" else -1] == rec.mesh_dim
            _run_checking_records(gm)
        ran = {(emitted(n).collective, emitted(n).mesh_dim) for n in programs.train.graph.nodes
               if n.op != "output" and emitted(n).role in ("collective", "gather_wait")}
        planned = {(c.kind, c.mesh_dim) for c in plan.collectives if c.phase == "forward"}
        assert ran == planned
    assert {"placeholder", "op", "collective", "gather_start", "gather_wait",
            "gathered"} <= roles


def _fsdp_plan(program, mesh):
    from autopar.planner import choice_from_plan, solve_plan

    names = ("dp", "tp")[:len(mesh)]
    plan, graph = solve_plan(program, autopar.MeshSpec(mesh, names=names, hardware="cpu"),
                             autopar.PlanOptions(force="fsdp"))
    return choice_from_plan(plan, graph), plan
