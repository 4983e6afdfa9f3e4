"""Train a Llama with autopar under torchrun: the same script on GPUs (NCCL) and CPUs (gloo).

    torchrun --nproc-per-node 4 examples/train_llama.py                      # 1-D mesh ("dp",)
    torchrun --nproc-per-node 4 examples/train_llama.py --mesh 2x2 --names dp,tp \\
        --steps 100 --checkpoint-dir ckpt --checkpoint-every 20             # --resume goes on

The model is built on the meta device and initialized shard by shard by `autopar.parallelize`,
which plans it for the mesh (the plan is printed at start). Every rank reads its own slice of
the batch (a DistributedSampler over the "dp" mesh dimension), trains in bf16 mixed precision
where the GPU has bfloat16 (fp32 otherwise) with AdamW, logs the loss, tokens/s and the plan's
predicted step time (forward, backward and gradient synchronization, priced with --hardware)
against the measured one (which also holds the optimizer step and data loading), and saves a
sharded checkpoint after every --checkpoint-every-th step (torch.distributed.checkpoint, through
autopar.checkpoint) that --resume continues from.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import autopar
from autopar.zoo import hf_llama, lm_loss


def main() -> None:
    """Parse the flags, then plan, initialize, train and checkpoint on every rank."""
    args = parse_args()
    device, mesh = init_distributed(args.mesh, args.names)
    rank0 = dist.get_rank() == 0
    precision = choose_precision(args.precision, device)

    with torch.device("meta"):  # no rank ever holds the whole model
        model = hf_llama(num_hidden_layers=args.layers, hidden_size=args.hidden,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         intermediate_size=2 * args.hidden, vocab_size=args.vocab,
                         max_position_embeddings=args.seq)
    loader, sampler = build_loader(args, mesh)
    first = [t.to(device) for t in next(iter(loader))]  # the shapes to plan for

    torch.manual_seed(args.seed)  # every rank alike: random ops must agree across ranks
    pmodel = autopar.parallelize(model, mesh, loss_fn=lm_loss, example_inputs=first,
                                 per_rank_inputs=data_dims(mesh), precision=precision,
                                 hardware=hardware_profile(args.hardware),
                                 init_fn=model.model._init_weights)  # Hugging Face's init
    if rank0:
        print(pmodel.plan, flush=True)
    # foreach: the parameters are DTensors, which torch's default steps one by one
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=args.lr, weight_decay=0.1,
                                  foreach=True)

    start = 0
    latest = latest_checkpoint(args.checkpoint_dir) if args.resume else None
    if latest is not None:
        start = autopar.checkpoint.load(latest, pmodel, optimizer)["step"]
        log(rank0, f"resumed from step {start} ({latest})")

    tokens_per_step = args.batch * args.seq
    predicted = pmodel.plan.cost.step_time
    t0, since = time.perf_counter(), start
    data = batches(loader, sampler, start)
    for step in range(start + 1, args.steps + 1):
        x, y = (t.to(device) for t in next(data))
        optimizer.zero_grad()
        loss = pmodel.step(x, y)
        torch.nn.utils.clip_grad_norm_(pmodel.parameters(), args.max_norm)
        optimizer.step()

        if step % args.log_every == 0 or step == args.steps:
            loss_value = loss.item()  # waits for the device
            measured = (time.perf_counter() - t0) / (step - since)
            log(rank0, f"step {step:5d}  loss {loss_value:.6f}  "
                       f"{tokens_per_step / measured:,.0f} tokens/s  "
                       f"step time {1e3 * measured:.1f} ms (predicted {1e3 * predicted:.1f} ms)")
            t0, since = time.perf_counter(), step
        if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
            path = os.path.join(args.checkpoint_dir, f"step-{step}")
            autopar.checkpoint.save(path, pmodel, optimizer, extra={"step": step})
            log(rank0, f"saved {path}")
            t0 = time.perf_counter()  # saving is not training time
    dist.destroy_process_group()


def parse_args() -> argparse.Namespace:
    """The training flags; the defaults train a tiny Llama on CPUs in seconds."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per step, all ranks together")
    p.add_argument("--steps", type=int, default=20, help="train up to this step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default=None, help="mesh shape, e.g. 2x2 (default: the world, 1-D)")
    p.add_argument("--names", default="dp", help="mesh dimension names, e.g. dp,tp")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16-mixed"])
    p.add_argument("--hardware", default=None,
                   help="what the plan is priced for: a built-in profile (h100, cpu; default: "
                   "h100 on GPUs, cpu on CPUs) or a JSON file `autopar calibrate` wrote")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps; 0: never")
    p.add_argument("--resume", action="store_true", help="from the latest checkpoint, if any")
    return p.parse_args()


def init_distributed(shape: str | None, names: str) -> tuple[torch.device, DeviceMesh]:
    """NCCL and this process's GPU (LOCAL_RANK) when there are GPUs, gloo on CPUs; the mesh
    `shape` ("2x2") with `names` ("dp,tp"), or the whole world as one dimension."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    sizes = tuple(int(s) for s in shape.split("x")) if shape else (world,)
    dim_names = tuple(names.split(","))
    if math.prod(sizes) != world or len(dim_names) != len(sizes):
        raise SystemExit(f"--mesh {shape} --names {names}: need one name per dimension and "
                         f"as many devices as the {world} ranks torchrun started")
    return device, init_device_mesh(device.type, sizes, mesh_dim_names=dim_names)


def choose_precision(flag: str, device: torch.device) -> str:
    """bf16 mixed precision where the device computes in bfloat16 (CUDA), fp32 otherwise."""
    if flag != "auto":
        return flag
    has_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return "bf16-mixed" if has_bf16 else "fp32"


def hardware_profile(name: str | None) -> str | autopar.HardwareProfile | None:
    """A built-in profile's name as given, or the profile a JSON file holds."""
    if name and name.endswith(".json"):
        return autopar.HardwareProfile.load(name)
    return name


def data_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    """The mesh dimensions over which ranks read different data: "dp", when the mesh has it."""
    return ("dp",) if "dp" in (mesh.mesh_dim_names or ()) else ()


class SyntheticTokens(Dataset):
    """Deterministic token sequences to learn: item i is an arithmetic progression modulo the
    vocabulary (start and stride drawn from seed + i), as (input ids, next-token targets)."""

    def __init__(self, size: int, seq: int, vocab: int, seed: int = 0):
        self.size, self.seq, self.vocab, self.seed = size, seq, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed + i)
        start = int(torch.randint(self.vocab, (), generator=g))
        stride = int(torch.randint(1, 8, (), generator=g))
        tokens = (start + stride * torch.arange(self.seq + 1)) % self.vocab
        return tokens[:-1], tokens[1:]


def build_loader(args: argparse.Namespace, mesh: DeviceMesh
                 ) -> tuple[DataLoader, DistributedSampler]:
    """This rank's loader: a DistributedSampler over the ranks of the "dp" mesh dimension
    (ranks that differ only on other dimensions read the same slice), batch / dp sequences."""
    dims = data_dims(mesh)
    dp, dp_rank = (mesh[dims[0]].size(), mesh.get_local_rank(dims[0])) if dims else (1, 0)
    if args.batch % dp:
        raise SystemExit(f"--batch {args.batch} does not divide among {dp} data-parallel ranks")
    dataset = SyntheticTokens(64 * args.batch, args.seq, args.vocab, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    return DataLoader(dataset, batch_size=args.batch // dp, sampler=sampler,
                      drop_last=True), sampler


def batches(loader: DataLoader, sampler: DistributedSampler, start: int):
    """The batches of steps start+1, start+2, ...: epoch after epoch, reshuffled by the
    sampler's epoch. Resuming skips the `start` batches already trained on (a synthetic
    dataset makes skipping cheap; a large one would keep its loader's position instead)."""
    epoch, skip = divmod(start, len(loader))
    while True:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i >= skip:
                yield batch
        epoch, skip = epoch + 1, 0


def latest_checkpoint(folder: str | None) -> str | None:
    """The folder `step-N` under `folder` with the largest N (None when there is none)."""
    if not folder or not os.path.isdir(folder):
        return None
    steps = [int(m.group(1)) for name in os.listdir(folder)
             if (m := re.fullmatch(r"step-(\d+)", name))]
    return os.path.join(folder, f"step-{max(steps)}") if steps else None


def log(rank0: bool, line: str) -> None:
    """Print on rank 0 only."""
    if rank0:
        print(line, flush=True)


if __name__ == "__main__":
    main()
