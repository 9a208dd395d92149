"""Tokenize a corpus on many nodes: a :class:`~moetrain.data.pipeline.TokenizeJob` as a SLURM array.

1. **groups** — :meth:`TokenizeJob.groups` cuts the input units into ``tasks`` groups of about
   equal bytes (deterministic: the same groups on every submission).
2. **array** — one array task per group (submitit ``map_array``), each running
   ``TokenizeJob.run(group=(g, tasks))`` with its CPUs as local worker processes and writing the
   per-unit parts and completion records into the output directory (a shared filesystem). The
   tasks are submitit ``Checkpointable``: on preemption or the pre-timeout signal SLURM
   requeues them, and the requeued task skips the units already recorded.
3. **merge** — once every task ended: here (:func:`wait_and_merge`), or as a one-task SLURM job
   that depends on the array (``afterok``, cancelled if a task fails) when the caller detaches.

Why our own fan-out on submitit rather than a pipeline library such as datatrove's
``SlurmPipelineExecutor``: the output must be this repository's shards (same files and manifest
as a local run, validation split by stream position), which datatrove's tokenizer does not
write (it has its own ``.ds`` files and a shuffling merger); its completion marks are per task,
so a preempted task redoes all its files, where our records are per input unit; and submitit is
already the project's SLURM layer, tested against ``slurm/dev-cluster``. The fan-out is the
small part; the parts/records/merge design carries over unchanged.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import submitit
from tqdm import tqdm

from moetrain.data.pipeline import TokenizeJob, UnitsFailed
from moetrain.utils import check_sbatch_safe  # the same injection guard as the trainer's jobs

__all__ = ["ArraySubmission", "submit_array", "wait_and_merge"]


class _ArrayTask(submitit.helpers.Checkpointable):
    """One array task: the units of group ``g``. Checkpointable's default ``checkpoint``
    resubmits the same call, which is all a resume needs (the records are on disk)."""

    def __call__(self, job: TokenizeJob, g: int, tasks: int, workers: int | None) -> dict:
        summary = job.run(workers=workers, progress=False, group=(g, tasks))
        return {"group": g, "node": os.environ.get("SLURMD_NODENAME"), "units": summary.units,
                "already_done": summary.already_done, "tokenized": summary.tokenized,
                "tokens": summary.tokens, "seconds": round(summary.seconds, 1)}


def _merge(job: TokenizeJob) -> dict:
    manifest = job.merge(progress=False)
    return {"total_tokens": manifest["total_tokens"], "total_documents": manifest["total_documents"]}


@dataclass
class ArraySubmission:
    """The submitted array (``tasks``: one submitit job per task) and, when detached, the
    merge job that depends on it."""

    array_id: str
    tasks: list
    merge: submitit.Job | None = None


def submit_array(job: TokenizeJob, *, tasks: int, folder: str | os.PathLike, cpus_per_task: int = 4,
                 time_min: int = 24 * 60, partition: str | None = None, workers: int | None = None,
                 max_requeues: int = 3, detach: bool = False) -> ArraySubmission:
    """Submit the pending units of ``job`` as a SLURM array of ``tasks`` tasks (one node each).

    Args:
        folder: submitit's folder (batch scripts, logs, pickles).
        cpus_per_task: CPUs per task; its worker processes default to this many.
        time_min: time limit per task in minutes; a task that reaches it (or is preempted) is
            requeued, up to ``max_requeues`` times, and resumes from its records.
        partition: SLURM partition (checked for shell-safe characters); ``None``: the default.
        workers: processes per task; ``None``: ``cpus_per_task``.
        detach: also submit the merge as a SLURM job that runs after every task succeeded.

    Raises:
        ValueError: ``tasks`` < 1. moetrain.utils.ConfigError: an unsafe partition name.
        submitit errors: sbatch refused the job (the message is SLURM's).
    """
    if tasks < 1:
        raise ValueError(f"tasks={tasks}: must be >= 1")
    if partition is not None:
        check_sbatch_safe("partition", "--slurm-partition", partition)
    tasks = min(tasks, max(1, len(job.units)))
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=max_requeues)
    params = dict(name="moetrain-tokenize", nodes=1, tasks_per_node=1, cpus_per_task=cpus_per_task,
                  timeout_min=time_min, slurm_array_parallelism=tasks,
                  slurm_additional_parameters={"requeue": True})
    if partition is not None:
        params["slurm_partition"] = partition
    executor.update_parameters(**params)
    jobs = executor.map_array(_ArrayTask(), [job] * tasks, list(range(tasks)), [tasks] * tasks,
                              [workers] * tasks)
    array_id = jobs[0].job_id.split("_")[0]
    merge = None
    if detach:
        merge_ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
        merge_params = {k: v for k, v in params.items() if k != "slurm_array_parallelism"}
        merge_params.update(name="moetrain-tokenize-merge", cpus_per_task=1, slurm_additional_parameters={
            "dependency": f"afterok:{array_id}", "kill_on_invalid_dep": "yes"})
        merge_ex.update_parameters(**merge_params)
        merge = merge_ex.submit(_merge, job)
    return ArraySubmission(array_id, jobs, merge)


def wait_and_merge(job: TokenizeJob, submission: ArraySubmission, *, progress: bool = True,
                   poll_s: float = 2.0) -> dict:
    """Follow the array (a bar of finished inputs), then merge here; return the manifest.

    Raises:
        UnitsFailed: a task failed; each failure names the task, its log and its last error
            line (which names the file). The finished units keep their records.
    """
    total = len(job.units)
    bar = tqdm(total=total, unit=" inputs", dynamic_ncols=True, disable=not progress,
               desc=f"SLURM array {submission.array_id} ({len(submission.tasks)} tasks)")
    try:
        while True:
            finished = all(t.done() for t in submission.tasks)
            bar.n = total - len(job.pending())
            bar.refresh()
            if finished:
                break
            time.sleep(poll_s)
    finally:
        bar.close()
    failures = []
    for g, t in enumerate(submission.tasks):
        error = t.exception()
        if error is not None:
            lines = [ln for ln in str(error).splitlines() if ln.strip()]
            failures.append((f"array task {g}", f"array task {g} ({t.job_id}, log {Path(t.paths.stderr)}): "
                                                f"{lines[-1] if lines else error}"))
    if failures:
        raise UnitsFailed(failures, len(submission.tasks), "array tasks")
    return job.merge(progress=progress)
