"""moetrain.launch.slurm: config → submitit parameters, injection refused, dry-run script, and
(with the dev cluster up: `slurm/dev-cluster up`) the checks against a live SLURM."""

from __future__ import annotations

import operator
import os

import pytest
import submitit
from submitit.slurm.slurm import SlurmExecutor

from moetrain.config import Config, ConfigError, config_from_dict
from moetrain.launch import slurm as ms


def make_cfg(**launch) -> Config:
    """World size 4 (dp=4) on 2 nodes × 2 tasks unless launch says otherwise."""
    base = {"cluster": "slurm", "nodes": 2}
    base.update(launch)
    return config_from_dict({"run": {"name": "moe-demo"}, "parallel": {"dp": 4}, "launch": base})


def _cluster_or_reason() -> tuple[ms.ClusterInfo | None, str]:
    try:
        return ms.query_cluster(timeout_s=5), ""
    except ms.SlurmUnavailableError as e:
        return None, f"SLURM dev cluster is not up: run `slurm/dev-cluster up` ({e})"


# ---------------------------------------------------------------------------------------------
# No cluster needed
# ---------------------------------------------------------------------------------------------


def test_params_map_every_launch_field():
    cfg = make_cfg(partition="gpu", account="proj1", qos="high", constraint="a100&ib", exclude="n[3-4]",
                   gpus_per_node=2, cpus_per_task=6, mem_gb=12.5, time_min=30, signal_delay_s=90)
    assert ms.slurm_executor_params(cfg, job_name="moe-demo") == {
        "name": "moe-demo",
        "nodes": 2,
        "tasks_per_node": 2,
        "cpus_per_task": 6,
        "timeout_min": 30,
        "gpus_per_node": 2,
        "mem_gb": 12.5,
        "slurm_partition": "gpu",
        "slurm_account": "proj1",
        "slurm_qos": "high",
        "slurm_constraint": "a100&ib",
        "slurm_exclude": "n[3-4]",
        "slurm_signal_delay_s": 90,
        "slurm_additional_parameters": {"requeue": True},
    }


def test_params_leave_out_unset_fields():
    params = ms.slurm_executor_params(make_cfg(), job_name="moe-demo")
    for key in ("gpus_per_node", "mem_gb", "slurm_partition", "slurm_account", "slurm_qos",
                "slurm_constraint", "slurm_exclude"):
        assert key not in params


@pytest.mark.parametrize("field", ["partition", "account", "qos", "constraint", "exclude"])
@pytest.mark.parametrize("value", ["gpu; rm -rf /", "a\nb", "$(whoami)", "`id`", "a b", "x'y", "-p", "a\\b", ""])
def test_injection_refused(field, value):
    cfg = make_cfg(**{field: value})
    with pytest.raises(ConfigError) as e:
        ms.slurm_executor_params(cfg, job_name="moe-demo")
    assert f"launch.{field} = {value!r}" in str(e.value)
    assert "Fix:" in str(e.value)
    with pytest.raises(ConfigError):
        ms.render_batch_script(cfg, "/tmp/x")


@pytest.mark.parametrize("name", ["moe; reboot", "a\nb", "$(id)", "-x"])
def test_job_name_injection_refused(name):
    with pytest.raises(ConfigError, match="job_name"):
        ms.slurm_executor_params(make_cfg(), job_name=name)
    cfg = config_from_dict({"run": {"name": name}, "parallel": {"dp": 4}, "launch": {"cluster": "slurm", "nodes": 2}})
    with pytest.raises(ConfigError, match="run.name"):
        ms.render_batch_script(cfg, "/tmp/x")


@pytest.mark.parametrize("field,value", [("partition", "gpu,debug"), ("constraint", "[rack1*2&rack2*4]"),
                                         ("constraint", "a100|h100"), ("exclude", "gpu[01-03],gpu07"),
                                         ("account", "proj_1.x-y")])
def test_real_slurm_syntax_accepted(field, value):
    assert ms.slurm_executor_params(make_cfg(**{field: value}), job_name="j")[f"slurm_{field}"] == value


def test_dry_run_script_has_sbatch_lines(tmp_path):
    cfg = make_cfg(partition="gpu", account="proj1", gpus_per_node=2, mem_gb=16, time_min=45, signal_delay_s=100)
    text = ms.render_batch_script(cfg, tmp_path / "%j")
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for line in ["#SBATCH --job-name=moe-demo", "#SBATCH --partition=gpu", "#SBATCH --account=proj1",
                 "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --mem=16GB", "#SBATCH --time=45",
                 "#SBATCH --signal=USR2@100", "#SBATCH --requeue"]:
        assert line in lines, line
    assert any(line.startswith("srun ") and "submitit.core._submit" in line for line in lines)


def test_dry_run_script_equals_auto_executor_text(tmp_path, monkeypatch):
    """render_batch_script must produce what AutoExecutor(cluster="slurm") would write."""
    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # no srun needed
    cfg = make_cfg(partition="gpu", qos="q", constraint="a100", exclude="n9", gpus_per_node=2, mem_gb=1.5)
    ex = submitit.AutoExecutor(folder=tmp_path, cluster="slurm", slurm_max_num_timeout=cfg.launch.max_restarts)
    ex.update_parameters(**ms.slurm_executor_params(cfg, job_name="moe-demo"))
    inner = ex._executor
    expected = inner._make_submission_file_text(inner._submitit_command_str, uid="x")
    assert ms.render_batch_script(cfg, tmp_path) == expected


def test_parse_gres_gpus():
    assert ms.parse_gres_gpus("gpu:4") == 4
    assert ms.parse_gres_gpus("gpu:a100:8(S:0-1)") == 8
    assert ms.parse_gres_gpus("gpu:a100:4(S:0,1),gpu:v100:2,mps:100") == 6
    assert ms.parse_gres_gpus("(null)") == 0
    assert ms.parse_gres_gpus("gpu") == 1


def test_profile_gpus_per_node_limits(tmp_path):
    prof = tmp_path / "tiny.yaml"
    prof.write_text("name: tiny\ngpus_per_node: 2\n")
    with pytest.raises(ConfigError, match=r"launch.gpus_per_node = 4: cluster profile .* has 2 GPUs per node"):
        ms.check_launch(make_cfg(gpus_per_node=4, tasks_per_node=2, profile=str(prof)), job_name="j")
    ms.check_launch(make_cfg(gpus_per_node=2, profile=str(prof)), job_name="j")
    nested = tmp_path / "nested.yaml"
    nested.write_text("node:\n  gpus_per_node: 8\n")
    assert ms.profile_gpus_per_node(str(nested)) == 8
    silent = tmp_path / "silent.yaml"
    silent.write_text("rails: 8\n")
    assert ms.profile_gpus_per_node(str(silent)) is None
    with pytest.raises(ConfigError, match="launch.profile = 'no-such-profile': no such cluster profile"):
        ms.check_launch(make_cfg(profile="no-such-profile"), job_name="j")


def test_validate_slurm_runs_offline_checks():
    with pytest.raises(ConfigError, match="launch.account"):
        ms.validate_slurm(make_cfg(account="a;b"))


def test_submit_without_slurm_exits_2_in_one_line_and_writes_nothing(tiny_shards, tmp_path, monkeypatch, capsys):
    """A SLURM config on a machine where SLURM does not answer is a config error before anything
    is written; its dry run still shows the script, saying first that it was not checked."""
    from moetrain import submit

    monkeypatch.setattr(ms.shutil, "which", lambda name: None)  # no scontrol on this "laptop"
    config = tmp_path / "c.yaml"
    config.write_text(f"run: {{name: tiny, dir: {tmp_path / 'run'}}}\ndata: {{path: {tiny_shards}}}\n"
                      "model: {layers: 2, hidden: 32, heads: 4, kv_heads: 2, ffn_hidden: 64, seq_len: 16}\n"
                      "moe: {num_experts: 0}\nparallel: {dp: 4}\ntrain: {global_batch_size: 8}\n"
                      "launch: {cluster: slurm, nodes: 2}\n")
    assert submit.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("config error: launch.cluster = 'slurm': SLURM does not answer on this machine "
                          "(`scontrol` is not installed")
    assert "Fix:" in err and "launch.cluster=local" in err
    assert not (tmp_path / "run").exists(), "nothing may be written before the run can start"
    assert submit.main(["--config", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# NOT checked against a cluster: SLURM does not answer here") and "#SBATCH" in out
    assert not (tmp_path / "run").exists()


def _fake_cluster(gpus: int = 4) -> ms.ClusterInfo:
    nodes = tuple(ms.NodeInfo(f"n{i}", cpus=4, gpus=gpus, partitions=("low", "high"), state="IDLE") for i in (1, 2))
    return ms.ClusterInfo(("low", "high"), "low", nodes)


def test_check_against_cluster_rules_offline():
    cluster = _fake_cluster()
    ms.check_against_cluster(make_cfg(gpus_per_node=4), cluster)
    with pytest.raises(ConfigError, match="launch.partition = 'gpu': no partition 'gpu'.*Fix: set launch.partition to one of low, high"):
        ms.check_against_cluster(make_cfg(partition="gpu"), cluster)
    with pytest.raises(ConfigError, match="launch.gpus_per_node = 8: the nodes of partition low have at most 4 GPUs"):
        ms.check_against_cluster(make_cfg(gpus_per_node=8), cluster)
    with pytest.raises(ConfigError, match="launch.nodes = 4: partition low has 2 nodes"):
        ms.check_against_cluster(make_cfg(nodes=4), cluster)
    with pytest.raises(ConfigError, match="launch.cpus_per_task = 3"):
        ms.check_against_cluster(make_cfg(cpus_per_task=3), cluster)


# ---------------------------------------------------------------------------------------------
# With the dev cluster up
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_cluster() -> ms.ClusterInfo:
    cluster, reason = _cluster_or_reason()
    if cluster is None:
        if os.environ.get("MOETRAIN_REQUIRE_SLURM") == "1":  # CI brought it up: a skip would hide a failure
            pytest.fail(reason)
        pytest.skip(reason)
    return cluster


@pytest.mark.slurm
def test_live_unknown_partition_refused(live_cluster, tmp_path):
    with pytest.raises(ConfigError) as e:
        ms.make_slurm_executor(make_cfg(partition="nosuchpart"), tmp_path)
    msg = str(e.value)
    assert "launch.partition = 'nosuchpart'" in msg and "low" in msg and "high" in msg


@pytest.mark.slurm
def test_live_validate_slurm(live_cluster):
    assert ms.validate_slurm(make_cfg(partition="high", gpus_per_node=2)) is not None
    with pytest.raises(ConfigError, match="launch.partition = 'nosuchpart'"):
        ms.validate_slurm(make_cfg(partition="nosuchpart"))


@pytest.mark.slurm
def test_live_too_many_gpus_refused(live_cluster, tmp_path):
    most = max(n.gpus for n in live_cluster.nodes)
    cfg = config_from_dict({"parallel": {"dp": 2 * (most + 1)},
                            "train": {"global_batch_size": 4 * (most + 1)},
                            "launch": {"cluster": "slurm", "nodes": 2, "gpus_per_node": most + 1}})
    with pytest.raises(ConfigError, match=rf"launch.gpus_per_node = {most + 1}: .* at most {most} GPUs"):
        ms.make_slurm_executor(cfg, tmp_path)


@pytest.mark.slurm
def test_live_submission_matches_dry_run(live_cluster, tmp_path):
    cfg = config_from_dict({"run": {"name": "moe-demo"}, "parallel": {"dp": 1},
                            "launch": {"cluster": "slurm", "nodes": 1, "partition": "low", "time_min": 5,
                                       "max_restarts": 5}})
    ex = ms.make_slurm_executor(cfg, tmp_path)
    assert ex._executor.max_num_timeout == 5
    job = ex.submit(operator.add, 2, 3)  # a function the job's interpreter can import
    assert job.result() == 5
    assert job.paths.submission_file.read_text() == ms.render_batch_script(cfg, tmp_path)
