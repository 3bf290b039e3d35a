"""Tensor parallel across processes: the torch.distributed group of one engine's worker ranks.

    scheduler ──ForwardBatch──▶ rank 0 (the worker) ──step bytes──▶ ranks 1..N-1 (tp_worker)
    scheduler ◀──BatchResult─── rank 0      all ranks: the same forward, collectives inside it

Rank 0 is the worker the scheduler talks to. It resolves the batch's placeholder input ids,
checks the step, and broadcasts it (msgpack bytes: a length, then the bytes) to the other ranks;
every rank then runs the same forward over its share of the model; logits are gathered to rank
0, which alone samples and answers.

Two groups over the same rendezvous (``tcp://--dist-init-addr``, one TCP port):

- the device group (NCCL on CUDA, gloo on CPU) for the forward's all-reduces and the logits
  gather, with a collective timeout: ranks enter them within moments of each other;
- a gloo control group for the step broadcast, whose timeout is effectively infinite: ranks
  1..N-1 wait in it, blocked without spinning, for as long as the server is idle.

Why torch.distributed for the steps and not a ZMQ PUB socket: the group already connects every
rank, on every node, through the one address users give; a second transport would need its own
addresses across nodes and PUB/SUB's join handshake, and would order nothing the broadcast
does not already order.

A dying rank: its process exits, the launcher ends the whole group (every pending request
fails at once); peers blocked in a collective get an error from gloo or NCCL when the
connection drops, and are killed by the launcher anyway. A rank whose forward fails midway
cannot know that the others are still in step, so it ends the group too (``GroupBroken``).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from engine.contracts.engine_config import EngineConfig

logger = logging.getLogger("radixserve.distributed")

COLLECTIVE_TIMEOUT = timedelta(minutes=5)
IDLE_TIMEOUT = timedelta(days=3650)


class GroupBroken(RuntimeError):
    """A failure after the ranks started a step together: they may be out of step now."""


class TensorParallel:
    """This process's place in the group, and the collectives the runner and model use."""

    def __init__(self, rank: int, size: int, device: torch.device,
                 control: dist.ProcessGroup | None = None) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.control = control

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Rank 0 gets the ranks' [rows, V'] shards side by side, cut to ``vocab_size``, as
        float32; the others send theirs and get None. A gather, not an all-gather: only rank
        0 samples."""
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(logits, parts, dst=0)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab_size].float()

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' values (the KV pages every rank can hold). Also a barrier:
        it returns once every rank has loaded its weights."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    def send_step(self, data: bytes) -> None:
        """Rank 0: one encoded message to every other rank."""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.control)
        dist.broadcast(torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()), 0,
                       group=self.control)

    def receive_step(self) -> bytes:
        """Ranks 1..N-1: the next message rank 0 sent (blocks while the server is idle)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.control)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.control)
        return data.numpy().tobytes()


def start_tensor_parallel(config: EngineConfig, rank: int) -> TensorParallel:
    """Join the group as ``rank`` (blocks until every rank of every node has joined)."""
    local_rank = rank % config.tp_ranks_per_node
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    logger.info("tensor-parallel rank %d of %d (%s on %s) joining at %s", rank, config.tp_size,
                backend, device, config.dist_init_addr)
    dist.init_process_group(backend, init_method=f"tcp://{config.dist_init_addr}", rank=rank,
                            world_size=config.tp_size, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TensorParallel(rank, config.tp_size, device, control)
