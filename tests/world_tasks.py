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

