#!/usr/bin/env python3
"""A plain PyTorch DDP program written for torchrun, run by launcher_test under `loom run`.

It uses only torchrun's environment: init_process_group("gloo") with the default env://
rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; rank 0 hosts the TCPStore). It trains a
tiny linear model a few steps with DistributedDataParallel, all-reduces a known vector, trains
the same steps without DDP on the whole batch as a reference, and writes what it saw to
OUT/gen<g>_rank<r>.json (g = LOOM_GENERATION, or TORCHELASTIC_RESTART_COUNT under torchrun).
"""
import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

TORCHRUN_ENV = [
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS",
]
ROWS_PER_RANK = 2


def batch(step, world):
    """The global batch of a step: every rank draws the same and takes its rows."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * ROWS_PER_RANK, 4, generator=g)
    y = torch.randn(world * ROWS_PER_RANK, 3, generator=g)
    return x, y


def train(model, steps, world, rank, step_seconds, fail_now):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = batch(step, world)
        if rank >= 0:  # one rank's rows; DDP averages the gradients over the ranks
            x = x[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
            y = y[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if fail_now and step == 0:
            print(f"rank {rank}: failing on purpose after step 0", flush=True)
            sys.exit(1)
        time.sleep(step_seconds)
    return losses


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--fail-rank", type=int, default=-1,
                        help="this rank exits 1 after its first step in the first attempt")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = os.environ.get("LOOM_GENERATION", os.environ["TORCHELASTIC_RESTART_COUNT"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"started_gen{attempt}_rank{rank}"), "w"):
        pass

    values = torch.arange(5, dtype=torch.float32) + 10 * rank
    dist.all_reduce(values)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ddp = DistributedDataParallel(model)
    fail_now = rank == args.fail_rank and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    losses = train(ddp, args.steps, world, rank, args.step_seconds, fail_now)

    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 3)
    train(reference, args.steps, world, -1, 0.0, False)
    diff = (flat(model) - flat(reference)).abs().max().item()

    record = {
        "rank": rank,
        "world": world,
        "allreduce": values.tolist(),
        "params_hex": flat(model).numpy().tobytes().hex(),
        "reference_max_abs_diff": diff,
        "losses": losses,
        "env": {k: os.environ.get(k) for k in TORCHRUN_ENV},
    }
    path = os.path.join(args.out, f"gen{attempt}_rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.rename(path + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
