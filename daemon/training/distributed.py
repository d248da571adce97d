"""The process group of a drafter training run launched by `torchrun`, and the few collectives the trainer needs.

`torchrun --nproc-per-node N -m specloop.daemon.cli train-drafter ...` starts N copies of the command with
`WORLD_SIZE`, `RANK` and `LOCAL_RANK` set; `process_group` joins them (gloo on the CPU, NCCL on
CUDA, one GPU per process: `cuda:LOCAL_RANK`). Without those variables it does nothing, and every
function here answers as for one process and returns its input untouched: a run in one process is
the run it was before this file existed, bit for bit.

Rank 0 is the main process: it alone evaluates, decides when to stop, keeps the wall clock the LR
schedule follows, and writes checkpoints and the artifact; the others take its word.

Not here: which rows of a batch a process trains on (`data_order.py`), where gradients are averaged
(`optimizer_step.py`), what is agreed at each step (`trainer.py`).
"""

import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from specloop.engine.loaders.load import resolve_device

_LAUNCH = ("WORLD_SIZE", "RANK", "LOCAL_RANK")  # set by torchrun for each process it starts


def launched() -> bool:
    """Whether torchrun started this process."""
    return all(name in os.environ for name in _LAUNCH)


@contextmanager
def process_group(device: str | None) -> Iterator[str | None]:
    """Join torchrun's process group for the duration, on `device`'s kind; yields the device this process
    trains on (`cuda:LOCAL_RANK` on CUDA). Not launched by torchrun: yields `device` and does nothing."""
    if not launched():
        yield device
        return
    cuda = resolve_device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # NCCL and the object collectives use it
    dist.init_process_group("nccl" if cuda else "gloo")  # env:// rendezvous: torchrun set MASTER_ADDR/PORT
    try:
        yield f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu"
        # Every rank past its last collective before any closes its connections: a rank that tears
        # down while another still reads the final broadcast makes gloo abort that one (seen once as
        # exit -6 of rank 1 in four 2-process runs here).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def end_launched_process() -> None:
    """End a process torchrun started, its work done and its output flushed, without the interpreter's
    teardown: gloo's threads can still be joinable when C++ static destructors run, and then
    `std::terminate` aborts the rank ("terminate called without an active exception", exit -6) after
    the artifact was written, failing the run. Seen in 1 of 4 two-process runs under load, with the
    barrier above already in place. Not launched by torchrun: returns."""
    if not launched():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def from_main(value: Any) -> Any:
    """Rank 0's `value` (picklable) on every rank; `value` itself in one process."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sum_over_ranks(*values: float) -> tuple[float, ...]:
    """Each of `values` summed over the ranks; `values` themselves in one process."""
    if not dist.is_initialized():
        return values
    total = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(total)
    return tuple(total.tolist())


def average_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Replace each trainable parameter's gradient with its mean over the ranks; nothing in one process."""
    if not dist.is_initialized():
        return
    grads = [p.grad for p in params if p.requires_grad]
    assert all(g is not None for g in grads), "every rank must have a gradient for every trainable parameter"
    flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce instead of one per tensor
    dist.all_reduce(flat)
    flat /= dist.get_world_size()  # gloo has no AVG reduction
    for g, mean in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(mean.view_as(g))


def _collective_device() -> torch.device:
    """Where the backend's tensors live: the CPU for gloo, this process's GPU for NCCL."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
