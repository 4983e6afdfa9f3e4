"""Module-level task functions for tests/test_world.py (World.run sends them by name)."""

import os
import time

import torch
import torch.distributed as dist


def rank_and_size():
    return dist.get_rank(), dist.get_world_size()


def all_reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def scaled_tensor(x, scale=1.0):
    return x * (dist.get_rank() + 1) * scale


def fail_on_rank(bad_rank, message):
    if dist.get_rank() == bad_rank:
        raise ValueError(message)
    return dist.get_rank()


def fail_before_collective(bad_rank, message):
    if dist.get_rank() == bad_rank:
        raise ValueError(message)
    t = torch.ones(1)
    dist.all_reduce(t)  # blocks forever: bad_rank never joins
    return t.item()


def skip_collective(skipping_rank):
    if dist.get_rank() != skipping_rank:
        t = torch.ones(1)
        dist.all_reduce(t)  # blocks forever: skipping_rank never joins
    return dist.get_rank()


def die_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        os._exit(3)
    time.sleep(0.1)
    return dist.get_rank()


def pid():
    return os.getpid()



def torch_compat_collectives():
    """Each collective autopar calls through autopar.passes.torch_compat, on this rank's small
    tensors; and a message left in the default store by rank 0, read by every rank."""
    from autopar.passes import torch_compat

    rank, n = dist.get_rank(), dist.get_world_size()
    part = torch.tensor([float(rank), 10.0 + rank])
    gathered = torch.empty(2 * n)
    torch_compat.all_gather_single(gathered, part)
    full = torch.arange(2.0 * n) + rank
    scattered = torch.empty(2)
    torch_compat.reduce_scatter_single(scattered, full)
    swapped = torch.empty(2 * n)
    torch_compat.all_to_all_single(swapped, torch.arange(2.0 * n) + 100 * rank)
    summed = torch.tensor([float(rank)])
    torch_compat.all_reduce(summed)
    store = torch_compat.default_store()
    if rank == 0:
        store.set("torch_compat_test", b"left by rank 0")
    dist.barrier()
    return {"all_gather_single": gathered.tolist(), "reduce_scatter_single": scattered.tolist(),
            "all_to_all_single": swapped.tolist(), "all_reduce": summed.tolist(),
            "store": bytes(store.get("torch_compat_test"))}
