"""The dev cluster's emulated inter-node network (`slurm/dev-cluster up --inter-node-mbps R`):
each fake node in its own network namespace, its link to a bridge shaped by tc tbf to R Mbit/s
in both directions. A real 2-node × 2-task gloo job all-reduces, and its inter-node transfers
take size/R while an intra-node one is fast; the profile written for the planner carries R.

The module takes the cluster down and brings it up emulated, then restores it as it found it
(plain and up, in CI) even when a test fails, and checks that no namespace, link or qdisc is
left. Runs as root (it restarts the daemons). ``python -m moetrain.calibrate`` recovers the rate,
and the plan from its profile predicts a run on the same cluster within 20 %; each node's tasks
run on that node's own cores. About 90 s on 2 cores (the calibration and the measured run of the calibrated prediction most of it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import submitit
import yaml

from moetrain.config import to_dict
from moetrain.topology.cluster import load_profile

from conftest import require_slurm_cluster, run_calibrate, tiny_config

pytestmark = pytest.mark.slurm

require_slurm_cluster()

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "slurm" / "dev-cluster")
STATE = Path(os.environ.get("MOETRAIN_SLURM_DIR", "/var/tmp/moetrain-slurm"))
RATE_MBPS = 25          # low, so that a few MB take a measurable time (below)
SIZE = 4_000_000        # bytes per transfer: 1.28 s at 25 Mbit/s, a few ms over loopback
NODES = ("n1", "n2")
NODE_ADDR = {"n1": "10.77.0.11", "n2": "10.77.0.12"}  # slurm/dev-cluster's default subnet

# The jobs' interpreters cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _run(*args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess:
    res = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {res.returncode}\n{res.stdout}\n{res.stderr}")
    return res


def _snapshot() -> dict:
    """What the emulated network touches: namespaces, links, qdiscs, /etc/hosts, slurm.conf.
    (Read without iproute2 where it can be: `up --inter-node-mbps` installs it when missing.)"""
    netns = Path("/var/run/netns")
    conf = STATE / "etc" / "slurm.conf"
    return {"netns": sorted(os.listdir(netns)) if netns.is_dir() else [],
            "links": sorted(os.listdir("/sys/class/net")),
            "qdiscs": _run("tc", "qdisc", "show").stdout.splitlines() if shutil.which("tc") else None,
            "hosts": Path("/etc/hosts").read_text(), "slurm.conf": conf.read_text() if conf.exists() else None}


def _leftovers() -> list[str]:
    """Namespaces, links and qdiscs of the emulated network that exist now."""
    netns = Path("/var/run/netns")
    left = [f"netns {n}" for n in (os.listdir(netns) if netns.is_dir() else []) if n.startswith("moetrain-")]
    left += [f"link {n}" for n in os.listdir("/sys/class/net") if n == "moetrain-br" or re.fullmatch(r"mt-n\d+", n)]
    left += [f"qdisc {q}" for q in _run("tc", "qdisc", "show").stdout.splitlines() if " tbf " in q]
    return left


def _wait_for_empty_queue(timeout_s: float = 30) -> None:
    """`down` cancels every job: wait for others' jobs to end; in CI (which owns the cluster) go on."""
    deadline = time.time() + timeout_s
    while _run("squeue", "-h", "-o", "%i", check=False).stdout.strip():
        if time.time() > deadline:
            if os.environ.get("MOETRAIN_REQUIRE_SLURM") == "1":
                return
            pytest.skip("jobs are queued on the dev cluster, and this test restarts it")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def emulated():
    """The cluster up with the emulated network at RATE_MBPS; the path of the profile it wrote.
    Afterwards, the cluster as it was found (its kind of network included), and nothing left."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test restarts the dev cluster with network namespaces")
    before = _snapshot()
    found = re.search(r"^network: emulated, each node link (\S+) Mbit/s", _run(SCRIPT, "status", check=False).stdout,
                      re.M)
    restore = ["up"] + (["--inter-node-mbps", found.group(1)] if found else [])
    _wait_for_empty_queue()
    try:
        _run(SCRIPT, "down")
        up = _run(SCRIPT, "up", "--inter-node-mbps", str(RATE_MBPS))
        m = re.search(r"^profile: (\S+)$", up.stdout, re.M)
        assert m, f"`up --inter-node-mbps` printed no profile path:\n{up.stdout}\n{up.stderr}"
        yield Path(m.group(1))
    finally:
        down = _run(SCRIPT, "down", check=False)
        again = _run(SCRIPT, "down", check=False)  # idempotent: nothing left to do
        _run(SCRIPT, *restore)
        assert down.returncode == 0 and again.returncode == 0, down.stderr + again.stderr
        assert "emulated network" not in again.stderr, again.stderr
        if not found:
            assert _leftovers() == [], "left behind by the emulated network"
            after = _snapshot()
            if before["qdiscs"] is None:  # no tc before: iproute2 came with `up --inter-node-mbps`
                after["qdiscs"] = None
            assert after == before, "the cluster is not as the test found it"


def _tbf_sent(dev: str, ns: str | None = None) -> tuple[str, int]:
    """The tbf rate on DEV's egress and the bytes it has sent."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["tc", "-s", "qdisc", "show", "dev", dev]
    out = _run(*cmd).stdout
    rate = re.search(r"tbf .*rate (\S+)", out)
    sent = re.search(r"Sent (\d+) bytes", out)
    assert rate and sent, f"no tbf qdisc on {ns or 'root'}:{dev}:\n{out}"
    return rate.group(1), int(sent.group(1))


def test_nodes_live_in_shaped_namespaces(emulated):
    status = _run(SCRIPT, "status").stdout
    assert f"network: emulated, each node link {RATE_MBPS} Mbit/s per direction" in status, status
    for node in NODES:
        assert socket.gethostbyname(node) == NODE_ADDR[node]  # MASTER_ADDR is the first node's name
        assert f"NodeAddr={NODE_ADDR[node]} " in _run("scontrol", "show", "node", node).stdout
        pid = (STATE / "run" / f"slurmd-{node}.pid").read_text().strip()
        assert _run("ip", "netns", "identify", pid).stdout.strip() == f"moetrain-{node}"
        assert _tbf_sent(f"mt-{node}")[0] == f"{RATE_MBPS}Mbit"                 # towards the node
        assert _tbf_sent("moetrain0", f"moetrain-{node}")[0] == f"{RATE_MBPS}Mbit"  # from the node
    # Each node computes on its own share of the host's cores (what its tasks inherit).
    cores = {node: os.sched_getaffinity(int((STATE / "run" / f"slurmd-{node}.pid").read_text())) for node in NODES}
    host = os.sched_getaffinity(0)
    if len(host) >= len(NODES):
        assert not cores["n1"] & cores["n2"] and len(cores["n1"]) == len(cores["n2"]) == len(host) // len(NODES), cores


def test_switching_a_running_cluster_is_refused(emulated):
    res = _run(SCRIPT, "up", check=False)
    assert res.returncode == 1 and "run `slurm/dev-cluster down` first" in res.stderr, res.stderr
    for args, words in ((["--inter-node-mbps", "fast"], "--inter-node-mbps 'fast'"),
                        (["--inter-node-mbps", "50", "--inter-node-latency-ms", "5"], "netem")):
        res = _run(SCRIPT, "up", *args, check=False)
        assert res.returncode == 1 and words in res.stderr, res.stderr


def test_profile_carries_the_rate(emulated):
    prof = load_profile(emulated)
    assert emulated == STATE / "profiles" / "dev-emulated.yaml"
    # Per rank (GPU) and per direction, GB/s: the node link is shared by the node's ranks.
    assert prof.gpus_per_node == prof.nvswitch_domain_gpus == 2
    assert prof.rail_gb_s == pytest.approx(RATE_MBPS / 8000 / prof.gpus_per_node, rel=1e-6)
    assert prof.spine_gb_s == prof.rail_gb_s and prof.name == f"dev-emulated-{RATE_MBPS}mbit"
    committed = load_profile("dev-emulated")  # launch.profile: dev-emulated, at 200 Mbit/s
    assert committed.rail_gb_s == pytest.approx(200 / 8000 / committed.gpus_per_node)
    rate_bound = ("name", "description", "rail_gb_s", "spine_gb_s", "path")
    assert {k: v for k, v in prof.to_dict().items() if k not in rate_bound} \
        == {k: v for k, v in committed.to_dict().items() if k not in rate_bound}, "all else is the committed file's"


def _gloo_probe(nbytes: int) -> dict:
    """One rank: gloo as the training sets it up (MASTER_ADDR = the first node's name, nothing
    else configured), an all-reduce, then timed transfers: n1 → n1, n1 → n2, n2 → n1."""
    import datetime
    import zlib

    import torch
    import torch.distributed as dist

    job = submitit.JobEnvironment()
    os.environ["MASTER_PORT"] = str(20000 + zlib.crc32(str(job.job_id).encode()) % 12768)
    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    buf = torch.ones(nbytes // 4)
    seconds = {}
    for src, dst in ((0, 1), (0, 2), (2, 0)):  # ranks 0, 1 on n1; 2, 3 on n2
        dist.barrier()
        t0 = time.perf_counter()
        if rank == src:
            dist.send(buf, dst)
        elif rank == dst:
            dist.recv(buf, src)
            seconds[f"{src}->{dst}"] = time.perf_counter() - t0
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "node": os.environ["SLURMD_NODENAME"], "master": env.master_addr,
            "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "sum": total.item(), "seconds": seconds,
            "cores": sorted(os.sched_getaffinity(0))}


def test_gloo_two_nodes_inter_node_rate_limited(emulated, tmp_path):
    sent_before = {(node, side): _tbf_sent(*dev)[1] for node in NODES
                   for side, dev in (("to", (f"mt-{node}",)), ("from", ("moetrain0", f"moetrain-{node}")))}
    ex = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    ex.update_parameters(nodes=2, tasks_per_node=2, timeout_min=5, name="net")
    job = ex.submit(_gloo_probe, SIZE)
    deadline = time.time() + 90
    while not job.done():
        assert time.time() < deadline, f"job {job.job_id} not done after 90 s; see {job.paths.stderr}"
        time.sleep(0.5)
    reports = sorted(job.results(), key=lambda r: r["rank"])
    assert [r["node"] for r in reports] == ["n1", "n1", "n2", "n2"]
    assert all(r["master"] == "n1" and r["sum"] == 6.0 for r in reports), reports
    assert all(r["ifname"] == "moetrain0" for r in reports), "the TaskProlog sets GLOO_SOCKET_IFNAME"
    if len(os.sched_getaffinity(0)) >= len(NODES):  # the tasks run on their node's cores only
        assert not set(reports[0]["cores"]) & set(reports[2]["cores"]), reports
    t = {k: v for r in reports for k, v in r["seconds"].items()}
    expected = SIZE * 8 / (RATE_MBPS * 1e6)
    print(f"\n{SIZE / 1e6:.0f} MB at {RATE_MBPS} Mbit/s (expected {expected:.2f} s): "
          + ", ".join(f"{k} {v:.3f} s ({SIZE * 8 / v / 1e6:.1f} Mbit/s)" for k, v in t.items()))
    for path in ("0->2", "2->0"):
        assert 0.6 * expected <= t[path] <= 2.5 * expected, f"{path}: {t[path]:.3f} s, expected ≈ {expected:.2f} s"
        assert t[path] >= 5 * t["0->1"], f"inter-node {t[path]:.3f} s vs intra-node {t['0->1']:.3f} s"
    # Each inter-node transfer crossed the sender's link out and the receiver's link in.
    for key, before in sent_before.items():
        node, side = key
        dev = (f"mt-{node}",) if side == "to" else ("moetrain0", f"moetrain-{node}")
        assert _tbf_sent(*dev)[1] - before >= SIZE, f"the tbf {side} {node} carried less than {SIZE} bytes"


# The model of the calibrate → plan → run check: the tiny model made wide enough (1.43 M
# parameters, 5.7 MB of fp32 gradients) that each step's gradient all-reduce over the 25 Mbit/s
# link takes about two seconds, tens of times its compute: the prediction then rests on the
# calibrated network, not on the compute of 4 ranks on 2 cores, which the other pytest worker's
# tests contend for in CI. The link is slow on purpose: a sender that the contended cores
# schedule late leaves the link idle, and the fewer bytes a second the link carries, the less
# that costs. At 50 Mbit/s with 2.6 M parameters the same check measured -6.5 % alone and
# -20.9 % beside the other worker on a 2-core Zen 3 (2026-11-29); at 25 Mbit/s with this model,
# +3.9 % alone and -2.7 % beside two busy processes.
WIDE = {"hidden": 192, "heads": 4, "kv_heads": 2, "ffn_hidden": 384}
WIDE_MOE = {"ffn_hidden": 192}
MEASURED_STEPS = 10


@pytest.fixture(scope="module")
def calibrated(emulated, tmp_path_factory, tiny_shards):
    """``python -m moetrain.calibrate`` of dp4 × ep2 on 2 nodes × 2 tasks, as a user runs it
    (threads per rank from the cores its node has): (the config, its process, the profile)."""
    work = tmp_path_factory.mktemp("calibrated")
    cfg = tiny_config(tiny_shards, work / "run", model=WIDE, moe=WIDE_MOE, parallel={"dp": 4, "ep": 2},
                      train={"steps": MEASURED_STEPS},
                      launch={"cluster": "slurm", "nodes": 2, "tasks_per_node": 2, "profile": str(emulated),
                              "time_min": 10, "max_restarts": 0})
    res, out = run_calibrate(cfg, work, "--seconds", "0.05", "--collective-budget", "4")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return cfg, res, out


def test_calibrate_recovers_the_link_rate(calibrated):
    """``python -m moetrain.calibrate`` on 2 nodes × 2 tasks measures the node link it was given:
    the inter-node all-reduce's bus bandwidth per rank × the node's 2 ranks within 10 % of the
    emulated rate, and the intra-node tier far faster (issue: recover the link rate within 10 %)."""
    _, _, out = calibrated
    prof = load_profile(out)
    assert prof.calibration["hosts"] == ["n1", "n2"] and prof.calibration["tasks_per_node"] == 2
    assert prof.calibration["threads_per_rank"] == 1  # the node's 1 core of 2 (with 2+ host cores), shared by 2
    rail = prof.collective_gb_s["rail"]
    link = rail["all_reduce"] * 8000 * 2   # GB/s per rank → Mbit/s of the node's link
    print(f"\ncalibrated node link {link:.1f} Mbit/s (emulated {RATE_MBPS}); per op GB/s per rank: {rail}")
    assert abs(link / RATE_MBPS - 1) <= 0.10, f"recovered {link:.1f} Mbit/s for an emulated {RATE_MBPS}"
    assert set(rail) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    assert prof.collective_gb_s["nvlink"]["all_reduce"] > 10 * rail["all_reduce"]


def test_calibrated_plan_predicts_the_run_within_20_percent(calibrated, tmp_path):
    """What a user does with the profile: ``plan --profile`` at the run's layout, then the run on
    the same cluster; the predicted step is within 20 % of the measured one. Nothing is fitted on
    the run's steps. The measured step is the fastest of steps 4 to the last, not their median:
    in CI the other pytest worker's processes share the 2 cores with the run's ranks, and a
    neighbour's load only ever adds time to a step, so the fastest step is the one nearest to the
    unloaded cluster the profile describes (timeit's reasoning for its minimum). On an idle
    machine the two agree (steps 4-10 vary by a few per cent); in CI's run of 2026-11-29 on a
    2-core Zen 3 they were 2.54 s and 3.05 s, for a prediction of 2.43 s."""
    cfg, _, profile = calibrated
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(to_dict(dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, dir=str(tmp_path / "run"))))))
    env = {**os.environ, "MOETRAIN_HOME": str(tmp_path / "home"),
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    layout = "tp=1,pp=1,dp=4,cp=1,ep=2,zero=0,mbs=2,ac=none"
    plan = subprocess.run([sys.executable, "-m", "moetrain.plan", "--config", str(config), "--profile", str(profile),
                           "--layout", layout, "--format", "json"], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    predicted = json.loads(plan.stdout)["layouts"][0]
    run = subprocess.run([sys.executable, "-m", "moetrain.submit", "--config", str(config)], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] >= 4]
    assert len(steps) == MEASURED_STEPS - 3, rows
    measured = min(steps)
    error = predicted["step_time_s"] / measured - 1
    print(f"\npredicted {predicted['step_time_s']:.3f} s, measured {measured:.3f} s ({error:+.1%}; median "
          f"{statistics.median(steps):.3f} s); "
          f"predicted terms: { {k: round(v, 3) for k, v in predicted['time_breakdown_s'].items() if v} }")
    assert abs(error) <= 0.20, f"predicted {predicted['step_time_s']:.3f} s for a step measured at {measured:.3f} s"
