"""Gradient synchronization: all-reduce the gradients of parameters stored replicated (and
drive the reduce-scatter of ZeRO parameters', runtime/zero.py).

The local gradient of a replicated parameter is a pending sum over every mesh dimension where it
is replicated, so it is summed there. Gradients are flattened into buckets of at most
`bucket_bytes` (per mesh dimension and dtype, in reverse parameter order so that the first
buckets fill first during backward, as DistributedDataParallel does).

Parameters replicated on exactly one mesh dimension (with more than one rank) are overlapped
with the backward pass: a post-accumulate-grad hook counts each bucket's gradients and launches
its all-reduce asynchronously once they are all there. Every rank runs the same program, so
buckets become ready, and are launched, in the same order everywhere. `finish()` launches what
never became ready (parameters without a gradient count as zeros), waits, writes the sums
back, and then reduces gradients replicated on several mesh dimensions, one dimension after
another. A parameter that got no gradient keeps none, as on one device (every rank runs the
same program, so it got none on any rank), and optimizers skip it.

The loss, summed for reporting, rides in the last overlapped bucket of its first mesh
dimension (one collective fewer per step, as a collective's latency is what a step of a small
model on gloo pays most); without such a bucket it is all-reduced on its own, asynchronously.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.passes import torch_compat
from autopar.passes.reshard import BUCKET_BYTES, buckets

from .flat import flatten, unflatten, write_grads


class _Bucket:
    def __init__(self, mesh_dim: int, params: list[torch.nn.Parameter]):
        self.mesh_dim = mesh_dim
        self.params = params
        self.ready = 0
        self.work = None
        self.flat: torch.Tensor | None = None
        self.carry: PendingSum | None = None
        self.missing: set[int] = set()  # ids of the parameters without a gradient at launch


def param_buckets(params: list[torch.nn.Parameter],
                  bucket_bytes: float = BUCKET_BYTES) -> list[list[torch.nn.Parameter]]:
    """`params` grouped into buckets of at most `bucket_bytes`, per dtype, in order."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    return [b for ps in by_dtype.values()
            for b in buckets(ps, lambda p: p.numel() * p.element_size(), bucket_bytes)]


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient (zeros for a parameter without one)."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def sum_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum the gradients of `params` over `group` (missing gradients count as zeros), in
    buckets, all in flight together."""
    pending = []
    for ps in param_buckets(params):
        flat = flatten(_grads(ps))
        pending.append((torch_compat.all_reduce(flat, group=group, async_op=True), flat, ps,
                        _missing(ps)))
    for work, flat, ps, missing in pending:
        work.wait()
        _write_back(ps, flat, missing)


class GradSync:
    """Bucketed all-reduce of replicated parameters' gradients, overlapped with backward."""

    def __init__(self, params: list[tuple[torch.nn.Parameter, tuple[int, ...]]], groups: list,
                 mesh_shape: tuple[int, ...], bucket_bytes: int = BUCKET_BYTES, zero=None):
        """`params`: each replicated parameter's leaf and the mesh dimensions it is replicated
        on; `zero`: the runtime.zero.ZeroSync of the ZeRO parameters, driven alongside."""
        self.groups = groups
        self.zero = zero
        reduced = [(p, tuple(k for k in dims if mesh_shape[k] > 1)) for p, dims in params]
        self.overlapped: list[_Bucket] = []
        for k in range(len(mesh_shape)):
            # reverse parameter order: the last parameters' gradients are ready first
            single = [p for p, dims in reversed(reduced) if dims == (k,) and p.requires_grad]
            self.overlapped += [_Bucket(k, ps) for ps in param_buckets(single, bucket_bytes)]
        self.later: list[_Bucket] = []  # several mesh dimensions: after backward, in turn
        for k in range(len(mesh_shape)):
            multi = [p for p, dims in reversed(reduced)
                     if len(dims) > 1 and k in dims and p.requires_grad]
            self.later += [_Bucket(k, ps) for ps in param_buckets(multi, bucket_bytes)]
        self._launched: list[_Bucket] = []
        self._stash: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._holding = False
        self._hooks = []
        for b in self.overlapped:
            for p in b.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda p, b=b: self._on_grad(b)))

    def begin(self, report: PendingSum | None = None, hold: bool = False) -> None:
        """Call before each backward pass (before the first microbatch's, when a step
        accumulates several). Gradients already accumulated (steps without zero_grad) are set
        aside and added back after this pass's gradients are reduced, so that gradient
        accumulation over steps sums each step's reduced gradient once. A `report` (a sum not
        yet started) is carried by the last bucket of its first mesh dimension and dtype, or
        started at once if there is none. With `hold`, nothing is launched until `release`
        (the microbatches before the last accumulate locally)."""
        self._stash = {}
        for b in self.overlapped + self.later:
            for p in b.params:
                if p.grad is not None:
                    self._stash[p] = p.grad
                    p.grad = None
        self._holding = hold
        if self.zero is not None:
            self.zero.begin(hold)
        self._arm(report)

    def microbatch_done(self) -> None:
        """After each backward but the step's last (gradient accumulation)."""
        if self.zero is not None:
            self.zero.microbatch_done()

    def release(self, report: PendingSum | None = None) -> None:
        """Before the last microbatch's backward: launch each bucket once its gradients,
        accumulated over the microbatches, are complete (overlapped with that backward)."""
        self._holding = False
        if self.zero is not None:
            self.zero.release()
        self._arm(report)

    def _arm(self, report: PendingSum | None) -> None:
        for b in self.overlapped:
            b.ready, b.work, b.flat, b.carry = 0, None, None, None
        self._launched = []
        self._report, self._left = None, 0
        if report is not None and report.dims:
            k, dtype = report.dims[0], report.value.dtype
            self._left = sum(1 for b in self.overlapped
                             if b.mesh_dim == k and b.params[0].dtype == dtype)
            self._report = report if self._left else None
            if not self._left:
                report.start()

    def _on_grad(self, b: _Bucket) -> None:
        if self._holding:
            return
        b.ready += 1
        if b.ready == len(b.params) and b.work is None:
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        b.missing = _missing(b.params)
        grads = _grads(b.params)
        r = self._report
        if r is not None and b.mesh_dim == r.dims[0] and b.params[0].dtype == r.value.dtype:
            self._left -= 1
            if not self._left:  # the last such bucket of this step: the loss rides along
                grads.append(r.value)
                b.carry = r
        b.flat = flatten(grads)
        b.work = torch_compat.all_reduce(b.flat, group=self.groups[b.mesh_dim], async_op=True)
        self._launched.append(b)

    def finish(self) -> None:
        """Complete the synchronization after backward (collective: all ranks call it)."""
        for b in self.overlapped:  # buckets some of whose parameters got no gradient
            if b.work is None:
                self._launch(b)
        for b in self._launched:
            b.work.wait()
            _write_back(b.params, b.flat, b.missing)
            if b.carry is not None:
                b.carry.landed(b.flat[b.flat.numel() - b.carry.value.numel():])
        for k in sorted({b.mesh_dim for b in self.later}):
            batch = [b for b in self.later if b.mesh_dim == k]
            for b in batch:
                self._launch(b)
            for b in batch:
                b.work.wait()
                _write_back(b.params, b.flat, b.missing)
                b.work = None
        for p, g in self._stash.items():
            p.grad = g if p.grad is None else p.grad.add_(g)
        self._stash = {}
        if self.zero is not None:
            self.zero.finish()


def _missing(params: list[torch.nn.Parameter]) -> set[int]:
    """The ids of the parameters without a gradient."""
    return {id(p) for p in params if p.grad is None}


def _write_back(params: list[torch.nn.Parameter], flat: torch.Tensor, missing: set[int]) -> None:
    """Set each parameter's gradient to its slice of the reduced `flat` (a view: every step
    reduces into a new buffer); those `missing` a gradient (by id) keep none."""
    write_grads([None if id(p) in missing else p for p in params],
                unflatten(flat, [p.shape for p in params]))


class PendingSum:
    """A detached value (the reported loss) to be summed over some mesh dimensions: over the
    first by `start()` (asynchronously) or in a gradient bucket (`landed`), over the rest when
    `wait()` returns the sum."""

    def __init__(self, x: torch.Tensor, groups: list, dims: list[int]):
        self.value, self.groups, self.dims = x.detach().clone(), groups, list(dims)
        self.work = None
        self._rest = list(dims)  # dimensions still to sum

    def start(self) -> None:
        """Launch the sum over the first dimension asynchronously."""
        if self._rest:
            self.work = dist.all_reduce(self.value, group=self.groups[self._rest[0]],
                                        async_op=True)
            self._rest = self._rest[1:]

    def landed(self, summed: torch.Tensor) -> None:
        """The sum over the first dimension, computed elsewhere (a gradient bucket)."""
        self.value.copy_(summed.view_as(self.value))
        self._rest = self._rest[1:]

    def wait(self) -> torch.Tensor:
        """The sum (a collective: all ranks call it)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        for k in self._rest:
            dist.all_reduce(self.value, group=self.groups[k])
        self._rest = []
        return self.value
