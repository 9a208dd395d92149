"""Run a function in N gloo processes on CPU and collect each rank's return value.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises
torch.distributed (gloo, a fresh TCP port), calls ``fn(rank, world_size, *args)`` in each, and
returns the list of results ordered by rank (torch tensors inside are fine: results travel as
``torch.save`` files). ``fn`` must be importable (a module-level function).

The ranks start from a fork server that has imported torch and moetrain once (a spawned rank
spends ~1.5 s of this machine's 2 cores importing them, and the suite starts hundreds); each rank
takes the caller's environment variables and working directory as a spawned one would.
``MOETRAIN_TEST_SPAWN=1`` spawns fresh interpreters instead.

Workers end with ``destroy_process_group()`` then ``os._exit(0)``: about 5 % of gloo workers
otherwise abort at interpreter exit after finishing their work (measured on this project's CPU
machines), which would make the tests flaky.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port for rank 0's TCPStore that is free now and stays free until rank 0 listens on it:
    below Linux's ephemeral range (32768-60999, where the outgoing end of every gloo connection
    takes a port, so a port the kernel handed out a moment ago may be taken again before rank 0
    binds it) and below moetrain's own rendezvous ports (20000-32767,
    ``moetrain.launch.job.master_port``), in a slice of 1,000 of its own per pytest-xdist worker.
    Raises RuntimeError when the slice has no free port."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = 10000 + 1000 * (int(worker) % 10 if worker.isdigit() else 0)
    for port in random.sample(range(base, base + 1000), 1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}-{base + 999}")


# Imported once by the fork server; what the ranks' functions need most.
PRELOAD = ["torch", "torch.distributed", "moetrain.train.trainer", "moetrain.hf.convert", "multiproc"]


def _context() -> Any:
    if os.environ.get("MOETRAIN_TEST_SPAWN") == "1":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, init: bool,
            env: dict[str, str] | None = None, cwd: str | None = None) -> None:
    if env is not None:  # the caller's environment, as a spawned process would inherit it
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    code = 0
    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:  # noqa: BLE001 - reported to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, Path(out_dir) / f"rank{rank}.pt")
        code = 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


# A rank function that runs several cases in turn keeps every case's process groups until its
# spawn ends (torch's DeviceMesh holds them), and each idle gloo group's thread wakes about 100
# times a second: 130 of them per rank starved the other worker's processes (docs/development.md,
# "Start-up is not where the time goes"). Such functions get at most this many cases a spawn.
CASES_PER_SPAWN = 4


def spawn_chunks(cases: list, size: int = CASES_PER_SPAWN) -> list[list]:
    """``cases`` in order, ``size`` to a spawn (:data:`CASES_PER_SPAWN`)."""
    return [cases[i:i + size] for i in range(0, len(cases), size)]


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0,
                    init: bool = True) -> list[Any]:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; results by rank.
    ``init=False``: leave the process group to ``fn`` (e.g. the trainer's own NCCL + gloo group
    on a GPU), with the rendezvous environment set.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message) or died.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = _context()
        port = free_port()
        env, cwd = dict(os.environ), os.getcwd()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, out_dir, fn, args, init, env, cwd),
                             daemon=False) for r in range(world_size)]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout)
        finally:
            # Also when pytest-timeout interrupts the join: ranks left running would take the
            # cores from every later test of the worker.
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results, errors = [], []
        for r in range(world_size):
            f = Path(out_dir) / f"rank{r}.pt"
            if not f.exists():
                errors.append(f"rank {r}: died without a result (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            rec = torch.load(f, weights_only=False)
            if not rec["ok"]:
                errors.append(f"rank {r}:\n{rec['error']}")
                results.append(None)
            else:
                results.append(rec["result"])
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
        return results
