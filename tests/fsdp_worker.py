"""One rank of a short training run of a tensorized model under FSDP2 or DDP (gloo, CPU), saved
and reloaded with ``torch.distributed.checkpoint``.

    python -m tests.fsdp_worker DIR RANK WORLD fsdp|ddp   # rank 0 writes DIR/losses.json

Each rank trains on its share of a fixed global batch; gradients are averaged across ranks,
so the global loss equals a single process's on the whole batch (``single_process_losses``,
which the test compares against). After the steps the model is saved with DCP, loaded into a
fresh wrapped model, and that model's loss on the batch is written as well.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

import tnspec

HANG_S = 120
STEPS = 3
GLOBAL_BATCH = 8


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    net, _ = tnspec.tensorize(torch.nn.Sequential(
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(8 * 16, 4)), "tr", rank=3)
    return net


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(GLOBAL_BATCH, 8, 4, 4, generator=gen),
            torch.randn(GLOBAL_BATCH, 4, generator=gen))


def loss_of(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (net(x) - y).square().mean()


def single_process_losses() -> list[float]:
    """The reference: the same model, the whole batch, the same optimizer, one process."""
    net, (x, y) = model(), batch()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_of(net, x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    losses.append(float(loss_of(net, x, y)))  # after the last step
    return losses


def say(rank: int, what: str) -> None:
    print(f"[rank {rank}] {what}", file=sys.stderr, flush=True)


def wrap(net: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(net)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in net:
        if isinstance(layer, tnspec.Layer):
            fully_shard(layer, mesh=mesh)  # each tnspec layer its own unit, as one would
    return fully_shard(net, mesh=mesh)


def main(folder: str, rank: int, world: int, how: str) -> None:
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    store = dist.FileStore(os.path.join(folder, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    say(rank, f"wrapping in {how}")
    net = wrap(model(), how)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = batch()
    share = GLOBAL_BATCH // world
    mine = slice(rank * share, (rank + 1) * share)
    losses = []

    def global_loss() -> float:
        with torch.no_grad():
            loss = loss_of(net, x[mine], y[mine])
        dist.all_reduce(loss)
        return float(loss) / world
    for step in range(STEPS):
        say(rank, f"step {step}")
        opt.zero_grad()
        loss = loss_of(net, x[mine], y[mine])
        loss.backward()
        opt.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        losses.append(float(reported) / world)
    losses.append(global_loss())

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    say(rank, "saving with torch.distributed.checkpoint")
    dcp.save({"model": get_model_state_dict(net)}, checkpoint_id=os.path.join(folder, "ckpt"))
    fresh = wrap(model(), how)
    with torch.no_grad():  # make sure the load, not the init, gives the weights
        for p in fresh.parameters():
            p.zero_()
    state = {"model": get_model_state_dict(fresh)}
    dcp.load(state, checkpoint_id=os.path.join(folder, "ckpt"))
    set_model_state_dict(fresh, state["model"])
    net = fresh
    reloaded = global_loss()
    if rank == 0:
        with open(os.path.join(folder, "losses.json"), "w") as f:
            json.dump({"losses": losses, "reloaded": reloaded}, f)
    del net, fresh, opt
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    # Everything is written and the group destroyed: leave without the interpreter's teardown,
    # where a C++ thread of the process group is now and then destroyed while joinable
    # ("terminate called without an active exception", exit -6, after "done")
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
