"""The demo under tensor parallelism (`--tp`, torchrun): set-up, every rank's table, the
all-reduces' share of a step (see graphsafe.demo)."""

from __future__ import annotations

import statistics
import time
from typing import Any, TextIO

import torch

from graphsafe.demo.measure import _sync
from graphsafe.demo.options import DemoError, DemoOptions, Row
from graphsafe.demo.table import format_table


def _init_tensor_parallel(opts: DemoOptions):
    from graphsafe.models.parallel import init_from_environment

    try:
        tp, device = init_from_environment(opts.device)
    except RuntimeError as err:
        raise DemoError(str(err)) from None
    if tp.size != opts.tp:
        raise DemoError(f"--tp {opts.tp}, but torchrun started {tp.size} processes (--nproc-per-node {opts.tp})")
    return tp, device


def _report_ranks(rows: list[Row], opts: DemoOptions, device: torch.device, build_s: float, model: Any, tp: Any,
                  out: TextIO) -> list[Row]:
    """Rank 0 prints every rank's table (syncs and allocations are per rank); every rank
    returns all ranks' rows, so each exits with the same code."""
    import torch.distributed as dist

    for r in rows:
        r.note = r.note or ""
    gathered: list[Any] = [None] * tp.size
    dist.all_gather_object(gathered, [(r, device.index) for r in rows], group=tp.group)
    if tp.rank == 0:
        for rank, rank_rows in enumerate(gathered):
            index = rank_rows[0][1] if rank_rows else None
            rank_device = device if index is None else torch.device(device.type, index)
            print(f"== rank {rank} of {tp.size}", file=out)
            table = format_table([r for r, _ in rank_rows], opts, rank_device, build_s, model,
                                 legend=rank == tp.size - 1)
            print(table, file=out)
    return [r for rank_rows in gathered for r, _ in rank_rows]


def allreduce_ms(model: Any, batch: int, device: torch.device, captured: bool, repeats: int = 20) -> float | None:
    """Milliseconds of one decode step's all-reduces run alone: as many as the step
    makes (two a layer), of the same `[batch, hidden]` tensors, eagerly (eager and
    compiled modes call them one by one) or replayed from a CUDA graph (the graph mode)."""
    tp = getattr(model, "tp", None)
    if tp is None or tp.size == 1:
        return None
    import torch.distributed._functional_collectives as funcol

    count = 2 * model.cfg.num_layers
    x = torch.ones(batch, model.cfg.hidden_size, dtype=model.dtype, device=device)

    def step() -> None:
        for _ in range(count):
            funcol.wait_tensor(tp.all_reduce(x))

    run = step
    if captured and device.type == "cuda":
        step()  # warm-up outside capture (communicator set-up)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)
