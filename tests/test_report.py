"""Plan.to_html: one self-contained page whose key numbers are the plan's, read as written and
as a real browser (headless Chromium, Debian's `chromium`) renders it, without script errors."""

import os
import re
import shutil
import subprocess

import pytest
import torch

import autopar
from autopar.table import mib, ms
from autopar.timeline import pipeline_slots, step_segments
from autopar.zoo import GPT, GPTConfig, lm_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(ROOT, "tests", "artifacts")  # ignored by git
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """{name: (plan, path of its page)} for a dp x tp GPT plan and a pp x dp pipelined one."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    x = torch.randint(0, 64, (4, 16))
    meshes = {"dp_tp": (("dp", "tp"), {}), "pp_dp": (("pp", "dp"), {"microbatches": 2})}
    out = {}
    for name, (names, options) in meshes.items():
        spec = autopar.MeshSpec((2, 2), names=names, hardware="cpu")
        plan = autopar.plan(model, spec, (x, x), loss_fn=lm_loss, **options)
        path = tmp_path_factory.mktemp("report") / f"{name}.html"
        plan.to_html(str(path))
        out[name] = (plan, path)
    return out


def key_numbers(plan) -> dict[str, str]:
    """The numbers the page shows under fixed ids, formatted as the report formats them."""
    cost = plan.cost
    out = {"step-time": ms(cost.step_time), "compute-time": ms(cost.compute),
           "communication-time": ms(cost.communication_total),
           "peak-memory": mib(cost.peak_memory), "memory-budget": mib(cost.memory_budget),
           "plan-hash": plan.hash(), "devices": "4",
           "collective-count": str(len(plan.collectives)),
           "accumulation": str(plan.accumulation),
           "recomputed-ops": str(len(plan.recompute.mode_of))}
    if plan.pipeline is not None:
        pipe = plan.pipeline
        out |= {"pipeline-schedule": pipe.schedule, "pipeline-stages": str(pipe.num_stages),
                "pipeline-microbatches": str(pipe.microbatches),
                "pipeline-bubble": f"{pipe.bubble:.3f}"}
    return out


def shown(page: str) -> dict[str, str]:
    """id -> text of the page's key numbers."""
    return dict(re.findall(r'<span class="num" id="([\w-]+)">([^<]*)</span>', page))


def test_the_page_is_one_file_with_the_plans_numbers(reports):
    for name, (plan, path) in reports.items():
        page = path.read_text()
        assert os.listdir(path.parent) == [path.name]
        assert not re.search(r"https?://", page), name        # nothing fetched when it opens
        assert not re.search(r"<(link|img|iframe)\b|\bsrc=", page), name
        assert shown(page) == key_numbers(plan), name
        assert all(label in page for label in ("Predicted step", "Memory per device",
                                               "Modules", "Collectives by time"))
        folded = "h.0-1" if plan.pipeline is None else "h.1"  # stages split the layers
        assert folded in page, name
        assert ("schedule-chart" in page) == (plan.pipeline is not None)


def test_the_step_segments_add_up_to_the_step_time(reports):
    for plan, _ in reports.values():
        segments = step_segments(plan)
        assert sum(s.seconds for s in segments) == pytest.approx(plan.cost.step_time)
        assert segments[0].what == "compute" and segments[0].phase == "forward"


def test_the_pipeline_schedule_keeps_its_dependencies(reports):
    pipe = reports["pp_dp"][0].pipeline
    slots = pipeline_slots(pipe)
    assert len(slots) == 2 * pipe.num_stages * pipe.microbatches
    end = {(s.stage, s.microbatch, s.backward): s.end for s in slots}
    for s in slots:
        if not s.backward and s.stage:
            assert s.start >= end[s.stage - 1, s.microbatch, False]
        if s.backward:
            assert s.start >= end[s.stage, s.microbatch, False]
    for rank in {s.rank for s in slots}:
        mine = sorted((s.start, s.end) for s in slots if s.rank == rank)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:]))


def chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless=new", "--disable-gpu", "--no-sandbox",
                           "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path}",
                           *args], capture_output=True, text=True, timeout=60)


def test_chromium_renders_the_page_without_errors(reports, tmp_path):
    if not os.path.exists(CHROMIUM) and not shutil.which("chromium"):
        pytest.skip("no headless browser: install Debian's chromium: apt-get install chromium")
    os.makedirs(ARTIFACTS, exist_ok=True)
    for name, (plan, path) in reports.items():
        done = chromium(tmp_path / "profile", "--dump-dom", path.as_uri())
        dom = done.stdout
        assert done.returncode == 0 and "</html>" in dom, done.stderr[-2000:]
        assert "Uncaught" not in done.stderr, done.stderr[-2000:]
        body = re.search(r"<body([^>]*)>", dom).group(1)
        assert 'data-errors="0"' in body and 'data-rendered="1"' in body, body
        assert shown(dom) == key_numbers(plan), name
        screenshot = os.path.join(ARTIFACTS, f"report_{name}.png")
        done = chromium(tmp_path / "profile", f"--screenshot={screenshot}",
                        "--window-size=1400,1000", path.as_uri())
        assert done.returncode == 0 and os.path.getsize(screenshot) > 10_000, done.stderr[-2000:]
        print(f"screenshot of the {name} report: {screenshot}")
