"""One rank of a DistributedDataParallel training step of a tensorized model (gloo, CPU).

    python -m tests.ddp_worker DIR RANK WORLD    # writes DIR/init.pt (rank 0) and DIR/RANK.pt

The ranks meet through a file store in DIR and talk over the loopback interface, so nothing
is looked up by hostname: where the DNS server drops packets, one lookup took 12 s here.
Each step is printed to stderr and a rank that hangs dumps its stack and exits, so a failure
says where it stopped.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import sys

import torch
import torch.distributed as dist

import tnspec

HANG_S = 120  # the test waits longer than this, so a hang always ends with a stack dump


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same init on both ranks (DDP also broadcasts rank 0's)
    net, _ = tnspec.tensorize(torch.nn.Sequential(
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(8 * 16, 4)), "tr", rank=3)
    return net


def say(rank: int, what: str) -> None:
    print(f"[rank {rank}] {what}", file=sys.stderr, flush=True)


def main(folder: str, rank: int, world: int) -> None:
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    net = model()
    if rank == 0:
        torch.save(net.state_dict(), os.path.join(folder, "init.pt"))
    say(rank, "joining the process group")
    store = dist.FileStore(os.path.join(folder, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    say(rank, "wrapping in DistributedDataParallel")
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)  # each rank its own batch
    say(rank, "one training step")
    ddp(torch.randn(4, 8, 4, 4)).square().mean().backward()
    opt.step()
    torch.save({k: v.detach() for k, v in net.state_dict().items()},
               os.path.join(folder, f"{rank}.pt"))
    # Tear down in order: the wrapper (its reducer holds the group) before the group, and
    # no rank before the other is done; otherwise a rank can hang at exit now and then.
    del ddp, opt
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    # Everything is written and the group destroyed: leave without the interpreter's teardown,
    # where a C++ thread of the process group is now and then destroyed while joinable
    # ("terminate called without an active exception", exit -6, after "done")
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
