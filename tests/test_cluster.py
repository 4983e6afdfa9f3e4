"""The cluster pass keeps the ILP small without changing what a plan costs."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.passes import strategies
from autopar.passes.cluster import cluster, identity
from autopar.passes.trace import trace
from autopar.solver.cost import CostModel
from autopar.solver.ilp import plan_time, solve
from tests.models import TinyConfig, TinyTransformer, lm_loss


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
