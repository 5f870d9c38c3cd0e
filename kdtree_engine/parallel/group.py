"""Joining a process group: one process per device, gloo on the CPU and NCCL on CUDA, with a collective
timeout so that a rank whose peer died fails instead of waiting for ever."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm import DistCommunicator, backend_for

DEFAULT_TIMEOUT_S = 300.0  # a collective that waits longer than this fails (a peer died or hangs)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: MASTER_ADDR / MASTER_PORT, the world size and the collective timeout."""

    addr: str
    port: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port free now on ``addr`` (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of a rank: cuda:LOCAL_RANK on CUDA, the CPU otherwise."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else torch.device("cpu")


def join(rdv: Rendezvous, rank: int, device: torch.device) -> DistCommunicator:
    """Initialise this process's default process group as ``rank`` and return its communicator."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=f"tcp://{rdv.addr}:{rdv.port}", rank=rank,
                            world_size=rdv.world_size, timeout=timedelta(seconds=rdv.timeout_s))
    return DistCommunicator()


def leave() -> None:
    """Destroy this process's process group, if any."""
    if dist.is_initialized():
        dist.destroy_process_group()


def torchrun_env(environ: "os._Environ[str] | dict[str, str] | None" = None) -> tuple[Rendezvous, int, int] | None:
    """(rendezvous, rank, local rank) from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT), or None when this process was not started by torchrun (no WORLD_SIZE)."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return None
    rdv = Rendezvous(env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")),
                     int(env["WORLD_SIZE"]))
    return rdv, int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", env.get("RANK", "0")))
