"""The intra-op ILP's prices on owners (passes/cluster.py: nodes that share one decision): every
owner strategy's seconds and bytes (t[v,s], m[v,s]), every edge block's per placement pair
(c[e,a,b], m[e,a,b]) and every FSDP bucket's gathers in flight (g[e,a,b]), priced once
(`priced_problem`) for solver/ilp.py to solve, under as many budgets as it takes.

Repeated layers are priced once: a node shares its twin's prices, and edges between the same
twins are priced once and counted. An edge whose producer (or consumer) has one placement
class is a price per consumer (producer) strategy, folded into the owner's; the rest are
blocks of placement pairs (the y columns), merged where they join the same owners alike."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

from autopar.passes.cluster import Clustering, identity
from autopar.passes.gathers import use_groups
from autopar.passes.strategies import PARAM, SNode, StrategyGraph

from .cost import INFEASIBLE, NO_TIME, CostModel, Split
from .plan_prices import Edge, edge_key, edges, node_costs, node_splits, price_key

PENALTY = 1.0  # seconds added to a discouraged strategy (forced styles)

# The last element of the key of a placement pair's column kept gathered (see
# `OwnerProblem.kept_gathered`).
KEPT = "kept gathered"


@dataclass
class OwnerProblem:
    node_cost: dict[str, list[float]]         # owner -> seconds per owner strategy
    memory: dict[str, list[float]]            # owner -> bytes per owner strategy
    # edge blocks (producer owner, consumer owner, placement of the edge per producer-owner
    # strategy, required placement per consumer-owner strategy, price per placement pair)
    edges: list[tuple[str, str, list, list, dict]]
    edge_memory: list[dict]                   # per edge block: bytes per placement pair
    # per FSDP bucket (passes/gathers.py), its gathers in flight: terms ("x", owner,
    # {strategy: bytes}) and ("y", edge block, {placement pair: bytes})
    buckets: list[list[tuple]]
    # with overlap (cost.overlap): node_cost and edge prices by where they run (cost.Split)
    node_split: dict[str, list[Split]] | None = None
    edge_split: list[dict] | None = None
    # with a relaxation (`priced_problem`) or several microbatches a step (cost.accumulation):
    # per owner strategy, the seconds of gradient synchronization its parameters pay, by where
    # they run (a step of several microbatches synchronizes once: planner `accumulated`)
    sync: dict[str, list[Split]] | None = None
    # with parameters freed after forward (cost.reshard): the same problem where each of a
    # parameter's uses may be priced freed or kept gathered (solver/resharding.py keeps
    # gathered what the budget holds), for ilp.py's `relaxed_bound`: its blocks' placement
    # pairs key the kept-gathered column with KEPT last
    kept_gathered: OwnerProblem | None = None


def priced_problem(graph: StrategyGraph, cost: CostModel, clustering: Clustering | None = None,
                   forced: dict[str, list[int]] | None = None,
                   discouraged: dict[str, list[int]] | None = None,
                   relaxation: bool = False) -> OwnerProblem:
    """The ILP's prices (ilp.py `solve`'s `problem`): every owner's and edge block's seconds
    and bytes, priced once for solves under several budgets; with `relaxation` also what
    ilp.py's `relaxed_bound` needs of them (`OwnerProblem.sync` and `kept_gathered`)."""
    return build_owner_problem(graph, cost, clustering or identity(graph), forced, discouraged,
                               relaxation)


def build_owner_problem(graph: StrategyGraph, cost: CostModel, c: Clustering, forced,
                        discouraged, relaxation: bool = False) -> OwnerProblem:
    """Aggregate node and edge costs onto owners: the owners' prices (`_owner_prices`), then
    each group of twin edges (`_edge_groups`) folded into them or made a block
    (`_price_edges`), then the blocks merged (`_merge_blocks`)."""
    prices = _owner_prices(graph, cost, c, forced, discouraged, relaxation)
    # An owner strategy ruled out (by `forced`, or unable to run) is never chosen: its edges'
    # placements become RULED_OUT and are not priced (most of the pricing of a forced plan).
    live = {o: [p != INFEASIBLE for p in costs] for o, costs in prices.node_cost.items()}
    groups = _edge_groups(graph, cost, c.twin)
    # The kept-gathered variant (`OwnerProblem.kept_gathered`, for a relaxation where
    # parameters are freed after forward): a parameter's uses are never folded into owner
    # prices but blocks whose every placement pair has two columns, freed (as priced here)
    # and kept gathered (`kept_cost`, the pair's key ending in KEPT); the rest as in the
    # problem.
    kept_cost = cost.copy(reshard=frozenset()) if relaxation and cost.reshard else None
    variant = (_copy_prices(prices.node_cost), _copy_prices(prices.node_split),
               _copy_prices(prices.memory)) if kept_cost else None
    built = _Blocks(cost, kept_cost, (prices.node_cost, prices.node_split, prices.memory),
                    variant)
    for e, count, in_buckets in groups.values():
        _price_edges(built, graph, c, live, e, count, in_buckets)
    problem, merged = _problem_of(built.blocks, built.buckets, built.problem, cost.overlap,
                                  prices.sync)
    if variant:  # (sharing the problem's merged blocks where it merged the same ones)
        problem.kept_gathered = _problem_of(built.blocks_kept, built.buckets_kept, variant,
                                            cost.overlap, prices.sync, merged)[0]
    return problem


@dataclass
class _OwnerPrices:
    """Per owner, per owner strategy: seconds (INFEASIBLE where it cannot be chosen), the same
    by where they run, bytes, and (with a relaxation) gradient synchronization's seconds."""

    node_cost: dict[str, list[float]]
    node_split: dict[str, list[Split]]
    memory: dict[str, list[float]]
    sync: dict[str, list[Split]] | None


def _owner_prices(graph: StrategyGraph, cost: CostModel, c: Clustering, forced, discouraged,
                  relaxation: bool) -> _OwnerPrices:
    """The owner strategies' own prices: the sum over their nodes of t[v,s] (+ PENALTY where
    `discouraged`; INFEASIBLE outside `forced`) and m[v,s], twins priced once."""
    overlap = cost.overlap
    t_split = node_splits(graph, cost, c.twin) if overlap else None
    t = {v: [sum(sp) for sp in splits] for v, splits in t_split.items()} if overlap \
        else node_costs(graph, cost, c.twin)
    owners = c.owners()
    node_split = {o: [NO_TIME] * len(c.index[o]) for o in owners}
    node_cost = {o: [0.0] * len(c.index[o]) for o in owners}
    memory = {o: [0.0] * len(c.index[o]) for o in owners}
    # (a step of several microbatches prices its synchronization once: ilp_rows.objective)
    with_sync = relaxation or cost.accumulation > 1
    sync = {o: [NO_TIME] * len(c.index[o]) for o in owners} if with_sync else None
    node_memory: dict[tuple, list[float]] = {}
    node_sync: dict[tuple, list[Split]] = {}
    # Nodes alike (one owner, the same prices, strategies and restrictions: the same node of
    # each folded layer) are added once, times how many there are.
    alike: dict[tuple, list] = {}
    for v, o in c.owner.items():
        key = (o, price_key(cost, c.twin, v), tuple(c.index[v]),
               tuple(forced[v]) if forced and v in forced else None,
               tuple(discouraged.get(v, ())) if discouraged else ())
        if key in alike:
            alike[key][1] += 1
        else:
            alike[key] = [v, 1]
    for (o, tw, index, allowed, penalized), (v, n) in alike.items():
        node = graph.nodes[v]
        if tw not in node_memory:
            node_memory[tw] = [cost.node_memory(node, s) for s in node.strategies]
            if node.kind == PARAM and with_sync:
                node_sync[tw] = [cost.grad_sync_split(node, s.output, s.zero)
                                 for s in node.strategies]
        allowed = set(allowed) if allowed is not None else None
        # (the lists looked up once)
        tv, costs, mem, node_mem = t[v], node_cost[o], memory[o], node_memory[tw]
        splits, tv_split = (node_split[o], t_split[v]) if overlap else (None, None)
        syncs, node_syncs = (sync[o], node_sync[tw]) if tw in node_sync else (None, None)
        for k, j in enumerate(index):
            if (allowed is not None and j not in allowed) or tv[j] == INFEASIBLE:
                costs[k] = INFEASIBLE
            elif costs[k] != INFEASIBLE:
                costs[k] += n * (tv[j] + (PENALTY if j in penalized else 0.0))
                if splits is not None:
                    splits[k] = splits[k].plus(tv_split[j], n)
            mem[k] += n * node_mem[j]
            if syncs is not None:
                syncs[k] = syncs[k].plus(node_syncs[j], n)
    return _OwnerPrices(node_cost, node_split, memory, sync)


def _edge_groups(graph: StrategyGraph, cost: CostModel,
                 twin: dict[str, str] | None) -> dict[tuple, list]:
    """Edges between the same twins (`edge_key`), priced once: per key [its first edge, how
    many, the FSDP buckets of the parameter uses among them]."""
    groups: dict[tuple, list] = {}
    bucket_of = use_groups(graph, cost.bucket_bytes)
    for e in edges(graph):
        key = edge_key(cost, twin, e)
        if key not in groups:
            groups[key] = [e, 0, []]
        groups[key][1] += 1
        if graph.nodes[e.producer].kind == PARAM:
            groups[key][2].append(bucket_of[(e.consumer, e.slot)])
    return groups


def _by_bucket() -> dict[int, list[tuple]]:
    return defaultdict(list)


@dataclass
class _Blocks:
    """What pricing the edges builds: the owner prices edges fold into (`problem`, and the
    kept-gathered `variant`'s where there is one: node_cost, node_split, memory), the edge
    blocks and the FSDP buckets' terms, of the problem and of the variant."""

    cost: CostModel
    kept_cost: CostModel | None
    problem: tuple[dict, dict, dict]
    variant: tuple[dict, dict, dict] | None
    blocks: list[tuple] = dataclasses.field(default_factory=list)
    blocks_kept: list[tuple] = dataclasses.field(default_factory=list)
    buckets: dict[int, list[tuple]] = dataclasses.field(default_factory=_by_bucket)
    buckets_kept: dict[int, list[tuple]] = dataclasses.field(default_factory=_by_bucket)


@dataclass(frozen=True)
class _EdgePrices:
    """The prices of a group of `count` twin edges into input `slot` of `node`, per placement
    pair (a, b), under a cost model (the problem's, or the kept-gathered variant's)."""

    graph: StrategyGraph
    node: SNode
    slot: int
    count: int
    overlap: bool

    def priced(self, a, b, cost: CostModel) -> tuple[float, Split]:
        """The price and (with overlap) the price by where it runs."""
        if a is RULED_OUT or b is RULED_OUT:
            return INFEASIBLE, NO_TIME
        if not self.overlap:
            p = cost.edge_time(self.graph, self.node, self.slot, a, b)
            return (p if p == INFEASIBLE else p * self.count), NO_TIME
        sp = cost.edge_split(self.graph, self.node, self.slot, a, b)  # edge_time is its sum
        p = sum(sp)
        return (p if p == INFEASIBLE else p * self.count), NO_TIME.plus(sp, self.count)

    def kept(self, a, b, cost: CostModel) -> float:
        """Bytes autograd keeps of the edges' tensor."""
        if a is RULED_OUT or b is RULED_OUT:
            return 0.0
        return cost.edge_memory(self.graph, self.node, self.slot, a, b) * self.count

    def held(self, a, b, cost: CostModel) -> float:
        """FSDP gathers in flight, one twin's (its bucket's share)."""
        if a is RULED_OUT or b is RULED_OUT:
            return 0.0
        return cost.gather_memory(self.graph, self.node, self.slot, a, b)


@dataclass(frozen=True)
class _Group:
    """One group of twin edges as `_price_edges` places it: its owners, the edge's placement
    per producer-owner strategy and the required one per consumer-owner strategy (RULED_OUT
    where never chosen), those grouped (`classes`), its FSDP buckets, and whether the
    kept-gathered variant has the use's own block (`both`)."""

    price: _EdgePrices
    ou: str
    ov: str
    a_of: list
    b_of: list
    a_cls: dict
    b_cls: dict
    in_buckets: list
    both: bool
    targets: list  # the owner prices a price on an owner strategy goes to


def _price_edges(built: _Blocks, graph: StrategyGraph, c: Clustering, live: dict,
                 e: Edge, count: int, in_buckets: list) -> None:
    """A group of `count` twin edges like `e` into `built`: its kept-gathered block (for a
    parameter's use, with the variant), then a price per owner strategy (both ends one owner,
    or one end with one placement class) or a block of placement pairs."""
    u, v = graph.nodes[e.producer], graph.nodes[e.consumer]
    ou, ov = c.owner[u.name], c.owner[v.name]
    a_of = _live([u.strategies[j].out(e.out_index) for j in c.index[u.name]],
                           live[ou])
    b_of = _live([v.strategies[j].inputs[e.slot] for j in c.index[v.name]], live[ov])
    both = built.kept_cost is not None and u.kind == PARAM  # a use the variant prices twice
    # where a price on an owner strategy goes: the problem, and the variant unless it has
    # the use's block
    targets = [built.problem] + ([built.variant] if built.variant and not both else [])
    g = _Group(_EdgePrices(graph, v, e.slot, count, built.cost.overlap), ou, ov, a_of, b_of,
               classes(a_of, live_only=True), classes(b_of, live_only=True), in_buckets, both,
               targets)
    if both:
        _kept_gathered_block(built, g)
    if ou == ov:
        _same_owner(built, g)
    elif len(g.a_cls) == 1 or len(g.b_cls) == 1:
        _one_side_fixed(built, g)
    else:
        _pair_block(built, g)


def _kept_gathered_block(built: _Blocks, g: _Group) -> None:
    """The variant's block of a parameter's use: two columns y[e,a,b] per placement pair,
    freed (the pair) and kept gathered (the pair and KEPT), each with its own c, m and g."""
    price2, kept2, split2, held2 = {}, {}, {}, {}
    for a in g.a_cls:
        for b in g.b_cls:
            for key, at in (((a, b), built.cost), ((a, b, KEPT), built.kept_cost)):
                price2[key], split2[key] = g.price.priced(a, b, at)
                kept2[key] = g.price.kept(a, b, at)
                held2[key] = g.price.held(a, b, at) if g.in_buckets else 0.0
    if g.in_buckets and any(held2.values()):
        for j in g.in_buckets:
            built.buckets_kept[j].append(("y", len(built.blocks_kept), held2))
    built.blocks_kept.append((g.ou, g.ov, g.a_of, g.b_of, price2, kept2, split2))


def _same_owner(built: _Blocks, g: _Group) -> None:
    """Both ends decided together: c, m (and g) per owner strategy, folded into t[v,s],
    m[v,s] (and the buckets' "x" terms)."""
    cost = built.cost
    for k, (a, b) in enumerate(zip(g.a_of, g.b_of)):
        _fold(g, g.ou, k, *g.price.priced(a, b, cost), g.price.kept(a, b, cost))
    if g.in_buckets:
        _bucketed(built, g, ("x", g.ou, {k: g.price.held(a, b, cost)
                                         for k, (a, b) in enumerate(zip(g.a_of, g.b_of))}))


def _one_side_fixed(built: _Blocks, g: _Group) -> None:
    """One end with one placement class: c, m (and g) per strategy of the other end's owner,
    folded into its t[v,s], m[v,s] (and the buckets' "x" terms)."""
    cost = built.cost
    owner = g.ov if len(g.a_cls) == 1 else g.ou
    gathers = {}
    for a, ks in g.a_cls.items():
        for b, js in g.b_cls.items():
            idxs = js if len(g.a_cls) == 1 else ks
            (p, sp), m = g.price.priced(a, b, cost), g.price.kept(a, b, cost)
            held = g.price.held(a, b, cost) if g.in_buckets else 0.0
            for k in idxs:
                _fold(g, owner, k, p, sp, m)
                gathers[k] = held
    if g.in_buckets:
        _bucketed(built, g, ("x", owner, gathers))


def _pair_block(built: _Blocks, g: _Group) -> None:
    """A block of placement pairs (the y[e,a,b] columns): c, m and g per pair (and the
    buckets' "y" terms)."""
    cost = built.cost
    pairs = [(a, b) for a in g.a_cls for b in g.b_cls]
    if g.in_buckets:
        term = ("y", len(built.blocks), {ab: g.price.held(*ab, cost) for ab in pairs})
        _bucketed(built, g, term, ("y", len(built.blocks_kept), term[2]))
    prices = {ab: g.price.priced(*ab, cost) for ab in pairs}
    # (no bytes for a pair never chosen: a quarter of a 70B layer's pairs have no
    # resharding between them)
    block = (g.ou, g.ov, g.a_of, g.b_of, {ab: p for ab, (p, _) in prices.items()},
             {ab: 0.0 if p == INFEASIBLE else g.price.kept(*ab, cost)
              for ab, (p, _) in prices.items()},
             {ab: sp for ab, (_, sp) in prices.items()})
    built.blocks.append(block)
    if built.variant and not g.both:
        built.blocks_kept.append(block)


def _fold(g: _Group, owner: str, k: int, p: float, sp: Split, m: float) -> None:
    """A price on an owner strategy: seconds, the same by where they run, and bytes."""
    for costs, splits, mem in g.targets:
        _add(costs[owner], k, p)
        splits[owner][k] = splits[owner][k].plus(sp)
        mem[owner][k] += m


def _bucketed(built: _Blocks, g: _Group, term: tuple, term_kept: tuple | None = None) -> None:
    """A term of the group's FSDP buckets' gathers (none when it gathers nothing): in the
    problem's, and the variant's unless it has the use's block."""
    if not any(term[2].values()):
        return
    for j in g.in_buckets:
        built.buckets[j].append(term)
        if built.variant and not g.both:
            built.buckets_kept[j].append(term_kept or term)


def _problem_of(blocks: list, buckets: dict, prices: tuple, overlap: bool, sync,
                known: dict | None = None) -> tuple[OwnerProblem, dict]:
    """The problem of these prices (node_cost, node_split, memory), and its merged blocks
    (`_merge_blocks`)."""
    node_cost, node_split, memory = prices
    merged, where, table = _merge_blocks(blocks, known)
    terms = [[(kind, where[at] if kind == "y" else at, held) for kind, at, held in bucket]
             for _, bucket in sorted(buckets.items())]
    return OwnerProblem(node_cost, memory, [b[:5] for b in merged], [b[5] for b in merged],
                        terms, node_split if overlap else None,
                        [b[6] for b in merged] if overlap else None, sync), table


def _copy_prices(prices: dict[str, list]) -> dict[str, list]:
    """Per owner, a copy of its list of prices (one per strategy)."""
    return {o: list(ps) for o, ps in prices.items()}


def _add(costs: list[float], k: int, p: float) -> None:
    costs[k] = INFEASIBLE if INFEASIBLE in (p, costs[k]) else costs[k] + p


def _merge_blocks(blocks: list, known: dict | None = None) -> tuple[list, list[int], dict]:
    """Edge blocks between the same owners with the same placements become one block; also
    the merged block of each given one, and what `known` takes. A block is (producer owner,
    consumer owner, a_of, b_of, then dicts by placement pair: prices and Splits added as such,
    the rest summed). `known`: the third result of an earlier call, whose merged blocks are
    taken as they are where they merged the same blocks (the same objects: a relaxation's
    kept-gathered variant shares most of the problem's)."""
    groups: dict = {}  # key -> its blocks, in first-seen order
    keys = []
    for i, block in enumerate(blocks):
        ou, ov, a_of, b_of, price = block[:5]
        # a block with kept-gathered columns stays alone: its freed-or-kept choice is its
        # own parameter's, which a merged column would tie to another's
        key = (ou, ov, tuple(a_of), tuple(b_of)) if not any(len(ab) > 2 for ab in price) \
            else ("alone", i)
        keys.append(key)
        groups.setdefault(key, []).append(block)
    out, where, table = [], {}, {}
    for key, members in groups.items():
        ids = tuple(map(id, members))
        where[key] = len(out)
        if known is not None and key in known and known[key][0] == ids:
            out.append(known[key][1])
            table[key] = known[key]
            continue
        first = members[0]  # (copied where others are added to it)
        merged = first if len(members) == 1 else (*first[:4], *(dict(f) for f in first[4:]))
        for block in members[1:]:
            for into, field in zip(merged[4:], block[4:]):
                if field and isinstance(next(iter(field.values())), Split):
                    for ab, p in field.items():
                        into[ab] = into[ab].plus(p)
                    continue
                for ab, p in field.items():
                    q = into[ab]
                    into[ab] = INFEASIBLE if p == INFEASIBLE or q == INFEASIBLE else q + p
        out.append(merged)
        table[key] = (ids, merged)
    return out, [where[key] for key in keys], table


def classes(placements, live_only: bool = False) -> dict:
    """Strategy indices grouped by placement, in first-seen order (with `live_only`, not
    those RULED_OUT)."""
    out: dict = defaultdict(list)
    for k, p in enumerate(placements):
        if not (live_only and p is RULED_OUT):
            out[p].append(k)
    return dict(out)


class _RuledOut:
    """The placement of an edge at an owner strategy the solver can never choose."""

    def __repr__(self) -> str:
        return "RULED_OUT"


RULED_OUT = _RuledOut()


def _live(placements: list, live: list[bool]) -> list:
    """`placements` (one per owner strategy) with those of ruled-out strategies RULED_OUT;
    as they are when every strategy is ruled out (the solver then reports the owner)."""
    if not any(live):
        return placements
    return [p if ok else RULED_OUT for p, ok in zip(placements, live)]
