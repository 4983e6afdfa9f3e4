"""The sharding-rule registry, one module per op family; importing this package registers all."""

from . import attention, embedding_loss, matmul, norms, pointwise, reductions, views  # noqa: F401
from .registry import LOWERINGS, RULES, LocalContext, OpCall, Rule1D, TensorArg, replicate_all

__all__ = ["LOWERINGS", "RULES", "LocalContext", "OpCall", "Rule1D", "TensorArg", "replicate_all"]
