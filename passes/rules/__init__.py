"""The sharding-rule registry, one module per op family; importing this package registers all
rules and op facts."""

from . import (  # noqa: F401
    attention,
    convolution,
    embedding_loss,
    indexing,
    matmul,
    norms,
    pointwise,
    random,
    recurrent,
    reductions,
    views,
)
from .registry import (
    FACTS,
    LOWERINGS,
    RULES,
    LocalContext,
    OpCall,
    OpFacts,
    Rule1D,
    TensorArg,
    facts_of,
    replicate_all,
)

__all__ = ["FACTS", "LOWERINGS", "RULES", "LocalContext", "OpCall", "OpFacts", "Rule1D",
           "TensorArg", "facts_of", "replicate_all"]
