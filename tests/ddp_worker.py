"""One DistributedDataParallel training step of a tensorized model, 2 CPU processes (gloo).

    python -m tests.ddp_worker OUT    # writes OUT.init, OUT.0, OUT.1 (state dicts)
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tnspec


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same init on both ranks (DDP also broadcasts rank 0's)
    net, _ = tnspec.tensorize(torch.nn.Sequential(
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(8 * 16, 4)), "tr", rank=3)
    return net


def step(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    net = model()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)  # each rank its own batch
    ddp(torch.randn(4, 8, 4, 4)).square().mean().backward()
    opt.step()
    torch.save({k: v.detach() for k, v in net.state_dict().items()}, f"{out}.{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.save(model().state_dict(), f"{sys.argv[1]}.init")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(step, args=(2, port, sys.argv[1]), nprocs=2, join=True)
