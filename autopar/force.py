"""The `force` option read against a mesh: the style it asks of each mesh dimension.

`PlanOptions.force` names one style for every dimension, or a style per dimension keyed by
name or index; `styles_by_dim` checks it against the mesh (before any planning work) and
`stage_styles` against a pipelined mesh, whose stages are planned on the dimensions but "pp".
passes/styles.py turns the styles into the strategies each node may take.
"""

from __future__ import annotations

from .mesh import MeshSpec
from .plan import stage_dims


def styles_by_dim(mesh: MeshSpec, force) -> dict[int, str]:
    """`force` as {mesh dimension index: style}; accepts one style for every dimension, or a
    dict keyed by dimension names or indices (0 to ndim - 1). Raises ValueError for a dimension
    the mesh lacks or one named twice."""
    if force is None:
        return {}
    if isinstance(force, str):
        return {k: force for k in range(mesh.ndim)}
    if not isinstance(force, dict):
        raise ValueError(f"force must be a style name or a dict from mesh dimension to style, "
                         f"not a {type(force).__name__}; the mesh has {_dims(mesh)}")
    out: dict[int, str] = {}
    given: dict[int, object] = {}
    for key, style in force.items():
        k = _dim_index(mesh, key)
        if k in out:
            raise ValueError(f"force names mesh dimension {k} ({mesh.names[k]!r}) twice, as "
                             f"{given[k]!r} and as {key!r}; give each dimension one style")
        out[k], given[k] = style, key
    return out


def stage_styles(mesh: MeshSpec, pp: int, force) -> dict[int, str]:
    """`force` on a pipelined mesh, keyed as for the whole mesh, as styles of the stage mesh
    (the mesh without "pp", whose dimensions keep their order)."""
    styles, dims = styles_by_dim(mesh, force), stage_dims(mesh.ndim, pp)
    if pp in styles and not isinstance(force, str):
        others = ", ".join(repr(mesh.names[k]) for k in dims)
        raise ValueError(f"force gives the pipeline dimension {pp} ('pp') the style "
                         f"{styles[pp]!r}; 'pp' carries pipeline stages, so force only the "
                         f"other dimensions ({others})")
    return {dims.index(k): style for k, style in styles.items() if k != pp}


def _dim_index(mesh: MeshSpec, key) -> int:
    if isinstance(key, str) and key in mesh.names:
        return mesh.names.index(key)
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < mesh.ndim:
        return key
    what = "names mesh dimension" if isinstance(key, str) else "has mesh dimension index"
    raise ValueError(f"force {what} {key!r}, which the mesh does not have; the mesh has "
                     f"{_dims(mesh)}: key force by one of those names or indices")


def _dims(mesh: MeshSpec) -> str:
    """"dimensions 0 ('dp', size 2) and 1 ('tp', size 4)"."""
    dims = [f"{k} ({n!r}, size {s})" for k, (n, s) in enumerate(zip(mesh.names, mesh.shape))]
    if len(dims) == 1:
        return f"dimension {dims[0]}"
    return f"dimensions {', '.join(dims[:-1])} and {dims[-1]}"
