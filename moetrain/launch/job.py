"""One rank of a run: logging, torch.distributed, lifecycle, then the trainer (:func:`run_rank`).

Every launcher ends here: a task that submit started (:class:`moetrain.launch.task.TrainJob`,
directly or through its supervisor, :mod:`moetrain.launch.supervisor`), ``python -m
moetrain.run`` under torchrun, an ``srun`` step inside an allocation. The rank holds only the
resolved config; everything else (step, data position, RNG) is in the run directory's
checkpoints, so a restart resumes where the last complete checkpoint is.

Lifecycle on SLURM:

* the pre-timeout signal (``--signal=USR2@signal_delay_s``) and preemption
  (``preempt_send_user_signal``) only set a flag; the loop finishes its step, checkpoints, and
  rank 0 requeues the job (``scontrol requeue``); the restarted attempt resumes;
* a node failure ends the attempt without a signal; SLURM requeues the job (``JobRequeue=1``)
  and the next attempt resumes from the latest complete checkpoint;
* a hang (no progress for ``launch.heartbeat_timeout_factor`` × the median step time, at least
  ``launch.heartbeat_min_timeout_s``) is caught by each rank's watchdog: stacks are dumped, the
  suspected node is excluded and the job requeued;
* a rank that dies (SIGKILL, the OOM killer) or a collective that times out makes the other
  ranks fail in a collective: each rank records why it failed (:func:`record_failure`, kind
  ``peer``). On SLURM each task supervises its rank in a child process
  (:mod:`moetrain.launch.supervisor`, ``launch.restart_in_job``): when every task is still
  there the ranks restart inside the job; when a node's tasks are gone the job is requeued with
  the cause (the ranks that left no record; :func:`requeue_after_failure`). Locally the submit
  command relaunches it (:mod:`moetrain.submit`). A rank's own error (a corrupt shard, a full
  disk) is recorded too and ends the run: a restart would repeat it;
* ``SLURM_RESTART_COUNT`` plus the restarts inside the job (locally: the relaunch number) count
  restarts; past
  ``launch.max_restarts`` the run stops and says why (``events.jsonl``, the log, and the job's
  failure).

The same rank body (:func:`run_rank`) serves the other launchers (``python -m moetrain.run``
under torchrun, or ``srun`` steps inside an allocation ``submit`` found): a :class:`RankEnv`
says who the process is and whether it may requeue a SLURM job (only a batch job ``submit``
submitted may: a requeue needs a batch job, and an allocation or a torchrun job belongs to
someone else); without it, a failure or a stop ends the process and its launcher restarts it.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetrain.config import Config, to_dict

log = logging.getLogger("moetrain")


def setup_logging(rank: int) -> None:
    """Rank 0 logs INFO to stdout; the others only warnings (each task has its own log file)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def exit_now(code: int) -> None:
    """End the process with ``code`` after flushing stdout and stderr, without the interpreter's
    teardown: about 5 % of gloo workers abort in it after their work is done (measured on this
    project's CPU machines)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def master_port(job_id: str, restart: int) -> int:
    """Rendezvous port for one attempt, in [20000, 32768): differs between attempts, so a process
    left over from an earlier attempt cannot hold the new attempt's port, and stays below Linux's
    default ephemeral range (``net.ipv4.ip_local_port_range``, 32768-60999), where any outgoing
    connection on the node (srun's, slurmd's, another job's gloo pairs) may hold it: rank 0's
    TCPStore then fails with EADDRINUSE (seen once in CI, when the range reached 49999)."""
    return 20000 + zlib.crc32(f"{job_id}/{restart}".encode()) % 12768


def process_threads(cpus_per_task: int | None, local_world_size: int) -> tuple[int, str]:
    """Torch threads for one rank, and why: ``launch.cpus_per_task`` when set; else SLURM's
    ``SLURM_CPUS_PER_TASK``; else the cores this process may run on (its CPU affinity: on SLURM
    with task binding, the task's own) shared by the ranks of this node."""
    if cpus_per_task is not None:
        return cpus_per_task, "launch.cpus_per_task"
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return int(os.environ["SLURM_CPUS_PER_TASK"]), "SLURM_CPUS_PER_TASK"
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // max(1, local_world_size)), f"{cores} cores / {local_world_size} local ranks"


class RestartsExhausted(RuntimeError):
    """The run was restarted more than ``launch.max_restarts`` times."""


@dataclass(frozen=True)
class RankEnv:
    """Who this process is in the job. ``rank`` / ``world_size`` / ``local_rank`` /
    ``local_world_size``: torch.distributed's (already exported as RANK, WORLD_SIZE, ...,
    MASTER_ADDR and MASTER_PORT). ``job_id``: the name failure records and the attempt fence
    use. ``log_path``: where this rank's output goes (named in its failure record). ``requeue``:
    this is a SLURM batch job ``submit`` submitted, which the run may requeue itself.
    ``launcher``: ``submitit``, ``torchrun`` or ``srun`` (for the log). ``supervised``: the
    process is the child of a supervising task (:mod:`moetrain.launch.supervisor`), which
    decides what a peer failure leads to (a restart inside the job, or a requeue)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    job_id: str
    log_path: str
    requeue: bool
    launcher: str
    supervised: bool = False


def run_rank(cfg: Config, renv: RankEnv, restart: int) -> str:
    """Train as one rank of the job (torch.distributed's variables already exported): the
    lifecycle of the module docstring. Returns the trainer's status (``done`` or ``stopped``).

    Raises:
        RestartsExhausted: more than ``launch.max_restarts`` restarts, or a stop with none left.
        BaseException: whatever ended the rank, after its failure record is written.
    """
    catch_stop_signals()  # before the imports and the model build: a signal then must not kill the rank
    os.environ.update(cfg.launch.env)  # under SLURM the job script exported them already
    for name, value in flight_recorder_env(cfg.run_dir).items():  # NCCL reads them at its first communicator
        os.environ.setdefault(name, value)
    (cfg.run_dir / "stacks").mkdir(parents=True, exist_ok=True)
    asked = cfg
    try:
        if cfg.launch.elastic is not None:
            setup_logging(renv.rank)  # the re-plan's line goes to rank 0's log
        cfg = _elastic_start(cfg, renv, restart)
        if cfg.world_size != renv.world_size:
            if renv.rank >= cfg.world_size:  # a node the re-planned layout leaves out
                log.warning("rank %d sits this attempt out: the re-planned layout uses ranks 0-%d", renv.rank,
                            cfg.world_size - 1)
                return "idle"
            renv = dataclasses.replace(renv, world_size=cfg.world_size)
            os.environ["WORLD_SIZE"] = str(cfg.world_size)
        return _train(cfg, renv, restart, asked)
    except BaseException as e:
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        _failed(cfg, renv, restart, e, asked.launch.nodes)
        raise


def _elastic_start(cfg: Config, renv: RankEnv, restart: int) -> Config:
    """The config this attempt trains with (:func:`moetrain.launch.elastic.start_attempt`). With
    no layout fitting and ``launch.elastic.too_few: wait``, rank 0 requeues the job asking for the
    fewest nodes that have one, and every rank waits to be ended with the attempt.

    Raises:
        ElasticError: no layout fits (``too_few: stop``, or the job cannot be requeued).
    """
    from moetrain.launch.elastic import ElasticError, start_attempt

    try:
        return start_attempt(cfg, renv.world_size, renv.local_world_size, renv.rank)[0]
    except ElasticError as e:
        el = cfg.launch.elastic
        if el is None or el.too_few != "wait" or not renv.requeue or restart >= cfg.launch.max_restarts:
            raise
        from moetrain.launch.lifecycle import append_event, requeue_slurm_job
        from moetrain.planner.elastic import node_counts_without_layout

        tpn = cfg.launch.resolved_tasks_per_node(cfg.world_size)
        have = renv.world_size // max(1, renv.local_world_size)
        bad = node_counts_without_layout(cfg.replace(launch={"elastic": {"min_nodes": 1}}))
        need = min([n for n in range(have + 1, cfg.launch.nodes + 1) if n not in bad] or [cfg.launch.nodes])
        log.error("%s; launch.elastic.too_few: wait: requeueing the job for %d-%d nodes of %d tasks", e, need,
                  cfg.launch.nodes, tpn)
        if renv.rank == 0:
            ok = requeue_slurm_job(nodes=(need, cfg.launch.nodes, tpn))
            append_event(cfg.run_dir, None, "requeue", cause=f"too few nodes: {e}", restart=restart + 1, ok=ok,
                         nodes=f"{need}-{cfg.launch.nodes}")
            if not ok:
                raise
        end_with_attempt(1)
        raise


def flight_recorder_env(run_dir: Path) -> dict[str, str]:
    """The variables that turn NCCL's flight recorder on (PyTorch's ``TORCH_NCCL_*``): the last
    2000 collectives of each communicator are kept and, when a collective times out, dumped per
    rank to ``<run_dir>/stacks/nccl_trace_rank_<r>`` beside the hang watchdog's stack dumps
    (read them with ``python -m torch.distributed.flight_recorder.fr_trace``). gloo ignores them.
    A value already in the environment (``launch.env``) wins."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(run_dir) / "stacks" / "nccl_trace_rank_")}


def _failed(cfg: Config, env: RankEnv, restart: int, exc: BaseException, asked_nodes: int | None = None) -> None:
    """Record why this rank failed (the full traceback goes to its log), and, when this job may
    be requeued, a peer died or a collective failed and restarts are left, requeue the job
    (the first failing rank does; the others wait to be ended with it). An elastic job is
    requeued for its node range up to ``asked_nodes`` (the config's, before any re-plan),
    excluding the nodes that failed whole."""
    from moetrain.train.records import (
        failure_kind,
        record_failure,
    )

    log.error("rank %d failed:\n%s", env.rank, "".join(traceback.format_exception(exc)))
    kind = failure_kind(exc)
    try:
        record_failure(cfg.run_dir, env.job_id, restart, env.rank, kind, type(exc).__name__,
                       str(exc), env.log_path)
    except OSError as e:
        log.error("could not record the failure in %s: %s", cfg.run_dir, e)
    atexit.register(exit_now, 1)  # after submitit records the result (gloo may abort at exit)
    if kind != "peer" or not env.requeue or restart >= cfg.launch.max_restarts or env.supervised:
        return  # supervised: the task's supervisor decides (moetrain.launch.supervisor)
    requeue_after_failure(cfg, env, restart, asked_nodes)


def requeue_after_failure(cfg: Config, env: RankEnv, restart: int, asked_nodes: int | None = None,
                          settle_s: float = 3.0) -> None:
    """Requeue the job after a peer failure of attempt ``restart``: the first caller of the
    attempt does (an elastic job held, its whole-node failures excluded, its node range asked
    again, then released); every caller then waits to be ended with the attempt (returns when
    the requeue failed or another rank's did not come). ``settle_s``: how long an elastic job
    waits, held, for the surviving ranks' failure records before naming the failed nodes (0 when
    the caller waited for them already, as the supervisors' decision does)."""
    from moetrain.launch.lifecycle import append_event, requeue_slurm_job
    from moetrain.train.records import atomic_write_json, diagnose, failures_dir, read_failures, read_json

    where = failures_dir(cfg.run_dir, env.job_id, restart)
    if not claim_requeue(where):  # another rank requeues the job (or the hang watchdog did)
        for _ in range(120):
            done = read_json(where / "requeue.json")
            if isinstance(done, dict):
                if done.get("ok"):
                    end_with_attempt(1)
                return
            time.sleep(0.5)
        return
    # Requeue first: a cluster that ends a step when one task fails (KillOnBadExit) must not
    # end this process before it has. Then let the other survivors record themselves, so
    # that the cause names the dead rank(s).
    failed_nodes: list[str] = []
    if cfg.launch.elastic is not None:
        # Held first, then the failed nodes (every rank of theirs silent) are excluded before
        # the release: SLURM may not have marked them down yet, and would start the job there.
        def exclusions() -> list[str]:
            from moetrain.launch.elastic import failed_nodes as whole_node_failures
            from moetrain.launch.elastic import record_failed_nodes
            from moetrain.launch.lifecycle import job_exclusions
            from moetrain.train.records import exclude_nodes

            time.sleep(settle_s)
            failed_nodes.extend(whole_node_failures(
                cfg.run_dir, diagnose(read_failures(cfg.run_dir, env.job_id, restart), env.world_size)))
            record_failed_nodes(cfg.run_dir, failed_nodes)
            exclude_nodes(cfg.run_dir, failed_nodes)
            return job_exclusions(cfg.run_dir, cfg.launch.exclude)

        ok = requeue_slurm_job(decide=exclusions, nodes=elastic_range(cfg, asked_nodes))
    else:
        ok = requeue_slurm_job()
        time.sleep(1.5)
    why = diagnose(read_failures(cfg.run_dir, env.job_id, restart), env.world_size)
    atomic_write_json(where / "requeue.json", {"ok": ok, "cause": why.cause})
    append_event(cfg.run_dir, None, "requeue", cause=why.cause, restart=restart + 1, ok=ok,
                 **({"excluded_failed_nodes": failed_nodes} if failed_nodes else {}))
    log.error("requeue of the job (restart %d of %d) %s: %s", restart + 1, cfg.launch.max_restarts,
              "done" if ok else "FAILED", why.cause)
    if ok:
        end_with_attempt(1)


def _train(cfg: Config, env: RankEnv, restart: int, asked: Config | None = None) -> str:
    """Train with ``cfg`` (``asked``: the config before an elastic re-plan, the size to grow
    back to)."""
    import torch
    import torch.distributed as dist

    from moetrain.launch.lifecycle import Watchdog, append_event, existing_excludes, job_exclusions, \
        requeue_slurm_job
    from moetrain.train.records import atomic_write_json, failures_dir, record_failure
    from moetrain.train.trainer import StopFlag, Trainer

    may_requeue = env.requeue
    setup_logging(env.rank)
    threads, why = process_threads(cfg.launch.cpus_per_task, env.local_world_size)
    torch.set_num_threads(threads)
    if env.rank == 0:
        log.info("torch threads per process: %d (%s); started by %s, job %s", threads, why, env.launcher,
                 env.job_id)

    if restart > cfg.launch.max_restarts:
        msg = (f"restart {restart} exceeds launch.max_restarts={cfg.launch.max_restarts}: giving up; "
               f"see {cfg.run_dir / 'events.jsonl'} for the causes")
        if env.rank == 0:
            append_event(cfg.run_dir, None, "gave_up", restart=restart, reason=msg)
        log.error(msg)
        raise RestartsExhausted(msg)

    # Signals only set a flag; the loop checkpoints at the next step boundary. One that arrived
    # while the rank was starting counts as if it arrived now.
    stop = StopFlag()
    catch_stop_signals(stop)

    trainer = Trainer(cfg, job_id=env.job_id, restart=restart, stop_flag=stop,
                      hosts_from_ranks=env.launcher == "torchrun")
    install_fault_hook(trainer, env.rank, restart)

    def on_hang(nodes: list[str]) -> None:
        excluded = sorted(set(job_exclusions(cfg.run_dir, cfg.launch.exclude)) | set(nodes))
        record_failure(cfg.run_dir, env.job_id, restart, env.rank, "hang", "Hang",
                       f"no step completed for {trainer.watchdog.timeout_s():.0f} s at step {trainer.step + 1}; "
                       f"suspected node(s) {nodes}; stacks in {cfg.run_dir / 'stacks'}", env.log_path)
        if may_requeue and restart < cfg.launch.max_restarts:
            where = failures_dir(cfg.run_dir, env.job_id, restart)
            if not claim_requeue(where):  # a failing rank is requeueing the job already
                end_with_attempt(1)
                exit_now(1)
            requeued = requeue_slurm_job(exclude=excluded, nodes=elastic_range(asked))
            atomic_write_json(where / "requeue.json", {"ok": requeued, "cause": "hang"})
            append_event(cfg.run_dir, trainer.fence, "requeue", cause="hang", excluded=excluded, ok=requeued)
            if requeued:
                end_with_attempt(1)
        elif may_requeue:
            append_event(cfg.run_dir, trainer.fence, "gave_up", cause="hang",
                         reason=f"launch.max_restarts={cfg.launch.max_restarts} reached")
        # Locally the submit command reads the record and relaunches (or gives up).
        exit_now(1)

    trainer.watchdog = Watchdog(cfg.run_dir, env.rank, trainer.fence, trainer.heartbeat,
                                cfg.launch.heartbeat_timeout_factor, cfg.launch.heartbeat_min_timeout_s,
                                on_hang).start()
    grow = _grow_watcher(cfg, asked, env, stop) if may_requeue else None
    trainer.after_step = _recovery_clock(cfg, env, restart, trainer)
    status = trainer.run()
    trainer.watchdog.stop()
    if grow is not None:
        grow.stop()
    if status == "stopped" and may_requeue:
        dist.barrier()
        give_up = restart >= cfg.launch.max_restarts
        if env.rank == 0:
            if not give_up and stop.reason == "grow":
                from moetrain.launch.elastic import forget_failed_nodes
                from moetrain.launch.lifecycle import rewrite_excludes

                back = forget_failed_nodes(cfg.run_dir)
                rewrite_excludes(cfg.run_dir, back)
                ok = requeue_slurm_job(exclude=job_exclusions(cfg.run_dir, cfg.launch.exclude),
                                       nodes=elastic_range(asked))
                append_event(cfg.run_dir, trainer.fence, "requeue", cause="grow back to "
                             f"{asked.launch.nodes} nodes", ok=ok, readmitted=back)
            elif not give_up:
                excluded = job_exclusions(cfg.run_dir, cfg.launch.exclude) if existing_excludes(cfg.run_dir) else None
                ok = requeue_slurm_job(exclude=excluded, nodes=elastic_range(asked))
                append_event(cfg.run_dir, trainer.fence, "requeue", cause=stop.reason, ok=ok)
            else:
                append_event(cfg.run_dir, trainer.fence, "gave_up", cause=stop.reason,
                             reason=f"launch.max_restarts={cfg.launch.max_restarts} reached")
        dist.destroy_process_group()
        if give_up:
            # Fail with the reason, rather than end without a result ("has not produced any
            # output" is all submitit and `submit` could say then).
            msg = (f"stopped by {stop.reason} at step {trainer.step} (checkpoint saved) after {restart} "
                   f"restart(s): launch.max_restarts={cfg.launch.max_restarts} reached, so the job is not "
                   f"requeued; resubmit the same config to resume")
            log.error(msg)
            atexit.register(exit_now, 1)
            raise RestartsExhausted(msg)
        # Leave without a result: the requeued attempt will produce it (as submitit does).
        exit_now(EXIT_REQUEUED if env.supervised else 0)
    dist.destroy_process_group()
    return status


def elastic_range(cfg: Config | None, nodes: int | None = None) -> tuple[int, int, int] | None:
    """An elastic job's node request for a requeue: ``(launch.elastic.min_nodes, nodes (default
    launch.nodes), tasks per node)``; None for other jobs (:func:`requeue_slurm_job`'s ``nodes``)."""
    if cfg is None or cfg.launch.elastic is None:
        return None
    return (cfg.launch.elastic.min_nodes, nodes or cfg.launch.nodes, cfg.launch.resolved_tasks_per_node(cfg.world_size))


def _grow_watcher(cfg: Config, asked: Config | None, env: RankEnv, stop: Any) -> Any:
    """Rank 0's :class:`moetrain.launch.elastic.GrowWatcher` when the run is shrunk and
    ``launch.elastic.grow`` is on (None otherwise); its yes sets the stop flag (reason ``grow``)."""
    if env.rank != 0 or asked is None or asked.launch.elastic is None or not asked.launch.elastic.grow \
            or cfg.launch.nodes >= asked.launch.nodes:
        return None
    from moetrain.launch.elastic import GrowWatcher, job_nodes, read_failed_nodes
    from moetrain.launch.lifecycle import job_exclusions

    def exclude() -> list[str]:  # the failed nodes are the ones that may come back
        failed = set(read_failed_nodes(cfg.run_dir))
        return [n for n in job_exclusions(cfg.run_dir, cfg.launch.exclude) if n not in failed]

    log.info("running on %d of %d nodes: asking SLURM every %.0f s whether the others can start", cfg.launch.nodes,
             asked.launch.nodes, asked.launch.elastic.grow_check_s)
    return GrowWatcher(asked, job_nodes(dict(os.environ)), exclude, lambda line: stop.set("grow")).start()


def _recovery_clock(cfg: Config, env: RankEnv, restart: int, trainer: Any) -> Any:
    """After a restart, rank 0's hook that records, at the first step this attempt completes, the
    seconds since the previous attempt ended (event ``recovered``): since its first failure
    record (the moment a surviving rank noticed the failure, within a second of a killed process
    or node), else since its ``stopped`` event (a stop, a grow-back). None otherwise."""
    if env.rank != 0 or restart == 0 or trainer.fence is None:
        return None
    from moetrain.train.records import append_event, read_events, read_json

    # The previous attempt (it may have been another job: a local relaunch, a resubmission).
    events = read_events(cfg.run_dir)
    previous = trainer.fence.seq - 1
    began = [e["time"] for e in events if e.get("event") == "started" and e.get("attempt") == previous]
    if not began:
        return None
    records = [read_json(p) for p in (cfg.run_dir / "failures").glob("*/rank*.json")]
    failed = [f["time"] for f in records if isinstance(f, dict) and f.get("time", 0) > began[-1]]
    stops = [e for e in events if e.get("event") == "stopped" and e.get("attempt") == previous]
    if failed:
        since, cause = min(failed), "failure"
    elif stops:
        since, cause = float(stops[-1]["time"]), f"stop ({stops[-1].get('reason')})"
    else:
        return None
    done = []

    def after_step(step: int) -> None:
        if done:
            return
        done.append(step)
        seconds = time.time() - since
        log.info("first step after the restart done %.1f s after the %s", seconds, cause)
        append_event(cfg.run_dir, trainer.fence, "recovered", step=step, seconds=round(seconds, 2), since=cause,
                     world_size=cfg.world_size)
    return after_step


_TERMINATED = threading.Event()  # SLURM's SIGTERM reached this process
_EARLY_SIGNALS: list[str] = []  # stop signals that arrived before the trainer's flag existed
_STOP_FLAG: list[Any] = [None]  # the trainer's StopFlag, once catch_stop_signals was handed it


def catch_stop_signals(flag: Any = None) -> None:
    """From the rank's first moment, note SIGUSR2 (SLURM's pre-timeout signal, preemption) and
    SIGTERM instead of dying of them: their default action ends the process, and a rank still
    importing torch or building its model when the time-limit signal comes (a slow shared
    filesystem, a loaded host) would otherwise die without a checkpoint and be restarted as a
    failure instead of stopping and requeueing. ``flag``: the trainer's
    :class:`~moetrain.train.trainer.StopFlag` (:func:`_train`), which gets what was noted so far
    and every later signal, and stops the loop at its next step boundary."""
    if flag is not None:
        _STOP_FLAG[0] = flag
        for reason in _EARLY_SIGNALS:
            flag.set(reason)

    def note(signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM:
            _TERMINATED.set()
        name = signal.Signals(signum).name
        if _STOP_FLAG[0] is None:
            _EARLY_SIGNALS.append(name)
        else:
            _STOP_FLAG[0].set(name)
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, note)


EXIT_REQUEUED = 3  # a supervised rank's exit status once its job is requeued (the supervisor leaves too)


def end_with_attempt(code: int, after_s: float = 600.0) -> None:
    """Wait, once this attempt's job is requeued, for SLURM to end its processes, and leave at its
    SIGTERM (or at once when it came already) instead of at the SIGKILL that follows ``KillWait``
    seconds later (30 s by default): the requeued job starts only once every process of the
    attempt is gone. Never called before the requeue is done: leaving first would make the other
    ranks fail on the closed connections and report those errors as the job's result, and a
    SIGTERM between ``requeuehold`` and ``release`` must not end the process that releases.
    Ends the process with ``code`` after ``after_s`` seconds at the latest."""
    signal.signal(signal.SIGTERM, lambda signum, frame: exit_now(code))
    if _TERMINATED.is_set():
        exit_now(code)
    time.sleep(after_s)
    exit_now(code)


def claim_requeue(where: Path) -> bool:
    """True for the first caller in an attempt's failures folder (it requeues the job); every
    later one (another failing rank, the hang watchdog) gets False and must not requeue again."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(where / "requeue.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def install_fault_hook(trainer: Any, rank: int, restart: int) -> None:
    """``MOETRAIN_FAULT_HOOK="path/to/file.py:function"``: call ``function(trainer, rank, restart)``
    from that file before training, so that a test can inject faults (a hang, a slow step, a
    killed rank) through ``trainer.before_step`` or module hooks without any test code here
    (tests/faults.py)."""
    spec = os.environ.get("MOETRAIN_FAULT_HOOK")
    if not spec:
        return
    import importlib.util

    path, _, name = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location("moetrain_fault_hook", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    getattr(module, name)(trainer, rank, restart)


def job_config(cfg: Config) -> dict:
    return to_dict(cfg)


class LauncherError(RuntimeError):
    """The process was not started by a launcher this module can read (torchrun, srun)."""


def _first_count(text: str) -> int:
    # SLURM task counts per node: "4(x2),2" → 4 (the first node's).
    m = text.split(",")[0].split("(")[0]
    return int(m) if m.isdigit() else 0


def rank_env_from_environ(restart: int, job_id: str | None = None, log_path: str | None = None) -> RankEnv:
    """This process's :class:`RankEnv` from its launcher's variables, exporting what
    torch.distributed reads: torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: used as they are), or an ``srun``
    step's (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
    ``SLURM_STEP_TASKS_PER_NODE``; the master is the step's first node, the port
    :func:`master_port` of the job and restart). ``job_id``: default the SLURM job id, torchrun's
    ``TORCHELASTIC_RUN_ID`` or ``torchrun``. ``log_path``: where this rank's output goes;
    ``{rank}`` in it is replaced. Never requeues: the launcher restarts.

    Raises:
        LauncherError: neither torchrun's nor an srun step's variables are set.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        launcher = "torchrun"
        job_id = job_id or env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "torchrun"
    elif "SLURM_PROCID" in env and "SLURM_STEP_NODELIST" in env:
        from moetrain.topology.cluster import expand_nodelist

        rank, world = int(env["SLURM_PROCID"]), int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
        local = int(env.get("SLURM_LOCALID", "0"))
        local_world = _first_count(env.get("SLURM_STEP_TASKS_PER_NODE", "")) or world
        launcher = "srun"
        job_id = job_id or env.get("SLURM_JOB_ID", "srun")
        env.update({"MASTER_ADDR": expand_nodelist(env["SLURM_STEP_NODELIST"])[0],
                    "MASTER_PORT": str(master_port(job_id, restart)), "RANK": str(rank), "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(local_world)})
    else:
        raise LauncherError("not started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR) nor inside an srun step "
                            "(SLURM_PROCID, SLURM_STEP_NODELIST): start it as `torchrun --nproc-per-node N -m "
                            "moetrain.run --config X.yaml`, or use python -m moetrain.submit")
    log = (log_path or f"{launcher}'s output of rank {{rank}}").replace("{rank}", str(rank))
    return RankEnv(rank, world, local, local_world, job_id, log, requeue=False, launcher=launcher)
