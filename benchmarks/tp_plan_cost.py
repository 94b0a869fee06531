"""What tensor parallelism's per-step plan costs on the CPU: its pickled size (a sequence's
first plan carries its whole block tables, later ones what changed: here nothing, as in the
15 of 16 decode steps that start no block), rank 0's time to build and pickle it, and the time
a step's broadcast takes over gloo between two local ranks, beside a bare 8-byte broadcast.
Run: python benchmarks/tp_plan_cost.py"""

from __future__ import annotations

import pickle
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inferx_core.distributed import (
    PlanDecoder,
    PlanEncoder,
    free_port,
    receive_plan,
    send_plan,
)
from inferx_core.interfaces import ScheduledChunk, SchedulerOutput
from inferx_core.sequence import SamplingParams, Sequence

STEPS = 300


def step(batch: int, context: int, block_size: int = 16, prefill: bool = False) -> SchedulerOutput:
    chunks = []
    for i in range(batch):
        seq = Sequence(list(range(context)), SamplingParams())
        per = context // block_size
        seq.block_tables = [list(range(i * per, (i + 1) * per))]
        start, n = (0, context) if prefill else (context - 1, 1)
        chunks.append(ScheduledChunk(seq, start, n, True))
    return SchedulerOutput(chunks=chunks)


def run(rank: int, port: int, cases: list[tuple[str, SchedulerOutput]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    for name, out in cases:
        encoder, decoder = PlanEncoder(), PlanDecoder()
        dist.barrier()
        if rank == 0:
            first = send_plan(encoder.encode(out), group)
        else:
            decoder.decode(receive_plan(group))
        t0 = time.perf_counter()
        for _ in range(STEPS):
            if rank == 0:
                size = send_plan(encoder.encode(out), group)
            else:
                decoder.decode(receive_plan(group))
        per_step = (time.perf_counter() - t0) / STEPS
        if rank == 0:
            t0 = time.perf_counter()
            for _ in range(STEPS):
                pickle.dumps(encoder.encode(out), protocol=pickle.HIGHEST_PROTOCOL)
            build = (time.perf_counter() - t0) / STEPS
            print(
                f"{name}: {first} bytes first, {size} after; build+pickle {build * 1e6:.0f} us; "
                f"broadcast {per_step * 1e6:.0f} us a step",
                flush=True,
            )
    x = torch.zeros(1, dtype=torch.long)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        dist.broadcast(x, 0, group=group)
    if rank == 0:
        print(f"bare 8-byte broadcast: {(time.perf_counter() - t0) / STEPS * 1e6:.0f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    cases = [
        ("decode, batch 1, context 512", step(1, 512)),
        ("decode, batch 64, context 512", step(64, 512)),
        ("decode, batch 128, context 2048", step(128, 2048)),
        ("prefill, batch 1, 512 tokens", step(1, 512, prefill=True)),
    ]
    mp.spawn(run, args=(free_port(), cases), nprocs=2)
