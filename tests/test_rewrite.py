"""The per-rank programs of one plan are the same program: identical ops and collectives in
identical order on every rank (only constants such as slice offsets differ). Backward issues
collectives in autograd-graph order, so programs of different shape could deadlock."""

import itertools
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
