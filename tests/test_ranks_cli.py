"""``python -m moetrain.ranks``: table, JSON, SVG, --rank, --set and --nodes fitting, errors."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from moetrain.config import ConfigError
from moetrain.ranks import config_for_nodes, main
from moetrain.topology import build_rank_map, load_profile


# tp 2 × pp 4 (dp follows from --nodes), whatever layout the config file carries
MIX = ["--config", "configs/mixtral-8x7b.yaml", "--set", "parallel.tp=2", "--set", "parallel.pp=4",
       "--set", "parallel.sequence_parallel=true"]


def _json(capsys, *argv: str) -> dict:
    assert main(list(argv) + ["--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_lists_ranks_groups_traffic_and_rules(capsys):
    out = _json(capsys, *MIX, "--nodes", "8")
    assert out["world"] == 64 and len(out["ranks"]) == 64
    for row in out["ranks"]:
        assert {"rank", "node", "local_rank", "pp", "dp", "cp", "tp", "ep"} <= set(row)
        assert row["node"] == row["rank"] // 8 and row["local_rank"] == row["rank"] % 8
    axes = {g["axis"] for g in out["groups"]}
    assert {"pp", "dp", "cp", "tp", "ep", "edp", "dp_cp"} <= axes
    assert all(g["tier"] in ("none", "nvlink", "rail", "spine") for g in out["groups"])
    tp_groups = [g for g in out["groups"] if g["axis"] == "tp"]
    assert len(tp_groups) == 32 and all(g["tier"] == "nvlink" for g in tp_groups)
    ops = {(t["axis"], t["op"]) for t in out["traffic"]}
    assert ("ep", "all_to_all") in ops and ("pp", "p2p") in ops and ("tp", "all_gather") in ops
    for t in out["traffic"]:
        assert t["bytes_per_step"] and all(v > 0 for v in t["bytes_per_step"].values())
    assert {r["name"] for r in out["rules"]} >= {"tp_in_domain", "pp_same_rail", "pp_in_rail_group"}
    # the planner's step without the EP overlap, with it, and with delayed weight gradients too
    ov = out["ep_overlap"]
    assert ov["without"]["step_s"] > ov["with"]["step_s"] >= ov["with_delay_wgrad"]["step_s"]
    assert ov["with_delay_wgrad"]["ep_hidden_s"] >= ov["with"]["ep_hidden_s"] > 0


def test_json_is_the_map_the_trainer_builds(capsys):
    out = _json(capsys, *MIX, "--nodes", "8")
    cfg, _ = config_for_nodes("configs/mixtral-8x7b.yaml", MIX[3::2], 8, load_profile("h100-superpod"))
    rm = build_rank_map(cfg, nodes=8, profile="h100-superpod")
    assert out["digest"] == rm.digest
    for row in out["ranks"]:
        assert rm.mesh_ranks[row["pp"], row["dp"], row["cp"], row["tp"]] == row["rank"]


def test_set_overrides_and_node_fitting(capsys):
    out = _json(capsys, *MIX, "--nodes", "32", "--set", "parallel.tp=4", "--set", "parallel.ep=4")
    assert out["sizes"]["tp"] == 4 and out["sizes"]["ep"] == 4 and out["sizes"]["dp"] == 16  # 256 / (4·4)
    assert any("dp set to 16" in n for n in out["notes"])
    with pytest.raises(ConfigError, match="parallel.dp"):
        config_for_nodes("configs/mixtral-8x7b.yaml", ["parallel.dp=2"], 16, load_profile("h100-superpod"))


def test_table_and_rank_explanation(capsys):
    assert main(MIX + ["--nodes", "8"]) == 0
    table = capsys.readouterr().out
    for part in ("rules", "ranks", "groups", "traffic per GPU", "tp_in_domain", "all_to_all"):
        assert part in table
    assert main(MIX + ["--nodes", "8", "--rank", "13"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("rank 13: node 1") and "tp      2 ranks over nvlink" in text


def test_demo_config_runs_without_nodes(capsys):
    out = _json(capsys, "--config", "configs/demo-moe.yaml")
    assert out["world"] == 4 and [r["rank"] for r in out["ranks"]] == [0, 1, 2, 3]
    assert any("no cluster profile" in n for n in out["notes"])


def test_svg_draws_every_gpu_and_group(tmp_path, capsys):
    path = tmp_path / "map.svg"
    assert main(MIX + ["--nodes", "64", "--format", "svg", "-o", str(path)]) == 0
    root = ET.fromstring(path.read_text())
    ns = "{http://www.w3.org/2000/svg}"
    rects = root.findall(f"{ns}rect")
    titles = [r for r in rects if r.find(f"{ns}title") is not None]
    assert len(titles) == 512  # one cell per GPU, with a tooltip
    outlines = [r for r in rects if r.get("fill") == "none"]
    assert len(outlines) >= 256 + 64  # TP groups and EP group pieces
    assert int(root.get("height")) < 3000  # 64 nodes stay on one readable page


def test_errors_are_one_line(capsys):
    assert main(MIX + ["--nodes", "3"]) == 2  # dp = 3: ep = 8 cannot divide it
    err = capsys.readouterr().err
    assert err.startswith("error:") and "parallel.ep" in err and err.count("\n") == 1
    assert main(MIX + ["--nodes", "3", "--set", "parallel.tp=4"]) == 2
    assert "pp·cp·tp = 16" in capsys.readouterr().err
    assert main(["--config", "configs/no-such.yaml"]) == 2
    assert main(["--config", "configs/mixtral-8x7b.yaml", "--nodes", "8", "--profile", "nope"]) == 2
    assert main(["--config", "configs/mixtral-8x7b.yaml", "--nodes", "8", "--rank", "64"]) == 2


def test_nodelist_with_topology(tmp_path, capsys):
    topo = tmp_path / "topology.conf"
    topo.write_text("SwitchName=a Nodes=gpu[01-03]\nSwitchName=b Nodes=gpu[04-08]\nSwitchName=s Switches=a,b\n")
    out = _json(capsys, *MIX, "--nodelist", "gpu[01-08]", "--topology", str(topo))
    assert [n["rail_group"] for n in out["nodes"]] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert any(r["name"] == "pp_in_rail_group" and r["status"] == "broken" for r in out["rules"])


def test_module_entry_point():
    res = subprocess.run([sys.executable, "-m", "moetrain.ranks", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--nodes" in res.stdout and "--format" in res.stdout
