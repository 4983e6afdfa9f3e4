"""autopar in one screen: plan a GPT for a 2x2 CPU mesh, train it on 4 gloo ranks, and check
that it trains exactly like the single-device model.

    python examples/quickstart.py
"""

import copy
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.zoo import GPT, GPTConfig, lm_loss

STEPS = 5
MESH = (2, 2)


def batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (8, 32), generator=g)
    return x, torch.roll(x, -1, dims=1)  # predict the next token


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64))
    single = copy.deepcopy(model)  # the single-device reference
    x, y = batch()

    pmodel = autopar.parallelize(model, mesh, loss_fn=lm_loss, example_inputs=(x, y))
    if rank == 0:
        print(pmodel.plan, flush=True)

    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(single.parameters(), lr=1e-3)
    for step in range(STEPS):
        opt.zero_grad()
        loss = pmodel.step(x, y)
        opt.step()
        ref_opt.zero_grad()
        ref_loss = lm_loss(single(x), y)
        ref_loss.backward()
        ref_opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f}  single-device {ref_loss.item():.6f}",
                  flush=True)

    full = pmodel.full_parameters()
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in single.named_parameters())
    out_diff = (pmodel(x) - single(x)).abs().max().item()
    if rank == 0:
        print(f"largest parameter difference from single-device training after {STEPS} steps: "
              f"{diff:.2e}; largest output difference: {out_diff:.2e}")
    dist.destroy_process_group()


def main() -> None:
    world = MESH[0] * MESH[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(world, port), nprocs=world)


if __name__ == "__main__":
    main()
