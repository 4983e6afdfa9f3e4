"""autopar: compiler-style auto-parallelization of PyTorch models.

    spec = autopar.MeshSpec((8, 8), names=("dp", "tp"), hardware="h100")
    plan = autopar.plan(model, spec, example_inputs, loss_fn=loss_fn)
    pmodel = autopar.parallelize(model, device_mesh, loss_fn=loss_fn)
    profile = autopar.calibrate(device_mesh)        # a HardwareProfile of the real machine
"""

# The public names are imported on first use (PEP 562), not here: importing them pulls in
# torch.export, torch._dynamo, DTensor and sympy, seconds that `autopar --help` and a
# `from autopar.table import ms` need not pay.

import importlib
import sys
import types

__all__ = [
    "A100", "CPU", "H100", "H200", "PROFILES", "Cluster", "Collective", "HardwareProfile", "Link",
    "MeshSpec", "NoFeasiblePlan", "OpEntry", "Parallelized", "Plan", "PlanCost",
    "PlanMismatchError", "PlanOptions", "RankError", "TraceError", "calibrate", "checkpoint",
    "get_profile", "parallelize", "plan", "profile",
]

# module -> the public names it defines; `checkpoint` and `profile` are submodules themselves
_EXPORTS = {
    "autopar.passes.trace": ("TraceError",),
    "autopar.runtime.control": ("RankError",),
    "autopar.solver.ilp": ("NoFeasiblePlan",),
    "autopar.api": ("PlanMismatchError", "parallelize", "plan"),
    "autopar.calibrate": ("calibrate",),
    "autopar.hardware": ("A100", "CPU", "H100", "H200", "PROFILES", "HardwareProfile", "Link",
                         "get_profile"),
    "autopar.mesh": ("MeshSpec",),
    "autopar.options": ("PlanOptions",),
    "autopar.parallelized": ("Parallelized",),
    "autopar.plan": ("Collective", "OpEntry", "Plan", "PlanCost"),
    "autopar.search": ("Cluster",),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    """A public name, imported on first use and kept in the module's globals; any other
    submodule (`autopar.zoo`) likewise, as the eager imports used to leave them reachable."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package's module type. Importing a submodule binds it as its parent's attribute of
    the same name, and two submodules share a name with a public function (`autopar.plan`,
    `autopar.calibrate`): the function keeps the name, the module stays in sys.modules (the
    eager imports left it so, by their order)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _HOME and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
