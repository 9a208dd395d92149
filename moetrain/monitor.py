"""``python -m moetrain.monitor RUN_DIR_OR_JOB_ID [--follow] [--format text|json] [--plot OUT.png] [--environment]
[--profile] [--compare RUN ...]`` or ``python -m moetrain.monitor --list``

Shows a run's health from outside the job: its SLURM state (sacct, every requeued instance),
restarts and their causes (``events.jsonl``), training progress (``metrics.jsonl``: step / total
with a bar, loss, tokens/s, time to finish), the latest attempt's environment in a few lines
(code commit, Python, torch, CUDA, nodes, GPUs), every rank's heartbeat, and a warning when the
run is stalled or failing. ``--environment`` prints the latest attempt's whole environment record
instead: versions, the git state, and the variables of rank 0 and of every rank that saw others.
A job id is mapped to its run directory through the registry that ``moetrain.submit`` appends to
(``$MOETRAIN_HOME/jobs.jsonl``, default ``~/.cache/moetrain``).
``--plot OUT.png`` draws the run's loss and validation loss, tokens/s and each MoE layer's
max/mean expert load against step (matplotlib, the ``plot`` extra). ``--profile`` sums up the
traces of ``train.profile`` (:mod:`moetrain.train.profile`). ``--list`` shows every run of the
registry, newest first, with its state, step, loss and last event; ``--compare RUN ...`` puts the
target and other runs side by side (last loss, mean of the last 10, validation loss, tokens/s,
step time) and, with ``--plot``, their loss and throughput curves in one figure.
Exit status: 0 running or done, 1 failing / gave up, 2 stalled (or ``--plot`` without
matplotlib, or ``--environment`` before any attempt recorded one), 4 unknown run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from moetrain.train.environment import (RANK_IDENTITY, read_environment, read_rank_environments,
                                        summarize_environment)
from moetrain.train.metrics import format_duration
from moetrain.train.records import read_events, read_heartbeats, read_json, read_jsonl


def registry_path() -> Path:
    return Path(os.environ.get("MOETRAIN_HOME", Path.home() / ".cache" / "moetrain")) / "jobs.jsonl"


def register_job(job_id: str, run_dir: Path) -> None:
    """Remember which run directory a job id belongs to (for ``monitor JOB_ID``)."""
    path = registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"job_id": str(job_id), "run_dir": str(Path(run_dir).resolve()), "time": time.time()}) + "\n")


def resolve_run_dir(target: str) -> Path | None:
    p = Path(target)
    if p.is_dir():
        return p
    path = registry_path()
    if path.is_file():
        for line in reversed(path.read_text().splitlines()):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("job_id") == target or str(rec.get("job_id", "")).split("_")[0] == target:
                return Path(rec["run_dir"])
    return None


def sacct_states(job_ids: list[str]) -> list[dict]:
    """Every instance (requeues included, ``sacct -D``) of the jobs; [] without SLURM accounting."""
    if not job_ids or shutil.which("sacct") is None:
        return []
    try:
        out = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", ",".join(job_ids),
                              "-o", "JobID,State,ExitCode,Start,End,NodeList"],
                             capture_output=True, text=True, timeout=30)
    except (subprocess.SubprocessError, OSError):
        return []
    rows = []
    for line in out.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 6:
            rows.append(dict(zip(("job_id", "state", "exit_code", "start", "end", "nodes"), parts)))
    return rows


def slurm_job_queued(job_id: str) -> bool:
    """Whether SLURM still lists the job (pending, running, completing): a requeued job is."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (subprocess.SubprocessError, OSError):
        return False
    return out.returncode == 0 and bool(out.stdout.strip())


@dataclass
class Status:
    run_dir: str
    total_steps: int | None
    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    median_step_s: float | None = None
    jobs: list[dict] = field(default_factory=list)
    restarts: list[dict] = field(default_factory=list)
    heartbeats: list[dict] = field(default_factory=list)
    environment_attempt: int | None = None  # the latest attempt that recorded its environment
    environment: list[str] = field(default_factory=list)  # its summary (summarize_environment)
    state: str = "unknown"  # running | done | stalled | failing | gave_up | not started
    warnings: list[str] = field(default_factory=list)
    placement: list[str] = field(default_factory=list)  # moe.eplb: each MoE layer's latest re-placement


# The events.jsonl kinds shown as "restarts, rollbacks and causes".
LIFECYCLE_EVENTS = ("stopped", "requeue", "restart", "hang", "checkpoint_skipped", "replanned", "resumed", "gave_up",
                    "rolled_back")


def collect(run_dir: Path, now: float | None = None) -> Status:
    now = time.time() if now is None else now
    cfg = read_config(run_dir)
    total = cfg.get("train", {}).get("steps") if cfg else None
    st = Status(run_dir=str(run_dir), total_steps=total)
    records = read_metrics(run_dir)
    if records:
        last = records[-1]
        st.step, st.loss, st.tokens_per_s = last["step"], last["loss"], last.get("tokens_per_s")
        times = [r["step_time_s"] for r in records[-50:] if "step_time_s" in r]
        if times:
            st.median_step_s = statistics.median(times)
            if total:
                st.eta_s = max(0, total - st.step) * st.median_step_s
    events = read_events(run_dir)
    st.restarts = [e for e in events if e["event"] in LIFECYCLE_EVENTS]
    sub = read_json(run_dir / "submission.json", {}) or {}
    ids = [j["job_id"] for j in sub.get("jobs", [])]
    st.jobs = sacct_states(ids)
    st.heartbeats = read_heartbeats(run_dir)
    env = read_environment(run_dir)
    if env is not None:
        st.environment_attempt, st.environment = env.get("attempt"), summarize_environment(env)
    launch = (cfg or {}).get("launch", {})
    factor = launch.get("heartbeat_timeout_factor", 10.0)
    min_timeout = launch.get("heartbeat_min_timeout_s", 120.0)
    limit = max(min_timeout, factor * (st.median_step_s or 0))

    kinds = [e["event"] for e in events]
    if kinds and kinds[-1] == "finished":
        st.state = "done"
    elif kinds and kinds[-1] == "gave_up":
        st.state = "gave_up"
        st.warnings.append(f"the run gave up: {events[-1].get('reason', events[-1].get('cause', ''))}")
    elif not events and not st.heartbeats:
        st.state = "not started"
    else:
        st.state = "running"
    # The latest instance that ran: sacct may list a requeued instance as PENDING (or not at all)
    # until it starts, so until then the failed one is the latest that ran.
    ran = [j for j in st.jobs if j["state"].split()[0] not in ("PENDING", "REQUEUED")]
    if ran and ran[-1]["state"].split()[0] in ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL") \
            and st.state not in ("done", "gave_up"):
        last = ran[-1]
        if slurm_job_queued(last["job_id"]):
            st.warnings.append(f"job {last['job_id']} was {last['state']} on {last['nodes']}: requeued, "
                               f"waiting to restart")
        else:
            st.state = "failing"
            st.warnings.append(f"job {last['job_id']} is {last['state']}")
    live = [h for h in st.heartbeats if h.get("phase") not in ("done",)]
    if st.state == "running" and live:
        newest_attempt = max(h.get("attempt", 0) for h in live)
        current = [h for h in live if h.get("attempt", 0) == newest_attempt]
        stale = [h for h in current if now - h["time"] > limit]
        if stale:
            st.state = "stalled"
            ranks = ", ".join(f"{h['rank']}@{h['host']}" for h in stale[:8])
            st.warnings.append(f"no heartbeat for more than {limit:.0f} s from rank(s) {ranks}")
    st.placement = placement_lines(events, records[-1] if records else None)
    hangs = [e for e in events if e["event"] == "hang"]
    if hangs:
        st.warnings.append(f"{len(hangs)} hang(s) detected; suspected nodes {hangs[-1].get('nodes')}; "
                           f"stacks in {run_dir / 'stacks'}")
    return st


def placement_lines(events: list[dict], last_record: dict | None) -> list[str]:
    """One line per MoE layer for EPLB (``moe.eplb``): its latest ``replaced`` event — the
    experts that changed rank and each ep rank's tokens over the window before and after (or why
    the move was skipped) — and the busiest rank as the latest step measured it."""
    latest: dict[str, dict] = {}
    for e in events:
        if e["event"] == "replaced":
            latest[str(e["layer"])] = e
    measured = (last_record or {}).get("expert_load", {})

    def ranks(xs: list[float]) -> str:
        return "[" + " ".join(f"{x:.0f}" for x in xs) + "]"

    out = []
    for layer in sorted(latest, key=lambda n: (len(n), n)):
        e = latest[layer]
        if e.get("skipped"):
            line = f"layer {layer}: step {e['step']} skipped ({e['skipped']})"
        else:
            line = (f"layer {layer}: step {e['step']} moved experts {e['moved']} ({e['slots_moved']} slots); tokens "
                    f"per ep rank over the window {ranks(e['rank_tokens_before'])} → {ranks(e['rank_tokens_after'])}, "
                    f"busiest {e['busiest_over_mean_before']:.2f}× → {e['busiest_over_mean_after']:.2f}× the mean")
        now = measured.get(layer, {}).get("rank_max_over_mean")
        if now is not None:
            line += f"; step {last_record['step']}: busiest {now:.2f}×"
        out.append(line)
    return out


def registered_runs() -> list[dict]:
    """The runs of the job registry, newest submission first: ``run_dir``, its ``job_ids`` (in
    submission order) and the ``time`` of the latest submission."""
    path = registry_path()
    runs: dict[str, dict] = {}
    for rec in read_jsonl(path):
        if "run_dir" not in rec:
            continue
        run = runs.setdefault(rec["run_dir"], {"run_dir": rec["run_dir"], "job_ids": [], "time": 0.0})
        run["job_ids"].append(str(rec.get("job_id")))
        run["time"] = max(run["time"], float(rec.get("time", 0.0)))
    return sorted(runs.values(), key=lambda r: -r["time"])


def run_list(limit: int = 50) -> list[dict]:
    """One row per registered run (:func:`registered_runs`, at most ``limit``): ``run_dir``,
    ``jobs``, ``submitted`` (epoch s), ``state`` (:func:`collect`'s, ``missing`` when the
    directory is gone), ``step`` / ``total_steps``, the last ``loss`` and the ``last_event``."""
    rows = []
    for run in registered_runs()[:limit]:
        d = Path(run["run_dir"])
        row = {"run_dir": run["run_dir"], "jobs": run["job_ids"], "submitted": run["time"]}
        if not d.is_dir():
            rows.append({**row, "state": "missing", "step": None, "total_steps": None, "loss": None,
                         "last_event": None})
            continue
        st = collect(d)
        events = read_events(d)
        rows.append({**row, "state": st.state, "step": st.step, "total_steps": st.total_steps, "loss": st.loss,
                     "last_event": events[-1]["event"] if events else None})
    return rows


def render_run_list(rows: list[dict]) -> str:
    if not rows:
        return f"no runs in {registry_path()} (moetrain.submit records each submission there)"
    lines = [f"{'submitted':<17} {'state':<11} {'step':>13} {'loss':>8}  {'last event':<18} run (jobs)"]
    for r in rows:
        step = f"{r['step']}/{r['total_steps'] or '?'}" if r["step"] is not None else "-"
        loss = f"{r['loss']:.4f}" if isinstance(r["loss"], (int, float)) else "-"
        lines.append(f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(r['submitted'])):<17} {r['state']:<11} "
                     f"{step:>13} {loss:>8}  {r['last_event'] or '-':<18} {r['run_dir']} "
                     f"({', '.join(r['jobs'][-3:])})")
    return "\n".join(lines)


def compare_runs(run_dirs: list[Path]) -> list[dict]:
    """One row per run: ``run_dir``, ``steps`` (the last step logged), ``loss`` (the last),
    ``loss_last10`` (the mean of the last 10 steps), ``val_loss`` (the last evaluated, None
    without), ``tokens_per_s`` and ``step_s`` (medians over the last 50 steps).

    Raises:
        ValueError: a run with no metrics yet.
    """
    rows = []
    for d in run_dirs:
        records = read_metrics(d)
        if not records:
            raise ValueError(f"{d / 'metrics.jsonl'}: no metrics yet")
        tail = records[-50:]
        val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
        tok = [r["tokens_per_s"] for r in tail if r.get("tokens_per_s")]
        dt = [r["step_time_s"] for r in tail if r.get("step_time_s")]
        rows.append({"run_dir": str(d), "steps": records[-1]["step"], "loss": records[-1]["loss"],
                     "loss_last10": statistics.fmean(r["loss"] for r in records[-10:]),
                     "val_loss": val[-1] if val else None,
                     "tokens_per_s": statistics.median(tok) if tok else None,
                     "step_s": statistics.median(dt) if dt else None})
    return rows


def render_comparison(rows: list[dict]) -> str:
    lines = [f"{'steps':>7} {'loss':>8} {'last 10':>8} {'val loss':>9} {'tokens/s':>10} {'step s':>8}  run"]
    for r in rows:
        def num(v, fmt):
            return format(v, fmt) if v is not None else "-"
        lines.append(f"{r['steps']:>7} {r['loss']:>8.4f} {r['loss_last10']:>8.4f} {num(r['val_loss'], '.4f'):>9} "
                     f"{num(r['tokens_per_s'], '.0f'):>10} {num(r['step_s'], '.3f'):>8}  {r['run_dir']}")
    return "\n".join(lines)


def plot_comparison(run_dirs: list[Path], out: Path) -> Path:
    """Loss (and validation loss) and tokens/s of several runs against step, in one figure.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (the ``plot`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tok) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for d in run_dirs:
        records = read_metrics(d)
        steps = [r["step"] for r in records]
        line, = ax_loss.plot(steps, [r["loss"] for r in records], label=str(d))
        val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        if val:
            ax_loss.plot(*zip(*val), "o--", color=line.get_color())
        ax_tok.plot(steps, [r.get("tokens_per_s", float("nan")) for r in records], color=line.get_color())
    ax_loss.set_ylabel("loss (dashed: validation)")
    ax_loss.legend(fontsize="small")
    ax_tok.set_ylabel("tokens/s")
    ax_tok.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl`` (a partly written last line is skipped)."""
    return read_jsonl(run_dir / "metrics.jsonl")


def plot(run_dir: Path, out: Path) -> Path:
    """Draw loss and validation loss, tokens/s and max/mean expert load per MoE layer (with
    ep > 1 the busiest ep rank's tokens over the mean beside it, dashed; ``moe.eplb``'s
    re-placements as dotted vertical lines) against step into ``out`` (PNG, or any format
    matplotlib infers from the suffix).

    Raises:
        ModuleNotFoundError: matplotlib is not installed (the ``plot`` extra).
        ValueError: the run has no metrics yet.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no metrics yet")
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_tok, ax_load) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax_loss.plot(steps, [r["loss"] for r in records], label="train loss")
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if val:
        ax_loss.plot(*zip(*val), "o-", label="validation loss")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_tok.plot(steps, [r.get("tokens_per_s", float("nan")) for r in records])
    ax_tok.set_ylabel("tokens/s")
    for layer in records[-1].get("expert_load", {}):
        def series(key: str) -> list[float]:
            return [r.get("expert_load", {}).get(layer, {}).get(key, float("nan")) for r in records]

        line, = ax_load.plot(steps, series("max_over_mean"), label=f"layer {layer}")
        if "rank_max_over_mean" in records[-1]["expert_load"][layer]:  # ep > 1: the busiest ep rank, dashed
            ax_load.plot(steps, series("rank_max_over_mean"), "--", color=line.get_color())
    for step in sorted({r["step"] for r in records if r.get("eplb_replaced")}):  # moe.eplb's re-placements
        ax_load.axvline(step, color="grey", lw=0.5, ls=":")
    ax_load.axhline(1.0, color="grey", lw=0.5)
    ax_load.set_ylabel("expert load max/mean\n(dashed: busiest ep rank)")
    ax_load.set_xlabel("step")
    if records[-1].get("expert_load"):
        ax_load.legend(fontsize="small", ncol=4)
    fig.suptitle(f"{run_dir}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def read_config(run_dir: Path) -> dict | None:
    try:
        return yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None


def _bar(step: int, total: int | None, width: int = 30) -> str:
    if not total:
        return ""
    filled = int(width * min(1.0, step / total))
    return "[" + "#" * filled + "-" * (width - filled) + f"] {step}/{total}"




def render(st: Status, now: float | None = None) -> str:
    now = time.time() if now is None else now
    lines = [f"run {st.run_dir}: {st.state.upper()}"]
    if st.jobs:
        lines.append("slurm: " + "; ".join(f"{j['job_id']} {j['state']} on {j['nodes']}" for j in st.jobs[-6:]))
    lines.append(f"progress {_bar(st.step, st.total_steps)}"
                 + (f" | loss {st.loss:.4f}" if st.loss is not None else "")
                 + (f" | {st.tokens_per_s:.0f} tok/s" if st.tokens_per_s else "")
                 + (f" | {format_duration(st.median_step_s)}/step" if st.median_step_s else "")
                 + (f" | eta {format_duration(st.eta_s)}" if st.eta_s is not None else ""))
    if st.restarts:
        lines.append("restarts, rollbacks and causes:")
        for e in st.restarts[-10:]:
            detail = e.get("message") or ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("time", "event"))
            lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['event']}: {detail}")
    if st.environment:
        lines.append(f"environment (attempt {st.environment_attempt}):")
        lines.extend(f"  {line}" for line in st.environment)
    if st.heartbeats:
        lines.append("heartbeats:")
        for h in st.heartbeats[:16]:
            lines.append(f"  rank {h['rank']:>4} {h['host']:<12} attempt {h.get('attempt')} step {h['step']:>6} "
                         f"{h['phase']:<10} {now - h['time']:6.0f} s ago")
        if len(st.heartbeats) > 16:
            lines.append(f"  ... {len(st.heartbeats) - 16} more ranks")
    if st.placement:
        lines.append("expert placement (moe.eplb), each MoE layer's latest re-placement:")
        lines.extend(f"  {line}" for line in st.placement)
    for w in st.warnings:
        lines.append(f"WARNING: {w}")
    return "\n".join(lines)


def _rank_list(ranks: list[int]) -> str:
    """``0-7, 9, 12-15``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _rank_facts(rec: dict) -> dict[str, str]:
    """What a rank saw that should be alike on every rank: its variables (less those naming the
    rank itself), torch's thread count and its GPU model."""
    facts = {k: v for k, v in (rec.get("variables") or {}).items() if k not in RANK_IDENTITY}
    facts["(torch threads)"] = str(rec.get("torch_threads"))
    facts["(gpu)"] = str(rec.get("gpu"))
    return facts


def render_environment(run_dir: Path, attempt: int | None = None) -> str | None:
    """The whole environment record of ``attempt`` (None: the latest) as text: the summary, the
    git state, every version, rank 0's variables and, grouped, the ranks that saw other values
    (or other variables) than rank 0. None when no attempt recorded its environment."""
    rec = read_environment(run_dir, attempt)
    if rec is None:
        return None
    attempt = rec.get("attempt")
    git = rec.get("git") or {}
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["time"])) if rec.get("time") else "?"
    lines = [f"environment of attempt {attempt} (recorded {when} on {rec.get('host')}):"]
    lines += [f"  {line}" for line in summarize_environment(rec)]
    lines.append(f"git: {git.get('source_dir')}: commit {git.get('commit') or '-'}"
                 + (f" ({git['reason']})" if git.get("reason") else ""))
    if git.get("dirty"):
        lines.append(f"  dirty; diff: {git.get('diff_file') or 'none of tracked files'}"
                     + (f" ({git.get('diff_bytes', 0):,} bytes, cut)" if git.get("diff_cut") else ""))
        lines += [f"  {line}" for line in git.get("status") or []]
    lines.append(f"python {rec.get('python')} ({rec.get('python_executable')})")
    lines.append("packages: " + (", ".join(f"{k} {v}" for k, v in (rec.get("packages") or {}).items()) or "-"))
    lines.append(f"CUDA {rec.get('cuda') or '-'}, NCCL {rec.get('nccl') or '-'}, cuDNN {rec.get('cudnn') or '-'}, "
                 f"driver {rec.get('driver') or '-'}")
    ranks = read_rank_environments(run_dir, attempt)
    by_rank = {r["rank"]: r for r in ranks}
    zero = by_rank.get(0)
    if zero is None:
        lines.append("rank 0 recorded no variables")
        return "\n".join(lines)
    lines.append(f"rank 0 ({zero.get('host')}, pid {zero.get('pid')}, local rank {zero.get('local_rank')}, "
                 f"{zero.get('torch_threads')} torch threads, GPU {zero.get('gpu') or '-'}):")
    lines += [f"  {k}={v}" for k, v in (zero.get("variables") or {}).items()] or ["  (none of the recorded names set)"]
    base = _rank_facts(zero)
    groups: dict[tuple, list[int]] = {}
    for r in ranks:
        facts = _rank_facts(r)
        diff = tuple(sorted((k, facts.get(k), base.get(k)) for k in set(facts) | set(base)
                            if facts.get(k) != base.get(k)))
        if diff:
            groups.setdefault(diff, []).append(r["rank"])
    lines.append(f"{len(ranks)} rank(s) recorded; "
                 + ("every other rank saw what rank 0 saw" if not groups
                    else f"{sum(len(g) for g in groups.values())} saw something else:"))
    for diff, members in groups.items():
        hosts = sorted({by_rank[m].get("host") for m in members})
        shown = "; ".join(f"{k}={'unset' if v is None else v} (rank 0: {'unset' if v0 is None else v0})"
                          for k, v, v0 in diff)
        lines.append(f"  rank(s) {_rank_list(members)} on {', '.join(hosts[:4])}{' ...' if len(hosts) > 4 else ''}: "
                     f"{shown}")
    return "\n".join(lines)


EXIT = {"running": 0, "done": 0, "not started": 0, "stalled": 2, "failing": 1, "gave_up": 1}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moetrain.monitor", description=__doc__.split("\n\n")[1])
    ap.add_argument("target", nargs="?", help="run directory or SLURM job id")
    ap.add_argument("--list", action="store_true",
                    help="the runs this user submitted (the job registry), newest first: state, step, loss, last "
                         "event")
    ap.add_argument("--compare", nargs="+", metavar="RUN",
                    help="compare the target with these runs (directories or job ids): a table of losses and "
                         "throughput, and with --plot their curves in one figure")
    ap.add_argument("--follow", action="store_true", help="refresh until the run ends")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes with --follow")
    ap.add_argument("--format", choices=("text", "json"), default="text")
    ap.add_argument("--plot", metavar="OUT.png", type=Path,
                    help="draw loss, validation loss, tokens/s and expert load against step, then exit")
    ap.add_argument("--profile", action="store_true",
                    help="sum up the traces of train.profile: per rank, each profiled step's time in compute, "
                         "communication nothing overlapped, and idle, then exit")
    ap.add_argument("--environment", action="store_true",
                    help="print the latest attempt's recorded environment (versions, git state, each rank's "
                         "variables where they differ from rank 0's), then exit")
    args = ap.parse_args(argv)
    if args.list:
        rows = run_list()
        print(json.dumps(rows) if args.format == "json" else render_run_list(rows))
        return 0
    if args.target is None:
        ap.error("give a run directory or job id (or --list)")
    targets = [args.target, *(args.compare or [])]
    dirs = [resolve_run_dir(t) for t in targets]
    for t, d in zip(targets, dirs):
        if d is None:
            print(f"monitor: {t!r} is neither a run directory nor a job id known to {registry_path()}",
                  file=sys.stderr)
            return 4
    run_dir = dirs[0]
    if args.compare or args.plot is not None:
        try:
            rows = compare_runs(dirs) if args.compare else None
            if args.plot is not None:
                wrote = plot_comparison(dirs, args.plot) if args.compare else plot(run_dir, args.plot)
        except ModuleNotFoundError:
            print("monitor: --plot needs matplotlib. Fix: pip install 'moetrain[plot]'", file=sys.stderr)
            return 2
        except ValueError as e:
            print(f"monitor: {e}", file=sys.stderr)
            return 2
        if rows is not None:
            print(json.dumps(rows) if args.format == "json" else render_comparison(rows))
        if args.plot is not None:
            print(f"wrote {wrote}")
        return 0
    if args.profile:
        # Here, not at the top: it imports torch, which submit and a plain monitor do without.
        from moetrain.train.profile import phase_table, render_phase_table

        try:
            rows = phase_table(run_dir)
        except ValueError as e:
            print(f"monitor: {e}", file=sys.stderr)
            return 2
        if not rows:
            print(f"monitor: {run_dir / 'profile'} holds no traces. Fix: set train.profile (e.g. --set "
                  f"'train.profile={{start: 3, steps: 2}}') and run again", file=sys.stderr)
            return 2
        print(json.dumps(rows) if args.format == "json" else render_phase_table(rows))
        return 0
    if args.environment:
        text = render_environment(run_dir)
        if text is None:
            print(f"monitor: {run_dir} has no environment record yet (written when an attempt starts)",
                  file=sys.stderr)
            return 2
        print(text)
        return 0
    while True:
        st = collect(run_dir)
        print(json.dumps(asdict(st)) if args.format == "json" else render(st), flush=True)
        if not args.follow or st.state in ("done", "gave_up", "failing"):
            return EXIT[st.state]
        time.sleep(args.interval)
        if args.format == "text":
            print("-" * 60)


if __name__ == "__main__":
    sys.exit(main())
