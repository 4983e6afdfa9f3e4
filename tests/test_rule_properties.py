"""Rule-level properties with drawn shapes: for ops whose rules depend most on shapes (reshapes,
dimension moves, products, reductions, broadcasting, normalization, attention), hypothesis
draws shapes (odd and indivisible sizes included) and every strategy the rule offers on a mesh
dimension of 2, 3 or 4 is run on simulated shards, forward and backward, against the whole op.
The fixed samples of tests/test_rules.py cover every registered op; this explores shapes."""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.passes.rules import RULES
from tests.rule_samples import Sample
from tests.test_rules import Case, built, check, usable

aten = torch.ops.aten
DIM = st.integers(1, 6)


def shapes(min_dims=1, max_dims=4):
    return st.lists(DIM, min_size=min_dims, max_size=max_dims).map(tuple)


def _factorizations(n: int, k: int, draw) -> tuple:
    """A random shape of k dims with product n."""
    out = [1] * k
    p, m = 2, n
    while m > 1:
        while m % p == 0:
            out[draw(st.integers(0, k - 1))] *= p
            m //= p
        p += 1
    return tuple(out)


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["view", "transpose", "permute", "linear", "bmm", "sum", "mean",
                                 "add", "softmax", "layer_norm", "cat", "sdpa", "expand"]))
    s = draw(shapes())
    if kind == "view":
        new = _factorizations(math.prod(s), draw(st.integers(1, 4)), draw)
        sample = (aten.view.default, lambda g: ((g.f(*s), list(new)), {}))
    elif kind == "transpose":
        d0, d1 = draw(st.integers(0, len(s) - 1)), draw(st.integers(0, len(s) - 1))
        sample = (aten.transpose.int, lambda g: ((g.f(*s), d0, d1), {}))
    elif kind == "permute":
        perm = draw(st.permutations(range(len(s))))
        sample = (aten.permute.default, lambda g: ((g.f(*s), list(perm)), {}))
    elif kind == "linear":
        out_f, bias = draw(DIM), draw(st.booleans())
        sample = (aten.linear.default, lambda g: (
            (g.f(*s), g.f(out_f, s[-1])) + ((g.f(out_f),) if bias else ()), {}))
    elif kind == "bmm":
        b, m, k, n = (draw(DIM) for _ in range(4))
        sample = (aten.bmm.default, lambda g: ((g.f(b, m, k), g.f(b, k, n)), {}))
    elif kind in ("sum", "mean"):
        dims = sorted(draw(st.sets(st.integers(0, len(s) - 1), min_size=1)))
        keep = draw(st.booleans())
        op = aten.sum.dim_IntList if kind == "sum" else aten.mean.dim
        sample = (op, lambda g: ((g.f(*s), dims, keep), {}))
    elif kind == "add":  # broadcasting: the second operand drops leading dims / has unit dims
        lead = draw(st.integers(0, len(s) - 1))
        other = tuple(1 if draw(st.booleans()) else d for d in s[lead:])
        sample = (aten.add.Tensor, lambda g: ((g.f(*s), g.f(*other)), {}))
    elif kind == "softmax":
        d = draw(st.integers(0, len(s) - 1))
        sample = (aten._softmax.default, lambda g: ((g.f(*s), d, False), {}))
    elif kind == "layer_norm":
        k = draw(st.integers(1, len(s)))
        affine = draw(st.booleans())
        norm = list(s[-k:])
        sample = (aten.layer_norm.default, lambda g: (
            (g.f(*s), norm) + ((g.f(*norm), g.f(*norm)) if affine else ()), {}))
    elif kind == "cat":
        d = draw(st.integers(0, len(s) - 1))
        other = tuple(draw(DIM) if i == d else x for i, x in enumerate(s))
        sample = (aten.cat.default, lambda g: (([g.f(*s), g.f(*other)], d), {}))
    elif kind == "expand":
        lead = tuple(draw(st.lists(DIM, max_size=2)))
        src = tuple(1 if draw(st.booleans()) else d for d in s)
        sample = (aten.expand.default, lambda g: ((g.f(*src), list(lead + s)), {}))
    else:  # sdpa with grouped-query heads, causal or not
        b, kv, rep, seq, e = (draw(st.integers(1, 4)) for _ in range(5))
        causal = draw(st.booleans())
        sample = (aten.scaled_dot_product_attention.default, lambda g: (
            (g.f(b, kv * rep, seq, e), g.f(b, kv, seq, e), g.f(b, kv, seq, e)),
            {"is_causal": causal, "enable_gqa": rep > 1}))
    op, build = sample
    name = f"drawn{draw(st.integers(0, 2**30))}"
    return Sample(op, name, build), draw(st.sampled_from([2, 3, 4]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_every_strategy_on_drawn_shapes(case):
    sample, n = case
    call = built(sample)[3]
    for rule in dict.fromkeys(RULES[sample.op](call)):
        if usable(rule, call, n):
            check(Case(sample, n, rule))
