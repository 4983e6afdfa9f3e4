"""The per-rank programs of one plan are the same program: identical ops and collectives in
identical order on every rank (only constants such as slice offsets differ). Backward issues
collectives in autograd-graph order, so programs of different shape could deadlock."""

import itertools
import math
import operator
import random

import pytest
import torch

import autopar
from autopar.passes import strategies
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
    for seed in range(4):
        drawn = random_choice(graph, cost, random.Random(seed))
        choice = {n: graph.nodes[n].strategies[i] for n, i in drawn.items()}
        programs = [rewrite(program, graph, choice, coords, comm)
                    for coords in itertools.product(*(range(s) for s in mesh))]
        train = [signature(p.train) for p in programs]
        infer = [signature(p.infer) for p in programs]
        assert all(t == train[0] for t in train), f"seed {seed}: rank programs differ"
        assert all(i == infer[0] for i in infer), f"seed {seed}: rank programs differ"


def test_fsdp_gathers_are_prefetched_in_buckets(monkeypatch):
    """Under FSDP every bucket's all-gather starts before the first op and is waited for just
    before its first use; buckets stay within BUCKET_BYTES (shrunk here to split a GPT)."""
    from autopar.passes import rewrite as rewrite_mod
    from autopar.planner import choice_from_plan, solve_plan

    monkeypatch.setattr(rewrite_mod, "BUCKET_BYTES", 16 * 1024)
    model, loss_fn, (x, y) = rank_tasks.build("gpt")
    program = trace(model, (x,), loss_fn, y)
    plan, graph = solve_plan(program, autopar.MeshSpec((2,), names=("dp",), hardware="cpu"),
                             force="fsdp")
    choice = choice_from_plan(plan, graph)

    class Named(RecordingComm):
        def all_gather_start(self, xs, dims, mesh_dim):
            raise AssertionError("not run")

        def all_gather_many(self, xs, dims, mesh_dim, started=None):
            raise AssertionError("not run")

    train = rewrite(program, graph, choice, (0,), Named()).train.graph
    nodes = list(train.nodes)
    starts = [i for i, n in enumerate(nodes) if getattr(n.target, "__name__", "") ==
              "all_gather_start"]
    waits = [n for n in nodes if getattr(n.target, "__name__", "") == "all_gather_many"]
    assert len(starts) == len(waits) > 1
    first_op = min(i for i, n in enumerate(nodes) if n.op == "call_function"
                   and not isinstance(getattr(n.target, "__self__", None), Named))
    assert max(starts) < first_op  # every gather is in flight before any compute
    for w in waits:
        started = w.args[3]
        assert started.op == "call_function" and started.args[0] == w.args[0]
        gathered = sum(math.prod(graph.nodes[p.name].out_shapes[0]) * 4 for p in w.args[0])
        assert len(w.args[0]) == 1 or gathered <= 16 * 1024
        # waited for right before the first use of one of its parameters
        users = [u for item in w.users for u in item.users]
        assert users and nodes.index(w) < min(nodes.index(u) for u in users)
        between = nodes[nodes.index(w) + 1:min(nodes.index(u) for u in users)]
        # (only the unpacking of gathered values and the consumer's other inputs' resharding)
        assert all(n.target in (operator.getitem, rewrite_mod._slice)
                   or isinstance(getattr(n.target, "__self__", None), Named) for n in between)
