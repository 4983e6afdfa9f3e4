"""The cluster pass keeps the ILP small without changing what a plan costs."""

import copy
import pickle
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.passes import strategies
from autopar.passes.cluster import cluster, identity
from autopar.passes.trace import trace
from autopar.solver.cost import CostModel
from autopar.solver.diagnose import infeasible
from autopar.solver.ilp import NoFeasiblePlan, plan_time, solve
from autopar.zoo import lm_loss
from tests.models import TinyConfig, TinyTransformer


def _graph(model, x, y, loss, mesh):
    program = trace(model, (x,), loss, y)
    return program, strategies.build(program, mesh)


def test_transformer_layers_fold_and_share_choices():
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(vocab=32, hidden=16, heads=4, kv_heads=2, depth=4, seq=8))
    x = torch.randint(0, 32, (4, 8))
    program, graph = _graph(model, x, x, lm_loss, (2, 2))
    c = cluster(graph, program.graph_module)
    assert len(c.layers) == 1 and len(c.layers[0]) == 4  # one ModuleList of 4 blocks
    assert len(c.owners()) < len(graph.nodes) / 3
    cost = CostModel(autopar.MeshSpec((2, 2), hardware="h100"))
    sol = solve(graph, cost, clustering=c)
    assert plan_time(graph, cost, sol.choice) == pytest.approx(sol.objective, rel=1e-6)
    # every block runs the first block's strategies
    for twin, first in c.twin.items():
        assert graph.nodes[twin].strategies[sol.choice[twin]] == \
            graph.nodes[first].strategies[sol.choice[first]]


def test_single_product_blocks_are_not_folded():
    """Sequential(Linear, ReLU, Linear): the two Linears must be free to alternate
    (column then row parallel), so they are not tied."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x, y = torch.randn(8, 64), torch.randint(0, 64, (8,))
    program, graph = _graph(model, x, y, F.cross_entropy, (4,))
    assert not cluster(graph, program.graph_module).twin


def test_followers_do_not_change_the_optimum_here():
    """Views and single-origin elementwise ops follow their producer; on this model the
    optimum is the unclustered one."""
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(vocab=32, hidden=16, heads=4, kv_heads=2, depth=1, seq=8))
    x = torch.randint(0, 32, (4, 8))
    program, graph = _graph(model, x, x, lm_loss, (4,))
    cost = CostModel(autopar.MeshSpec((4,), hardware="cpu"))
    free = solve(graph, cost, clustering=identity(graph)).objective
    merged = solve(graph, cost, clustering=cluster(graph, program.graph_module,
                                                   fold_layers=False))
    assert merged.objective <= free * 1.001


class _CastWeight(nn.Module):
    """A weight used through a cast (as torchtitan's experts use theirs in bf16)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ self.w.to(x.dtype).t()


def test_uses_of_a_parameter_do_not_follow_its_storage():
    """FSDP stores the weight sharded and gathers it for the cast: had the cast followed the
    parameter, it would have had to run on the shard, and no FSDP plan would exist."""
    model, x = _CastWeight(), torch.randn(4, 8)
    program, graph = _graph(model, x, torch.randn(4, 8), F.mse_loss, (2,))
    c = cluster(graph, program.graph_module)
    param = next(v.name for v in graph.nodes.values() if v.kind == strategies.PARAM)
    assert all(c.owner[n] == n for n, v in graph.nodes.items()
               if any(u == param for u, _ in v.inputs))
    plan = autopar.plan(model, autopar.MeshSpec((2,), hardware="cpu"), (x, torch.randn(4, 8)),
                        loss_fn=F.mse_loss, force="fsdp")
    assert plan.parameters["w"] == (Shard(0),)


def test_infeasible_clustering_is_not_blamed_on_memory():
    """A clustering that ties the cast to the parameter's storage, with FSDP's restrictions
    (sharded storage, replicated use), leaves no plan; the error says memory is not why."""
    model, x = _CastWeight(), torch.randn(4, 8)
    program, graph = _graph(model, x, torch.randn(4, 8), F.mse_loss, (2,))
    param = next(v for v in graph.nodes.values() if v.kind == strategies.PARAM)
    cast = next(v for v in graph.nodes.values() if v.inputs and v.inputs[0][0] == param.name)
    c = identity(graph)
    c.owner[cast.name] = param.name  # the cast consumes the parameter as it is stored
    c.index[cast.name] = [next(j for j, t in enumerate(cast.strategies) if t.inputs[0] == s.output)
                          for s in param.strategies]
    whole = (Replicate(),)
    forced = {param.name: [k for k, s in enumerate(param.strategies) if s.output != whole],
              cast.name: [j for j, t in enumerate(cast.strategies) if t.inputs[0] == whole]}
    cost = CostModel(autopar.MeshSpec((2,), hardware="cpu"))
    with pytest.raises(NoFeasiblePlan):
        solve(graph, cost, memory_budget=2**30, forced=forced, clustering=c)
    # The planner's diagnosis solves for the least memory without the clustering.
    error = infeasible(graph, cost, 2**30, forced)
    assert re.search("memory is not the reason.*autopar bug", str(error)), error
    assert error.dominant is None  # so no gradient accumulation is tried for it


def test_strategies_share_one_interned_tuple_per_placement():
    """Equal placements of any two strategies are one object that hashes once (pricing hashes
    them millions of times), equal to and hashing as the plain tuple, and stay so through a
    pickle (a plan sent to another process)."""
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(vocab=32, hidden=16, heads=4, kv_heads=2, depth=2, seq=8))
    x = torch.randint(0, 32, (4, 8))
    _, graph = _graph(model, x, x, lm_loss, (2, 2))
    seen: dict[tuple, object] = {}
    for v in graph.nodes.values():
        for s in v.strategies:
            for p in [*s.inputs, *(s.output if v.multi_output else (s.output,))]:
                assert seen.setdefault(tuple(p), p) is p
    plain = (Shard(0), Replicate())
    shared = seen[plain]
    assert shared == plain and hash(shared) == hash(plain) and {plain: 1}[shared] == 1
    back = pickle.loads(pickle.dumps(shared))
    assert back is shared and copy.deepcopy(shared) is shared
