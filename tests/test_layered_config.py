"""Layered configs (several files, then --set at any depth), parallel.dp: auto, where each value
came from, and the site settings of `launch` (env, setup, container, srun/sbatch arguments):
parsed, refused with the field named, and rendered into the sbatch script and srun line as
pyxis, Apptainer and podman document their command lines. No cluster needed."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moetrain.config import ConfigError, config_from_dict, explain, load_layers, render_config, to_dict
from moetrain.launch.allocation import Allocation, current_allocation, step_script
from moetrain.launch.container import PODMAN_ENV_PATTERNS, task_launch
from moetrain.launch.slurm import render_batch_script

from conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def layers3(tmp_path):
    """base (the demo), site, experiment: three files as a team would keep them."""
    site = _write(tmp_path / "site.yaml", {
        "launch": {"cluster": "slurm", "partition": "batch", "tasks_per_node": 4, "env": {"NCCL_DEBUG": "WARN",
                   "NCCL_IB_HCA": "mlx5"}, "setup": ["module load cuda", "source /opt/site.sh"]},
        "data": {"blend": [{"path": "/d/web", "weight": 0.7}, {"path": "/d/code", "weight": 0.3}], "path": None}})
    exp = _write(tmp_path / "exp.yaml", {
        "parallel": {"dp": "auto"}, "launch": {"nodes": 2, "env": {"NCCL_DEBUG": "INFO"}, "setup": ["echo only"]},
        "data": {"blend": [{"path": "/d/web2"}]}, "train": {"lr": 1.0e-3, "global_batch_size": 32}})
    return [ROOT / "configs/demo-moe.yaml", site, exp]


def test_later_files_override_key_by_key_and_lists_whole(layers3):
    cfg, layers = load_layers(layers3)
    assert cfg.launch.partition == "batch" and cfg.launch.nodes == 2
    assert cfg.launch.env == {"NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5"}, "mappings merge key by key"
    assert cfg.launch.setup == ("echo only",), "a list is replaced whole"
    assert [s.path for s in cfg.data.blend] == ["/d/web2"], "a list is replaced whole"
    assert cfg.train.lr == 1.0e-3 and cfg.model.hidden == 256  # the experiment's, the base's
    assert cfg.parallel.dp == 8 and cfg.grad_accum_steps == 2  # auto: 2 nodes × 4 tasks; 32 ÷ (2 × 8)
    assert layers.origin("launch.env.NCCL_IB_HCA") == str(layers3[1])
    assert layers.origin("launch.env.NCCL_DEBUG") == str(layers3[2])
    assert layers.origin("model.hidden") == str(layers3[0]) and layers.origin("model.rope_theta") == "default"
    assert layers.origin("parallel.dp").startswith("auto: launch.nodes 2 × launch.tasks_per_node 4 = 8")


def test_set_reaches_any_depth(layers3):
    cfg, layers = load_layers(layers3, ["launch.env.NCCL_DEBUG=TRACE", "metrics.wandb.project=moe",
                                        "launch.container.image=/img/a.sqsh", "launch.env.NEW=x y"])
    assert cfg.launch.env == {"NCCL_DEBUG": "TRACE", "NCCL_IB_HCA": "mlx5", "NEW": "x y"}
    assert cfg.metrics.wandb.project == "moe" and cfg.metrics.wandb.mode == "offline"
    assert cfg.launch.container.image == "/img/a.sqsh" and cfg.launch.container.runtime == "pyxis"
    text = explain(layers, cfg, "launch.env.NCCL_DEBUG")
    assert text.splitlines() == ["launch.env.NCCL_DEBUG = TRACE",
                                 f"  {layers3[1]}: launch.env.NCCL_DEBUG = WARN",
                                 f"  {layers3[2]}: launch.env.NCCL_DEBUG = INFO",
                                 "  --set: launch.env.NCCL_DEBUG = TRACE"]
    with pytest.raises(ConfigError, match=r"^launch.nodes = 2: is not a mapping, so it has no key 'x'"):
        load_layers(layers3, ["launch.nodes.x=1"])
    with pytest.raises(ConfigError, match=r"^launch.env.X.Y = 1: unknown key|launch.env.X"):
        load_layers(layers3, ["launch.env.X.Y=1"])
    with pytest.raises(ConfigError, match=r"did you mean launch.env.A\?"):
        load_layers(layers3, ["lunch.env.A=1"])


def test_resolved_config_names_each_values_origin_and_round_trips(layers3, tmp_path):
    cfg, layers = load_layers(layers3, ["train.steps=7", "launch.setup=['echo \"a: b\" # not a comment']"])
    text = render_config(cfg, layers)
    lines = {line.strip().split(":")[0]: line for line in text.splitlines() if "#" in line}
    assert lines["steps"].endswith("# --set") and lines["lr"].endswith(f"# {layers3[2]}")
    assert lines["partition"].endswith(f"# {layers3[1]}") and lines["rope_theta"].endswith("# default")
    assert "# auto: launch.nodes 2" in lines["dp"]
    again = config_from_dict(yaml.safe_load(text))
    assert to_dict(again) == to_dict(cfg)
    assert again.launch.setup == ('echo "a: b" # not a comment',)


def test_dp_auto_rules(tmp_path):
    base = ROOT / "configs/demo-moe.yaml"
    with pytest.raises(ConfigError, match=r"^parallel.dp = 'auto': .*launch.tasks_per_node = None. Fix: set "
                                          r"launch.tasks_per_node"):
        load_layers(base, ["parallel.dp=auto"])
    with pytest.raises(ConfigError, match=r"^parallel.dp = 'auto': launch.nodes 1 × launch.tasks_per_node 3 = 3 "
                                          r"ranks is not a multiple of tp × pp × cp = 2 × 1 × 1"):
        load_layers(base, ["parallel.dp=auto", "launch.tasks_per_node=3", "parallel.tp=2"])
    cfg, layers = load_layers(base, ["parallel.dp=auto"], world_size=2)  # the ranks torchrun started
    assert cfg.parallel.dp == 2 and layers.origin("parallel.dp") == "auto: 2 ranks started = 2 ÷ (tp 1 × pp 1 × cp 1)"


def test_site_file_layers_on_a_model_config():
    cfg, layers = load_layers([ROOT / "configs/mixtral-8x7b.yaml", ROOT / "configs/sites/h100-superpod.yaml"],
                              ["parallel.dp=auto", "launch.nodes=8"])
    assert cfg.parallel.dp == 32 and cfg.world_size == 64 and cfg.launch.profile == "h100-superpod"
    script = render_batch_script(cfg, "/lustre/runs/x/logs")
    assert "#SBATCH --exclusive" in script and "#SBATCH --account=my-team" in script
    assert "export NCCL_SOCKET_IFNAME='^docker,lo'" in script and "ulimit -n 65536" in script.split("# command")[0]
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--container-image=/lustre/images/moetrain-pytorch-25.01.sqsh" in srun.split()
    assert srun.split()[-5:] == ["python", "-u", "-m", "submitit.core._submit", "/lustre/runs/x/logs"]


@pytest.mark.parametrize("data, field", [
    ({"launch": {"env": {"1BAD": "x"}}}, "launch.env.1BAD"),
    ({"launch": {"env": {"A-B": "x"}}}, "launch.env.A-B"),
    ({"launch": {"env": {"A": "x\0y"}}}, "launch.env.A"),
    ({"launch": {"env": {"A": True}}}, "launch.env.A"),
    ({"launch": {"cluster": "slurm", "setup": ["ok", "bad\0line"]}}, "launch.setup[1]"),
    ({"launch": {"srun_args": ["--ok", "oops"]}}, "launch.srun_args[1]"),
    ({"launch": {"sbatch_args": ["-A acct"]}}, "launch.sbatch_args[0]"),
    ({"launch": {"cluster": "slurm", "container": {"image": "img", "mounts": ["/data"]}}}, "launch.container.mounts[0]"),
    ({"launch": {"cluster": "slurm", "container": {"image": "img", "mounts": ["data:/data"]}}},
     "launch.container.mounts[0]"),
    ({"launch": {"cluster": "slurm", "container": {"image": "my image"}}}, "launch.container.image"),
    ({"launch": {"cluster": "slurm", "container": {"image": "i", "workdir": "rel"}}}, "launch.container.workdir"),
    ({"launch": {"cluster": "slurm", "container": {"image": "i", "runtime": "docker"}}}, "launch.container.runtime"),
    ({"launch": {"container": {"image": "img"}}}, "launch.container.image"),  # local: no srun to start it
    ({"launch": {"setup": ["module load x"]}}, "launch.setup"),
])
def test_bad_site_values_refused_naming_the_field(data, field):
    base = yaml.safe_load((ROOT / "configs/demo-moe.yaml").read_text())
    for section, values in data.items():
        base[section].update(values) if section in base else base.setdefault(section, values)
    with pytest.raises(ConfigError) as e:
        config_from_dict(base)
    assert str(e.value).startswith(f"{field} = "), str(e.value)
    assert "Fix:" in str(e.value)


def _slurm(**launch) -> object:
    base = yaml.safe_load((ROOT / "configs/demo-moe.yaml").read_text())
    base["launch"] = {"cluster": "slurm", "nodes": 2, **launch}
    return config_from_dict(base)


def test_env_values_are_quoted_never_interpreted(tmp_path):
    value = "a b; $(touch pwned) `id` 'q' \"dq\" $HOME"
    cfg = _slurm(env={"SITE_VALUE": value}, setup=["export FROM_SETUP=$((1 + 2))"])
    script = render_batch_script(cfg, tmp_path / "logs")
    setup = script.split("# setup\n")[1].split("\n\n")[0]
    out = subprocess.run(["bash", "-c", setup + "\nprintf '%s|%s' \"$SITE_VALUE\" \"$FROM_SETUP\""], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert out == f"{value}|3", "env literal, setup run as shell"
    assert not (tmp_path / "pwned").exists()


# Documented command lines. pyxis (github.com/NVIDIA/pyxis, README "Usage"): srun options that
# take a value with '=': --container-image, --container-mounts (SRC:DST[:FLAGS], comma separated),
# --container-workdir, --container-name, --container-save, --container-env; flags:
# --container-mount-home / --no-container-mount-home, --container-remap-root, --container-writable,
# --container-readonly, --no-container-entrypoint.
PYXIS_VALUE = {"--container-image", "--container-mounts", "--container-workdir", "--container-name",
               "--container-save", "--container-env"}
PYXIS_FLAG = {"--container-mount-home", "--no-container-mount-home", "--container-remap-root",
              "--container-writable", "--container-readonly", "--no-container-entrypoint"}
# Apptainer (apptainer.org/docs/user/latest/cli/apptainer_exec.html): `apptainer exec [exec
# options...] <container> <command>`; options with a value: --bind/-B (src[:dest[:opts]], comma
# separated), --pwd, --env, --home, --overlay; flags: --nv, --cleanenv, --contain, --writable-tmpfs.
APPTAINER_VALUE = {"--bind", "-B", "--pwd", "--env", "--home", "--overlay"}
APPTAINER_FLAG = {"--nv", "--cleanenv", "--contain", "--writable-tmpfs", "--no-home"}


def _parse_mounts(spec: str) -> list[tuple[str, ...]]:
    out = []
    for m in spec.split(","):
        parts = tuple(m.split(":"))
        assert len(parts) in (2, 3) and all(p.startswith("/") for p in parts[:2]), m
        out.append(parts)
    return out


def test_pyxis_srun_line_uses_only_documented_flags(tmp_path):
    cfg = _slurm(gpus_per_node=4, container={"image": "nvcr.io#nvidia/pytorch:25.01-py3", "runtime": "pyxis",
                                             "mounts": ["/lustre:/lustre:ro", "/home/u/data:/data"],
                                             "runtime_args": ["--no-container-mount-home"]})
    script = render_batch_script(cfg, tmp_path / "logs")
    srun = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
    pyxis = [a for a in srun if a.startswith("--container") or a.startswith("--no-container")]
    assert len(pyxis) == 4
    for arg in pyxis:
        name, eq, value = arg.partition("=")
        assert (name in PYXIS_VALUE and eq and value) or (name in PYXIS_FLAG and not eq), arg
    by = dict(a.split("=", 1) for a in pyxis if "=" in a)
    assert by["--container-image"] == "nvcr.io#nvidia/pytorch:25.01-py3"
    mounts = _parse_mounts(by["--container-mounts"])
    assert mounts[:2] == [("/lustre", "/lustre", "ro"), ("/home/u/data", "/data")]
    assert (str(ROOT), str(ROOT)) in mounts, "the submit directory at its own path"
    assert by["--container-workdir"] == str(ROOT)
    assert srun[-5:-3] == ["python3", "-u"], "the image's Python"


def test_apptainer_command_follows_its_documented_syntax(tmp_path):
    cfg = _slurm(gpus_per_node=4, container={"image": "/images/train.sif", "runtime": "apptainer",
                                             "mounts": ["/scratch:/scratch"], "workdir": "/scratch/w",
                                             "runtime_args": ["--cleanenv"], "python": "/opt/venv/bin/python"})
    argv = list(task_launch(cfg, ROOT).python)
    assert argv[:2] == ["apptainer", "exec"]
    i, opts = 2, {}
    while argv[i].startswith("-"):
        if argv[i] in APPTAINER_VALUE:
            opts[argv[i]] = argv[i + 1]
            i += 2
        else:
            assert argv[i] in APPTAINER_FLAG, argv[i]
            opts[argv[i]] = True
            i += 1
    assert argv[i:] == ["/images/train.sif", "/opt/venv/bin/python"], "IMAGE then the command"
    assert opts["--nv"] is True and opts["--cleanenv"] is True and opts["--pwd"] == "/scratch/w"
    assert _parse_mounts(opts["--bind"])[0] == ("/scratch", "/scratch")
    cpu = _slurm(container={"image": "/images/train.sif", "runtime": "apptainer"})
    assert "--nv" not in task_launch(cpu, ROOT).python, "no GPUs asked for: no --nv"


def test_podman_command_passes_the_ranks_variables(tmp_path):
    cfg = _slurm(env={"NCCL_IB_HCA": "mlx5", "SITE_X": "1"},
                 container={"image": "localhost/train:1", "runtime": "podman", "mounts": ["/data:/data:ro"],
                            "runtime_args": ["--runtime=runc"]})
    argv = list(task_launch(cfg, ROOT).python)
    assert argv[:3] == ["podman", "run", "--rm"] and argv[-2:] == ["localhost/train:1", "python3"]
    assert {"--network=host", "--ipc=host", "--runtime=runc", "--volume=/data:/data:ro",
            f"--workdir={ROOT}"} <= set(argv)
    assert {f"--env={p}" for p in PODMAN_ENV_PATTERNS} | {"--env=NCCL_IB_HCA", "--env=SITE_X"} <= set(argv)
    assert "SLURM_*" in PODMAN_ENV_PATTERNS and "SUBMITIT_*" in PODMAN_ENV_PATTERNS


def test_allocation_step_script(tmp_path, monkeypatch):
    assert current_allocation({}) is None
    alloc = current_allocation({"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert alloc == Allocation("77", 2, "n[1-2]")
    cfg = _slurm(env={"A": "x y"}, setup=["module load cuda"], srun_args=["--cpu-bind=none"])
    script = step_script(cfg, alloc, 1, tmp_path)
    lines = script.splitlines()
    assert lines[:3] == ["set -e", "export A='x y'", "module load cuda"]
    srun = shlex.split(lines[3].removeprefix("exec "))
    assert srun[:4] == ["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2"] and "--cpu-bind=none" in srun
    tail = srun[srun.index("moetrain.run") + 1:]
    assert tail[:6] == ["--config", str(cfg.run_dir / "config.yaml"), "--resolved", "--restart", "1", "--job-id"]


@pytest.mark.slow
def test_submit_explain_prints_each_layer(layers3, tmp_path):
    cmd = [sys.executable, "-m", "moetrain.submit", *sum((["--config", str(p)] for p in layers3), []),
           "--set", "launch.cluster=local", "--set", "launch.nodes=1", "--set", "launch.setup=[]",
           "--set", f"run.dir={tmp_path / 'run'}"]
    out = subprocess.run([*cmd, "--explain", "launch.nodes"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["launch.nodes = 1", f"  {layers3[0]}: launch.nodes = 1",
                                       f"  {layers3[2]}: launch.nodes = 2", "  --set: launch.nodes = 1"]
    bad = subprocess.run([*cmd, "--explain", "launch.nope"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--explain 'launch.nope': no such key" in bad.stderr


def test_submit_checks_a_local_config_without_importing_torch(tiny_shards, tmp_path):
    # The launching process only reads, checks and submits (the ranks import torch): on a machine
    # without a GPU driver its dry run and --help start in a fraction of a second, not the 1-3 s
    # that importing torch, FSDP and dynamo costs.
    if any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")):
        pytest.skip("a GPU driver is present: the planned device is asked of torch")
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(to_dict(tiny_config(tiny_shards, tmp_path / "run", parallel={"dp": 2, "ep": 2}))))
    check = ("import runpy, sys\n"
             f"sys.argv = ['submit', '--config', {str(config)!r}, '--dry-run']\n"
             "try:\n    runpy.run_module('moetrain.submit', run_name='__main__')\n"
             "except SystemExit as e:\n    assert not e.code, e.code\n"
             "assert 'torch' not in sys.modules, 'the dry run imported torch'\n")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "parallel:" in out.stdout


@pytest.mark.slow
def test_submit_inside_an_allocation_checks_it_and_shows_the_step(tiny_shards, tmp_path):
    from conftest import tiny_config

    cfg = tiny_config(tiny_shards, tmp_path / "run", parallel={"dp": 4, "ep": 2},
                      launch={"cluster": "slurm", "nodes": 2, "env": {"A": "1"}})
    config = _write(tmp_path / "run.yaml", to_dict(cfg))
    env = {**os.environ, "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}

    def submit(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "moetrain.submit", "--config", str(config), *args], env=env,
                              capture_output=True, text=True, cwd=ROOT, timeout=120)

    dry = submit("--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "# inside SLURM allocation 4242 (2 node(s): n[1-2]): no new job" in dry.stdout
    assert "export A=1\nexec srun --nodes=2 --ntasks=4 --ntasks-per-node=2" in dry.stdout
    assert "#SBATCH" not in dry.stdout
    big = submit("--set", "launch.nodes=4", "--set", "parallel.dp=8", "--set", "train.global_batch_size=16", "--dry-run")
    assert big.returncode == 2 and big.stderr.startswith("config error: launch.nodes = 4: submit runs inside SLURM "
                                                         "allocation 4242, which has 2 node(s)"), big.stderr
    detach = submit("--detach")
    assert detach.returncode == 2 and "config error: --detach: submit runs inside SLURM allocation 4242" in detach.stderr
    assert not (tmp_path / "run").exists(), "nothing written"
    new = submit("--set", "launch.allocation=new", "--dry-run")
    assert "#SBATCH --nodes=2" in new.stdout, "launch.allocation: new renders a job of its own"


@pytest.mark.slow
def test_ranks_and_plan_take_layered_configs():
    """The inspection CLIs read the same layers as submit: the site file's profile and tasks per
    node, dp: auto re-derived for the nodes asked about."""
    layered = ["--config", "configs/mixtral-8x7b.yaml", "--config", "configs/sites/h100-superpod.yaml",
               "--set", "parallel.dp=auto"]
    ranks = subprocess.run([sys.executable, "-m", "moetrain.ranks", *layered, "--nodes", "8", "--format", "json"],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert ranks.returncode == 0, ranks.stderr
    report = json.loads(ranks.stdout)
    assert report["profile"] == "h100-superpod" and report["sizes"]["dp"] == 32 and report["world"] == 64
    plan = subprocess.run([sys.executable, "-m", "moetrain.plan", *layered, "--set", "launch.nodes=8", "--nodes", "8",
                           "--format", "json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["profile"] == "h100-superpod"
