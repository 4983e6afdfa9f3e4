"""`import autopar` is cheap: the package imports its public names on first use (PEP 562), so
`autopar --help` pays for no torch.export, Dynamo, DTensor or sympy; the names still are the
objects their modules define."""

import importlib
import subprocess
import sys

import autopar

HEAVY = ("torch._dynamo", "torch.export", "torch.distributed.tensor", "sympy")


def _loaded_after(code: str) -> set[str]:
    """The heavy modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=True)
    return set(done.stdout.split())


def test_importing_the_package_or_its_command_line_loads_nothing_heavy():
    assert _loaded_after("import autopar") == set()
    assert _loaded_after("import autopar.cli; autopar.cli.parser()") == set()


def test_every_public_name_is_its_modules_object():
    for name in autopar.__all__:
        assert getattr(autopar, name) is not None, name
    assert set(autopar.__all__) <= set(dir(autopar))
    from autopar import NoFeasiblePlan, Plan, RankError, TraceError, parallelize
    from autopar.passes.trace import TraceError as traced
    assert TraceError is traced and RankError is autopar.RankError
    assert NoFeasiblePlan is importlib.import_module("autopar.solver.ilp").NoFeasiblePlan
    assert Plan is importlib.import_module("autopar.plan").Plan
    assert parallelize is importlib.import_module("autopar.api").parallelize
    assert callable(autopar.checkpoint.save) and callable(autopar.profile.OpProfiler)


def test_the_functions_keep_the_names_their_modules_share():
    """autopar.plan and autopar.calibrate are functions, though modules of the same names exist
    and importing a module binds it to its package's attribute of that name (first, in a fresh
    interpreter)."""
    code = ("import autopar.plan, autopar.calibrate\n"
            "print(autopar.plan.__module__, autopar.calibrate.__module__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.split() == ["autopar.api", "autopar.calibrate"]
    assert callable(autopar.plan) and callable(autopar.calibrate)


def test_other_submodules_and_unknown_names():
    from autopar import zoo

    assert autopar.zoo is zoo
    try:
        autopar.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("autopar.no_such_name did not raise AttributeError")
