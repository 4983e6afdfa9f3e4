"""autopar: compiler-style auto-parallelization of PyTorch models.

    spec = autopar.MeshSpec((8, 8), names=("dp", "tp"), hardware="h100")
    plan = autopar.plan(model, spec, example_inputs, loss_fn=loss_fn)
    pmodel = autopar.parallelize(model, device_mesh, loss_fn=loss_fn)
    profile = autopar.calibrate(device_mesh)        # a HardwareProfile of the real machine
"""

from autopar.passes.trace import TraceError
from autopar.runtime.control import RankError
from autopar.solver.ilp import NoFeasiblePlan

from . import checkpoint, profile
from .api import PlanMismatchError, parallelize, plan
from .calibrate import calibrate
from .hardware import A100, CPU, H100, H200, PROFILES, HardwareProfile, Link, get_profile
from .mesh import MeshSpec
from .options import PlanOptions
from .parallelized import Parallelized
from .plan import Collective, OpEntry, Plan, PlanCost
from .search import Cluster

__all__ = [
    "A100", "CPU", "H100", "H200", "PROFILES", "Cluster", "Collective", "HardwareProfile", "Link",
    "MeshSpec", "NoFeasiblePlan", "OpEntry", "Parallelized", "Plan", "PlanCost",
    "PlanMismatchError", "PlanOptions", "RankError", "TraceError", "calibrate", "checkpoint",
    "get_profile", "parallelize", "plan", "profile",
]
