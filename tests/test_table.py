"""The printed plan's module table: cells wider than their column wrap, none is cut, no line is
wider than the table's WIDTH."""

import dataclasses

import pytest
import torch

import autopar
from autopar.table import WIDTH, cells, module_groups, modules
from autopar.zoo import GPT, GPTConfig, lm_loss

HEADERS = ("module", "params", "heaviest op", "ms", "collectives", "Rn:")


class Wrapped(torch.nn.Module):
    """A GPT one module deeper, under a long name: module paths wider than their column."""

    def __init__(self):
        super().__init__()
        self.language_model_under_a_long_name = GPT(GPTConfig(
            vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))

    def forward(self, idx):
        return self.language_model_under_a_long_name(idx)


@pytest.fixture(scope="module")
def long_plan():
    """A plan whose cells are long: a 3-D mesh (three placements a tensor), long module paths,
    and an op replicated for each reason the table abbreviates."""
    torch.manual_seed(0)
    x = torch.randint(0, 64, (8, 16))
    spec = autopar.MeshSpec((2, 2, 2), names=("dp", "tp", "cp"), hardware="cpu")
    plan = autopar.plan(Wrapped(), spec, (x, x), loss_fn=lm_loss,
                        force={"dp": "fsdp", "tp": "tensor"})
    reasons = iter(["no sharding rule", "replicated is cheaper", "updates state in place",
                    "no sharded strategy divides its shapes by the mesh",
                    "its rule shards no input for these arguments"])
    head = plan.ops[-1].module
    ops = [dataclasses.replace(o, replicated=next(reasons, o.replicated))
           if o.module == head else o for o in plan.ops]
    return dataclasses.replace(plan, ops=ops)


def _table_lines(text: str) -> list[str]:
    """The module table's lines: from its header to the first blank line after it."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("module "))
    last = lines.index("", first)
    return lines[first:last]


def _spans(header: str) -> list[tuple[int, int | None]]:
    """Each column's (start, end) in the table's lines, from where its header starts."""
    starts, at = [], 0
    for h in HEADERS:
        at = header.index(h, at)
        starts.append(at)
    return list(zip(starts, [*starts[1:], None]))


def _read_back(lines: list[str]) -> list[tuple[str, ...]]:
    """The table's rows, each cell with its continuation lines joined (whitespace removed: a
    cell wraps at spaces, dots and commas). A row starts on a line with an ms value; its
    continuation lines leave the ms column blank."""
    spans = _spans(lines[0])
    rows: list[list[str]] = []
    for line in lines:
        parts = ["".join(line[a:b].split()) for a, b in spans]
        if parts[3]:
            rows.append(parts)
        else:
            rows[-1] = [r + p for r, p in zip(rows[-1], parts)]
    return [tuple(r) for r in rows]


def _squeezed(row: tuple[str, ...]) -> tuple[str, ...]:
    return tuple("".join(c.split()) for c in row)


def test_no_line_is_wider_than_the_table(long_plan):
    text = modules(long_plan)
    assert max(map(len, text.splitlines())) <= WIDTH, text


def test_long_cells_wrap_and_nothing_is_cut(long_plan):
    text = modules(long_plan)
    lines = _table_lines(text)
    rows = _read_back(lines)
    assert not any(c.endswith("..") for r in rows for c in r), text
    want = []
    for group in module_groups(long_plan):
        if group.layer:
            want += [cells(long_plan, "  " + (r or "(layer)"), sub)
                     for r, sub in group.rows.items()]
        else:
            want.append(cells(long_plan, group.label, group.rows[""]))
    got = set(rows)
    missing = [r for r in want if _squeezed(r) not in got]
    assert not missing, f"rows not read back whole: {missing}\n{text}"


def test_a_wrapped_cell_continues_two_spaces_in_with_the_other_cells_blank(long_plan):
    lines = _table_lines(modules(long_plan))
    spans = _spans(lines[0])
    continued = [[line[a:b] for a, b in spans] for line in lines[1:]
                 if not line[spans[3][0]:spans[3][1]].strip()]
    for parts in continued:
        assert any(p.strip() for p in parts)
        assert all(p.startswith("  ") for p in parts if p.strip()), parts
    # every column but ms wrapped somewhere: the plan's cells are long enough to test this
    wrapped = {i for parts in continued for i, p in enumerate(parts) if p.strip()}
    assert wrapped == {0, 1, 2, 4, 5}, "\n".join(lines)
