"""The plan as one self-contained HTML page: `Plan.to_html(path)`.

One file, its style, script and charts (SVG) inline, nothing fetched when it opens: the plan's
key numbers (ids `step-time`, `compute-time`, `communication-time` in ms; `peak-memory`,
`memory-budget` in MiB; `plan-hash`, `devices`, `collective-count`, `accumulation`,
`recomputed-ops`, and for pipelines `pipeline-schedule`, `pipeline-stages`,
`pipeline-microbatches`, `pipeline-bubble`), formatted as the printed table formats them
(`table.ms`, `table.mib`); the module tree with each module's parameter placements per mesh
dimension, folded as the table folds it (`table.module_groups`); the step as consecutive
segments (`timeline.step_segments`); memory per device by kind against the budget; the
collectives ranked by time; recomputation and gradient accumulation; and a pipeline's schedule
(`timeline.pipeline_slots`). The page's script counts its own errors in the body's
`data-errors` attribute, so a browser test can read that none happened.
"""

from __future__ import annotations

from html import escape

from autopar.passes.placement import fmt

from .table import NOTE, cells, header, mib, module_groups, ms, recompute_lines
from .timeline import pipeline_slots, step_segments

WIDTH = 960          # px of a chart's bars
LABEL = 200          # px of a chart's labels, left of the bars
COLORS = {"compute": "#4e79a7", "gradient_sync": "#e15759", "idle": "#bab0ac",
          "parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#59a14f",
          "activations": "#edc948", "recomputed": "#b07aa1", "gathered": "#76b7b2",
          "workspace": "#ff9da7"}
OTHER = "#f28e2b"    # collectives and memory kinds without a color of their own
SHOWN = 100          # collectives listed; the rest are counted


def write(plan, path: str) -> None:
    """Write `plan` (an autopar.Plan) as one self-contained HTML page at `path`."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(plan))


def render(plan) -> str:
    """The page for `plan` (an autopar.Plan), as one HTML string."""
    sections = [summary(plan), timeline_section(plan), memory_section(plan),
                module_section(plan), collective_section(plan), extras_section(plan)]
    if plan.pipeline is not None:
        sections.append(pipeline_section(plan))
    title = f"autopar plan {plan.hash()}"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{escape(title)}</title><style>{CSS}</style><script>{ERRORS}</script>"
            f'</head>\n<body data-errors="0"><h1>{escape(title)}</h1>\n'
            + "\n".join(sections) + f"\n<script>{SCRIPT}</script></body></html>\n")


def number(key: str, value: str, unit: str = "") -> str:
    """A key number with a stable id, its unit outside the element."""
    return f'<span class="num" id="{key}">{escape(value)}</span>' + (f" {unit}" if unit else "")


def section(title: str, body: str, key: str) -> str:
    """One titled part of the page, its element id `key`."""
    return f'<section id="{key}"><h2>{escape(title)}</h2>\n{body}\n</section>'


def summary(plan) -> str:
    """Mesh, hash, options and the key numbers."""
    cost = plan.cost
    devices = 1
    for s in plan.mesh.shape:
        devices *= s
    cards = [("predicted step", number("step-time", ms(cost.step_time), "ms")),
             ("compute", number("compute-time", ms(cost.compute), "ms")),
             ("communication", number("communication-time", ms(cost.communication_total), "ms")),
             ("peak memory per device", number("peak-memory", mib(cost.peak_memory), "MiB")),
             ("memory budget", number("memory-budget", mib(cost.memory_budget), "MiB")),
             ("devices", number("devices", str(devices)))]
    body = '<div class="cards">' + "".join(
        f'<div class="card"><div class="label">{escape(k)}</div>{v}</div>' for k, v in cards)
    notes = "".join(f"<li>{escape(line)}</li>" for line in header(plan)[1:2])
    return section("Summary", body + f'</div><p>plan hash {number("plan-hash", plan.hash())}; '
                   f"{escape(cost.precision)}, {escape(cost.optimizer)}, compute priced by "
                   f"{escape(cost.compute_source)}</p><ul>{notes}</ul>", "summary")


# -- charts ------------------------------------------------------------------------------------

def bar_rows(rows: list[tuple[str, float, float, str, str]], scale: float) -> str:
    """An SVG of horizontal bars, one per row: (label, start, length, color, tooltip), in the
    units of `scale` (the length that spans the chart)."""
    height = 22
    out = [f'<svg width="{LABEL + WIDTH + 90}" height="{height * len(rows) + 4}" role="img">']
    for i, (label, start, length, color, tip) in enumerate(rows):
        y = i * height + 2
        x = LABEL + WIDTH * start / scale if scale else LABEL
        w = max(1.0, WIDTH * length / scale) if scale and length else 0
        out.append(f'<text x="{LABEL - 6}" y="{y + 15}" text-anchor="end">{escape(label)}</text>'
                   f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{height - 4}" '
                   f'fill="{color}"><title>{escape(tip)}</title></rect>'
                   f'<text x="{x + w + 4:.1f}" y="{y + 15}">{escape(tip.split(": ")[-1])}</text>')
    return "".join(out) + "</svg>"


def timeline_section(plan) -> str:
    """The step as consecutive bars: compute and collectives by phase, the bubble."""
    segments = step_segments(plan)
    rows, at = [], 0.0
    for s in segments:
        label = f"{s.phase}: {s.what}"
        more = f" (+{ms(s.hidden)} ms hidden under compute)" if s.hidden else ""
        rows.append((label, at, s.seconds, COLORS.get(s.what, OTHER),
                     f"{label}: {ms(s.seconds)} ms{more}"))
        at += s.seconds
    note = ("<p>Each bar starts where the previous ends: the time the step spends on it. "
            "Collectives the runtime issues ahead of need (FSDP gathers, gradient buckets) run "
            "beside compute where the hardware overlaps them; the part hidden under compute "
            "is in each bar's label, not its length.</p>")
    return section("Predicted step", note + bar_rows(rows, at), "timeline")


def memory_rows(label: str, memory: dict[str, float]) -> list:
    """Rows for `bar_rows`: one per memory kind (bytes), each starting where the previous
    ends, so that the last ends at their total."""
    rows, at = [], 0.0
    for kind, size in memory.items():
        rows.append((f"{label}{kind}", at, size, COLORS.get(kind, OTHER),
                     f"{kind}: {mib(size)} MiB"))
        at += size
    return rows


def memory_section(plan) -> str:
    """Memory per device by kind (stacked), and the peak against the budget."""
    cost = plan.cost
    peak, budget = cost.peak_memory, cost.memory_budget
    body = bar_rows(memory_rows("", cost.memory), peak)
    if budget:
        used = 100 * peak / budget
        body += (f"<p>peak {mib(peak)} MiB of the {mib(budget)} MiB budget ({used:.1f}%)</p>"
                 + bar_rows([("peak", 0, peak, COLORS["compute"], f"peak: {mib(peak)} MiB"),
                             ("budget", 0, budget, COLORS["idle"],
                              f"budget: {mib(budget)} MiB")], max(peak, budget)))
    kinds = "".join(f"<tr><td>{escape(k)}</td><td class=r>{mib(v)}</td>"
                    f"<td class=r>{100 * v / budget if budget else 0:.2f}</td></tr>"
                    for k, v in cost.memory.items())
    body += ("<table><tr><th>kind</th><th>MiB per device</th><th>% of budget</th></tr>"
             f"{kinds}</table>")
    return section("Memory per device", body, "memory")


# -- tables ------------------------------------------------------------------------------------

def placement_dims(plan) -> list[tuple[int, str]]:
    """(index in a placement, mesh dimension name) of the dimensions placements are over:
    the mesh, less "pp" in a pipelined plan."""
    names = [plan.mesh.names[d] for d in plan.placement_dims]
    return list(enumerate(names or ["-"]))


def placement_cell(plan, names: list[str], k: int) -> str:
    """The distinct placements of parameters `names` on placement dimension `k`."""
    shown = dict.fromkeys(fmt(plan.parameters[n][k:k + 1]) for n in names)
    return " ".join(f'<span class="p{p[0]}">{escape(p)}</span>' for p in shown) or "-"


def module_section(plan) -> str:
    """The module tree, folded as the printed table folds it, with parameter placements per
    mesh dimension."""
    dims = placement_dims(plan)
    head = ("<tr><th>module</th>" + "".join(f"<th>params on {escape(n)}</th>" for _, n in dims)
            + "<th>heaviest op: inputs -&gt; output</th><th>ms</th><th>collectives</th>"
            "<th>replicated</th></tr>")
    bodies = []
    for group in module_groups(plan):
        rows = []
        if group.layer:
            stages = sorted({o.stage for r in group.rows.values() for o in r.ops})
            where = f" stage {stages[0]}" if plan.pipeline is not None and stages else ""
            times = f" x{group.count}" if group.count > 1 else ""
            rows.append(f'<tr class="group"><td colspan="{len(dims) + 5}">'
                        f'<button type="button" class="fold">-</button> {escape(group.label)}'
                        f"<b>{times}</b>{where}: {ms(group.time)} ms in all"
                        f"{'; rows: one layer' if group.count > 1 else ''}</td></tr>")
        for rel, row in group.rows.items():
            label, _, op, t, coll, note = cells(
                plan, rel or ("(layer)" if group.layer else group.label), row)
            indent = ' class="in"' if group.layer else ""
            rows.append(f"<tr><td{indent}>{escape(label)}</td>"
                        + "".join(f"<td>{placement_cell(plan, row.names, k)}</td>"
                                  for k, _ in dims)
                        + f"<td>{escape(op)}</td><td class=r>{t}</td><td>{escape(coll)}</td>"
                        f"<td>{escape(note)}</td></tr>")
        bodies.append("<tbody>" + "".join(rows) + "</tbody>")
    legend = ("<p>R replicated, S(d) sharded on tensor dimension d, P pending sum; replicated: "
              + ", ".join(f"{escape(v)} = {escape(k)}" for k, v in NOTE.items()) + "</p>")
    return section("Modules", legend + f'<table class="modules">{head}{"".join(bodies)}</table>',
                   "modules")


def collective_section(plan) -> str:
    """Every collective of a step, the slowest first."""
    ranked = sorted(plan.collectives, key=lambda c: -c.time)
    names = plan.mesh.names
    rows = "".join(f"<tr><td class=r>{i + 1}</td><td>{escape(c.kind)}</td>"
                   f"<td>{escape(names[c.mesh_dim])}</td><td>{escape(c.phase)}</td>"
                   f"<td>{escape(c.at)}</td><td class=r>{mib(c.bytes)}</td>"
                   f"<td class=r>{ms(c.time)}</td></tr>" for i, c in enumerate(ranked[:SHOWN]))
    more = (f"<p>... and {len(ranked) - SHOWN} more, {ms(sum(c.time for c in ranked[SHOWN:]))}"
            " ms in all</p>" if len(ranked) > SHOWN else "")
    body = (f"<p>{number('collective-count', str(len(ranked)))} collectives per step, "
            f"{ms(sum(c.time for c in ranked))} ms</p><table><tr><th>#</th><th>kind</th>"
            "<th>mesh dim</th><th>phase</th><th>serves</th><th>MiB</th><th>ms</th></tr>"
            f"{rows}</table>{more}")
    return section("Collectives by time", body, "collectives")


def extras_section(plan) -> str:
    """Recomputation and gradient accumulation."""
    lines = recompute_lines(plan.recompute) or ["no recomputation: every activation is kept"]
    items = "".join(f"<li>{escape(line)}</li>" for line in lines)
    accumulation = ("gradients synchronized once a step" if plan.accumulation > 1 else
                    "none")
    body = (f"<p>recomputed ops: {number('recomputed-ops', str(len(plan.recompute.mode_of)))}"
            f"</p><ul>{items}</ul><p>gradient accumulation: "
            f"{number('accumulation', str(plan.accumulation))} microbatch"
            f"{'es' * (plan.accumulation != 1)} a step ({accumulation})</p>")
    return section("Recomputation and accumulation", body, "extras")


def pipeline_section(plan) -> str:
    """The stages, and the schedule as a chart (one row per pp rank)."""
    pipe = plan.pipeline
    cost = plan.cost
    forward = cost.compute_forward / cost.compute if cost.compute_forward else 1 / 3
    slots = pipeline_slots(pipe, forward)
    end = max((s.end for s in slots), default=0.0)
    body = (f"<p>schedule {number('pipeline-schedule', pipe.schedule)}, "
            f"{number('pipeline-stages', str(pipe.num_stages))} stages "
            f"({pipe.virtual_stages} per pp rank), "
            f"{number('pipeline-microbatches', str(pipe.microbatches))} microbatches of "
            f"{pipe.batch_size // pipe.microbatches}, bubble "
            f"{number('pipeline-bubble', f'{pipe.bubble:.3f}')}</p>")
    stages = "".join(
        f"<tr><td>{k}</td><td>{k % (pipe.num_stages // pipe.virtual_stages)}</td>"
        f"<td>{escape(', '.join(pipe.stage_blocks(k)))}</td>"
        f"<td class=r>{ms(pipe.stage_time[k]) if pipe.stage_time else '-'}</td>"
        f"<td class=r>{f'{pipe.in_flight[k]:g}' if pipe.in_flight else '-'}</td></tr>"
        for k in range(pipe.num_stages))
    body += ("<table><tr><th>stage</th><th>pp rank</th><th>blocks</th><th>ms per microbatch"
             f"</th><th>in flight</th></tr>{stages}</table>")
    ranks = []
    for r, memory in enumerate(pipe.rank_memory):
        ranks += memory_rows(f"pp rank {r}: ", memory)
    if ranks:
        body += "<h3>Memory per device of each pp rank</h3>" + bar_rows(
            ranks, max(sum(m.values()) for m in pipe.rank_memory))
    body += (f"<h3>Schedule</h3><p>{len(slots)} slots in {ms(end)} ms: forward light, "
             "backward dark, the number is the microbatch; laid out from the stages' times "
             "(the plan's step adds sends and gradient sync)</p>" + schedule_chart(slots, end))
    return section("Pipeline", body, "pipeline")


def schedule_chart(slots, end: float) -> str:
    """An SVG of a pipeline schedule: a row per pp rank, a box per slot."""
    height = 30
    ranks = max((s.rank for s in slots), default=0) + 1
    out = [f'<svg width="{LABEL + WIDTH + 10}" height="{height * ranks + 4}" '
           'role="img" id="schedule-chart">']
    for r in range(ranks):
        out.append(f'<text x="{LABEL - 6}" y="{r * height + 20}" text-anchor="end">pp rank {r}'
                   "</text>")
    for s in slots:
        x = LABEL + WIDTH * s.start / end if end else LABEL
        w = max(1.0, WIDTH * (s.end - s.start) / end) if end else 0
        hue = (s.stage * 67) % 360
        fill = f"hsl({hue},55%,{35 if s.backward else 70}%)"
        what = "backward" if s.backward else "forward"
        out.append(f'<rect x="{x:.1f}" y="{s.rank * height + 2}" width="{w:.1f}" '
                   f'height="{height - 4}" fill="{fill}" stroke="#fff"><title>stage {s.stage}, '
                   f"microbatch {s.microbatch}, {what}, {ms(s.start)}-{ms(s.end)} ms</title>"
                   "</rect>")
        if w > 14:
            color = "#fff" if s.backward else "#000"
            out.append(f'<text x="{x + w / 2:.1f}" y="{s.rank * height + 20}" fill="{color}" '
                       f'text-anchor="middle">{s.microbatch}</text>')
    return "".join(out) + "</svg>"


CSS = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:20px}h2{font-size:17px;border-bottom:1px solid #ccc;margin-top:28px}
.cards{display:flex;flex-wrap:wrap;gap:12px}.card{border:1px solid #ccc;border-radius:6px;
padding:8px 14px}.card .label{color:#666;font-size:12px}.card .num{font-size:20px;
font-weight:600}table{border-collapse:collapse;margin:8px 0}td,th{padding:2px 8px;
border-bottom:1px solid #eee;text-align:left;vertical-align:top}td.r{text-align:right;
font-variant-numeric:tabular-nums}tr.group td{background:#f3f3f3;font-weight:600}
td.in{padding-left:28px}.pR{color:#777}.pS{color:#1f5fa8;font-weight:600}.pP{color:#c0392b}
svg text{font-size:12px}tbody.folded tr:not(.group){display:none}button.fold{width:22px}
"""
# Before anything else: count the page's errors where a test can read them.
ERRORS = """
window.pageErrors=[];window.onerror=function(msg){window.pageErrors.push(String(msg));
var b=document.body;if(b){b.dataset.errors=String(window.pageErrors.length);
b.dataset.lastError=String(msg);}};
"""
SCRIPT = """
document.querySelectorAll("button.fold").forEach(function(b){b.addEventListener("click",
function(){var t=b.closest("tbody");t.classList.toggle("folded");
b.textContent=t.classList.contains("folded")?"+":"-";});});
document.body.dataset.errors=String(window.pageErrors.length);
document.body.dataset.rendered="1";
"""
