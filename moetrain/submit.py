"""``python -m moetrain.submit --config X.yaml [--config SITE.yaml ...] [--set a.b.c=value ...] [--dry-run]
[--detach] [--explain KEY]``

Validates the config (every error names the field, the value and the fix, before anything
starts), resolves it, writes it to the run directory, submits one task per rank through
submitit (``launch.cluster: local`` on this machine, ``slurm`` on a cluster), and follows the
run's progress until it ends: its step lines (with elapsed time and ETA) and its lifecycle
events (resumes, corrupt checkpoints skipped, requeues, restarts and their causes). Exit status:
0 when training finished, 1 when the run failed, 2 for a bad config, 3 when the run stopped
early (signal / preemption) and will resume.

When the run fails, a few lines say which rank failed, with which exception and message, and
where its log (with the full traceback) is. When a rank died or a collective failed, the run
restarts from its latest complete checkpoint, up to ``launch.max_restarts`` times: on SLURM the
job requeues itself (:mod:`moetrain.launch.job`); locally this command relaunches it.

Configs layer: ``--config`` repeats (base, site, experiment; later files override earlier ones
key by key, lists replaced whole), ``--set`` reaches any depth (``launch.env.NCCL_DEBUG=INFO``),
and the resolved ``config.yaml`` in the run directory names, beside each value, the file that set
it (``--explain KEY`` prints a key's history and exits). Started inside a SLURM allocation
(``salloc``, an sbatch script of the user's), it submits no new job: the ranks run as ``srun``
steps of that allocation (:mod:`moetrain.launch.allocation`), restarted within it after a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator


from moetrain.config import Config, ConfigError, Layers, explain, load_layers, render_config, save_config
from moetrain.launch.allocation import Allocation, StepJob, check_allocation, current_allocation, step_script
from moetrain.monitor import collect, register_job, slurm_job_queued
from moetrain.train.metrics import check_sinks_installed, format_duration
from moetrain.train.records import Diagnosis, append_event, diagnose, read_failures
from moetrain.utils import atomic_write


def build_parser(prog: str = "python -m moetrain.submit") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[1])
    ap.add_argument("--config", action="append", required=True, metavar="X.yaml",
                    help="YAML run config, e.g. configs/demo-moe.yaml; repeat to layer files (base, site, "
                         "experiment): later ones override earlier ones key by key")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value at any depth (repeatable), e.g. --set train.steps=20 or "
                         "--set launch.env.NCCL_DEBUG=INFO")
    ap.add_argument("--explain", metavar="KEY", help="print the value of KEY (e.g. parallel.dp) and the layers "
                    "that set it, then exit")
    ap.add_argument("--dry-run", action="store_true", help="print what would be submitted and exit")
    ap.add_argument("--detach", action="store_true", help="return after submitting instead of following")
    ap.add_argument("--follow", action="store_true",
                    help="follow the run until it ends (the default; see python -m moetrain.monitor)")
    return ap


def load_and_resolve(args: argparse.Namespace) -> tuple[Config, Layers, Allocation | None]:
    """The checked config, its layers, and the SLURM allocation to run in (None: a new job or a
    local run).

    Raises:
        ConfigError: anything wrong with the config, the data, the weights or the SLURM request.
    """
    from moetrain.launch.preflight import preflight

    cfg, layers = load_layers(args.config, args.overrides)
    alloc = None
    if cfg.launch.cluster == "slurm" and cfg.launch.allocation == "auto":
        alloc = current_allocation()
    given_vocab = cfg.model.vocab_size
    cfg = preflight(cfg, live=not args.dry_run and alloc is None)
    if alloc is not None:
        check_allocation(cfg, alloc)
    if given_vocab is None:
        layers.notes["model.vocab_size"] = (f"auto: the data's vocabulary padded to a multiple of "
                                            f"vocab_multiple × tp = {cfg.model.vocab_multiple * cfg.parallel.tp}")
    check_sinks_installed(cfg)
    return cfg, layers, alloc


def make_executor(cfg: Config, folder: Path) -> Any:
    """The submitit executor of ``cfg``'s launch: SLURM (after every check,
    :func:`moetrain.launch.slurm.make_slurm_executor`) or one local node with a task per rank.

    Raises:
        ConfigError: the SLURM request does not fit the cluster.
    """
    import submitit

    world = cfg.world_size
    if cfg.launch.cluster == "slurm":
        from moetrain.launch.slurm import make_slurm_executor

        return make_slurm_executor(cfg, folder)
    ex = submitit.AutoExecutor(folder=str(folder), cluster="local")
    ex.update_parameters(name=cfg.run.name, nodes=1, tasks_per_node=world, timeout_min=cfg.launch.time_min,
                         stderr_to_stdout=False)
    return ex


def dry_run(cfg: Config, folder: Path, layers: Layers | None = None, alloc: Allocation | None = None) -> str:
    """Human-readable description of the submission (the sbatch script on SLURM; inside an
    allocation, the script of the srun step). On SLURM the request is checked against the
    cluster when one answers here; where none does, the first line says that it was not (the
    script is still shown).

    Raises:
        ConfigError: the cluster that answers cannot run the request.
    """
    lines = [f"# run directory: {cfg.run_dir}", f"# world size {cfg.world_size}: pp {cfg.parallel.pp} × dp "
             f"{cfg.parallel.dp} × cp {cfg.parallel.cp} × tp {cfg.parallel.tp}; ep {cfg.parallel.ep}",
             f"# {cfg.grad_accum_steps} micro-batches of {cfg.train.micro_batch_size} per rank per step"]
    if alloc is not None:
        lines.append(f"# inside SLURM allocation {alloc.job_id} ({alloc.nodes} node(s): {alloc.nodelist}): no new "
                     "job; the ranks run as one srun step of it, each attempt this script:")
        lines.append(step_script(cfg, alloc, 0, folder))
    elif cfg.launch.cluster == "slurm":
        from moetrain.launch.slurm import SlurmUnavailableError, check_against_cluster, query_cluster, \
            render_batch_script

        try:
            cluster = query_cluster()
        except SlurmUnavailableError as e:
            lines.insert(0, f"# NOT checked against a cluster: SLURM does not answer here ({e})")
        else:
            check_against_cluster(cfg, cluster)
            lines.insert(0, f"# checked against the cluster: partition {cfg.launch.partition or cluster.default_partition}")
        lines.append(render_batch_script(cfg, folder))
    else:
        lines.append(f"# submitit local executor: 1 node × {cfg.world_size} tasks, "
                     f"timeout {cfg.launch.time_min} min, logs in {folder}")
    lines.append(render_config(cfg, layers) if layers is not None else "# resolved config:\n" + render_config(cfg))
    return "\n".join(lines)


@contextlib.contextmanager
def _children_stderr(path: Path, redirect: bool) -> Iterator[None]:
    """Processes started inside write their stderr to ``path`` instead of the console (when
    ``redirect``): Ctrl-C reaches submitit's local controller too, which then prints
    KeyboardInterrupt tracebacks of its own; this command's one line says what happened."""
    if not redirect:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as f:
            os.dup2(f.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def record_submission(run_dir: Path, job_id: str, cfg: Config) -> None:
    """Append the job id to ``submission.json`` (job ids across restarts and resubmissions)."""
    path = run_dir / "submission.json"
    rec = json.loads(path.read_text()) if path.is_file() else {"jobs": []}
    rec["jobs"].append({"job_id": job_id, "cluster": cfg.launch.cluster, "time": time.time()})
    atomic_write(path, json.dumps(rec, indent=1))


def format_metrics(rec: dict, total: int) -> str:
    parts = [f"step {rec['step']}/{total}", f"loss {rec['loss']:.4f}", f"aux {rec['aux_loss']:.3f}",
             f"lr {rec['lr']:.2e}", f"{rec.get('tokens_per_s', 0):.0f} tok/s"]
    if "val_loss" in rec:
        by_source = rec.get("val_loss_by_source") or {}
        detail = f" ({', '.join(f'{n} {v:.4f}' for n, v in by_source.items())})" if len(by_source) > 1 else ""
        parts.append(f"val {rec['val_loss']:.4f}{detail}")
    if "elapsed_s" in rec:
        parts.append(f"{format_duration(rec['elapsed_s'])} elapsed, eta {format_duration(rec.get('eta_s'))}")
    return " | ".join(parts)


def format_event(e: dict) -> str | None:
    """The console line of a lifecycle event worth showing (None for the others)."""
    kind = e.get("event")
    if kind == "checkpoint_skipped":
        return f"skipped corrupt checkpoint {e.get('checkpoint')}: {e.get('reason')}"
    if kind == "resumed":
        return f"resumed from {e.get('checkpoint')} at step {e.get('step')}"
    if kind == "schedule_changed":
        return (f"the learning-rate schedule differs from the one steps 1-{e.get('step')} were trained with "
                f"({e.get('changed')}){e.get('hint', '')}")
    if kind == "data_epoch":
        return (f"data source {e.get('source')!r} ran through its {e.get('samples'):,} samples in step {e.get('step')}: "
                f"epoch {e.get('epoch')} begins, reshuffled")
    if kind == "data_changed":
        return f"the data differs from what steps 1-{e.get('step')} were trained with: {e.get('changed')}"
    if kind == "environment_changed":
        from moetrain.train.environment import describe_changes  # the one wording of a change, with the log's

        return (f"the environment differs from attempt {e.get('previous_attempt')}'s: "
                f"{describe_changes(e.get('changed') or {})}")
    if kind == "restart":
        return (f"restarting from the latest complete checkpoint (restart {e.get('restart')} of "
                f"{e.get('max_restarts')}): {e.get('cause')}")
    if kind == "requeue":
        return f"requeued{'' if e.get('ok', True) else ' (FAILED)'}: {e.get('cause')}"
    if kind == "replanned":
        return e.get("message")
    if kind == "recovered":
        return (f"first step after the restart (step {e.get('step')}, {e.get('world_size')} ranks) "
                f"{e.get('seconds')} s after the {e.get('since')}")
    if kind == "hang":
        return f"hang detected at step {e.get('step')}: suspected rank(s) {e.get('suspects')} on {e.get('nodes')}"
    if kind == "stopped":
        return f"stopped at step {e.get('step')} by {e.get('reason')} (checkpoint saved)"
    if kind == "gave_up":
        return f"gave up: {e.get('reason') or e.get('cause')}"
    return None


class EventPrinter:
    """Prints the run's new lifecycle events (``events.jsonl`` from its size at construction)."""

    def __init__(self, run_dir: Path, out=sys.stdout):
        self.path, self.out = run_dir / "events.jsonl", out
        self.pos = self.path.stat().st_size if self.path.is_file() else 0

    def drain(self) -> None:
        if not self.path.is_file():
            return
        with open(self.path) as f:
            f.seek(self.pos)
            for line in f:
                if not line.endswith("\n"):
                    break
                self.pos += len(line.encode())
                try:
                    text = format_event(json.loads(line))
                except json.JSONDecodeError:
                    continue
                if text:
                    print(f"event: {text}", file=self.out, flush=True)


def follow(job: Any, cfg: Config, since: float, out=sys.stdout, events: EventPrinter | None = None,
           wait_queue: bool = True) -> str:
    """Print new metrics lines and lifecycle events until the job ends; returns the job's final
    status string. ``wait_queue``: on SLURM, the run is over only once the job has left the
    queue (False for an srun step inside an allocation, whose job goes on).

    Raises:
        Exception: the job failed (submitit's error; :func:`failure` says why in a few lines).
    """
    events = events or EventPrinter(cfg.run_dir, out)
    metrics = cfg.run_dir / "metrics.jsonl"
    pos, inode, newest = 0, None, since
    last_print = time.time()

    def drain() -> None:
        nonlocal pos, inode, newest, last_print
        if not metrics.is_file():
            return
        with open(metrics) as f:
            if os.fstat(f.fileno()).st_ino != inode:
                # A resumed attempt rewrote the file without the steps after its checkpoint: read
                # it again, printing only records newer than the last one printed.
                pos, inode = 0, os.fstat(f.fileno()).st_ino
            f.seek(pos)
            for line in f:
                if not line.endswith("\n"):
                    break
                pos += len(line.encode())
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("time", 0) > newest:
                    newest = rec["time"]
                    print(format_metrics(rec, cfg.train.steps), file=out, flush=True)
                    last_print = time.time()

    def ended() -> bool:
        # submitit calls a job done when a result file exists (a rank of a requeued attempt may
        # have written its error) or when sacct once said NODE_FAIL (it caches that): on SLURM the
        # run is over only once the job has left the queue, where a requeued job stays.
        return job.done() and (cfg.launch.cluster != "slurm" or not wait_queue or
                               not slurm_job_queued(str(job.job_id)))

    warned: set[str] = set()
    last_health = time.time()
    while not ended():
        drain()
        events.drain()
        if time.time() - last_health > 15:  # the monitor's view: stalls, hangs, requeues
            last_health = time.time()
            for w in collect(cfg.run_dir).warnings:
                if w not in warned:
                    warned.add(w)
                    print(f"WARNING: {w}", file=out, flush=True)
        if time.time() - last_print > 60:
            print(f"... job {job.job_id} state {job.state}", file=out, flush=True)
            last_print = time.time()
        time.sleep(1.0)
    drain()
    events.drain()
    if cfg.launch.elastic is not None:
        # An elastic run's last attempt may have had fewer tasks than the job was submitted with:
        # the missing tasks left no result. Rank 0's result is the run's.
        return str(job.task(0).result())
    results = job.results()  # raises on failure, with the remote traceback
    return str(results[0])


def failure(cfg: Config, job: Any, error: BaseException) -> Diagnosis:
    """Why the job failed, from the failure records of its last attempt
    (:func:`moetrain.train.records.diagnose`); without any record (the job never started, was
    cancelled), submitit's message."""
    records = read_failures(cfg.run_dir, str(job.job_id))
    if records:
        return diagnose(records, cfg.world_size)
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return Diagnosis(f"job {job.job_id} failed before any rank recorded why: {first}", False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.explain:  # the layers alone: no data, weights or cluster consulted
            cfg, layers = load_layers(args.config, args.overrides)
            print(explain(layers, cfg, args.explain))
            return 0
        cfg, layers, alloc = load_and_resolve(args)
        if alloc is not None and args.detach:
            raise ConfigError(f"--detach: submit runs inside SLURM allocation {alloc.job_id}, which ends when the "
                              "command holding it (salloc, your batch script) returns, and the run with it. Fix: "
                              "drop --detach, or --set launch.allocation=new to submit a job of its own")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    run_dir = cfg.run_dir
    folder = run_dir / "logs"
    if args.dry_run:
        try:
            print(dry_run(cfg, folder, layers, alloc))
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        return 0
    from moetrain.launch.job import job_config
    from moetrain.launch.task import TrainJob

    executor = None
    if alloc is None:
        try:
            executor = make_executor(cfg, folder)
        except ConfigError as e:  # the cluster changed since the preflight's query
            print(f"config error: {e}", file=sys.stderr)
            return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml", layers)
    events = EventPrinter(run_dir)
    # Restarted by this command: local runs, and runs inside an allocation (no requeue there).
    relaunches = cfg.launch.cluster == "local" or alloc is not None
    restart = 0
    while True:
        since = time.time()
        if alloc is not None:
            job = StepJob(step_script(cfg, alloc, restart, folder.resolve()), alloc.job_id,
                          folder / f"{alloc.job_id}.{restart}_srun.err")
            record_submission(run_dir, f"{alloc.job_id}.{restart}", cfg)
            started = (f"inside SLURM allocation {alloc.job_id}: started srun step (attempt {restart}, "
                       f"{cfg.world_size} tasks); no new job is submitted")
            logs = f"{folder}/{alloc.job_id}.{restart}_<rank>.out"
        else:
            with _children_stderr(folder / "controller.err", cfg.launch.cluster == "local"):
                job = executor.submit(TrainJob(job_config(cfg), restart=restart))
            record_submission(run_dir, str(job.job_id), cfg)
            started = f"submitted job {job.job_id} ({cfg.launch.cluster}, {cfg.world_size} tasks)"
            logs = f"{folder}/{job.job_id}_<rank>_log.out"
        print(f"{started}\n  run directory: {run_dir}\n  config:        {run_dir / 'config.yaml'}\n"
              f"  metrics:       {run_dir / 'metrics.jsonl'}\n  logs:          {logs}", flush=True)
        register_job(str(job.job_id), run_dir)
        if args.detach:
            if cfg.launch.cluster == "local":
                # A local job is cancelled when its handle is garbage-collected; keep it running.
                from moetrain.internals import keep_local_job  # imports torch: only where used

                keep_local_job(job)
                print("detached; the run goes on (a local run is restarted after a failure only by a "
                      "command that follows it)", flush=True)
            else:
                print("detached; the run goes on", flush=True)
            return 0
        try:
            status = follow(job, cfg, since, events=events, wait_queue=alloc is None)
        except KeyboardInterrupt:
            print("\ninterrupted: cancelling the run (use --detach to leave it running)", file=sys.stderr)
            job.cancel()
            return 130
        except Exception as e:  # noqa: BLE001 - submitit re-raises the task's failure
            why = failure(cfg, job, e)
            print("run failed: " + "\n".join(why.lines()), file=sys.stderr, flush=True)
            if relaunches and why.restartable:
                if restart < cfg.launch.max_restarts:
                    restart += 1
                    append_event(run_dir, None, "restart", restart=restart, max_restarts=cfg.launch.max_restarts,
                                 cause=why.cause, job_id=str(job.job_id))
                    events.drain()
                    continue
                reason = f"launch.max_restarts={cfg.launch.max_restarts} reached"
                append_event(run_dir, None, "gave_up", cause=why.cause, reason=reason)
                events.drain()
            print(f"  all logs: {folder}", file=sys.stderr, flush=True)
            return 1
        if status == "stopped" and alloc is not None:
            print(f"run stopped inside allocation {alloc.job_id} (checkpoint saved): an allocation cannot be "
                  "requeued by moetrain; run the same submit command again to resume", flush=True)
        print(f"run {status}: {run_dir}", flush=True)
        return 0 if status == "done" else 3

if __name__ == "__main__":
    sys.exit(main())
