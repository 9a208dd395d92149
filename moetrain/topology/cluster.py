"""The cluster a job runs on: its hardware profile and the nodes it was given.

A :class:`ClusterProfile` (one YAML file in ``slurm/profiles/``) describes the hardware: GPUs per
node, the NVSwitch (NVLink) domain, rails, rail groups, peak FLOP/s, memory and the bandwidth of
each network tier. An :class:`Allocation` lists the job's nodes in SLURM task order with, for
each node, the NVSwitch domain and the rail group it belongs to. Allocations come from
``SLURM_JOB_NODELIST`` plus the switch tree (``scontrol show topology`` or a ``topology.conf``),
or, for inspection and planning, from a node count.

Words (see DESIGN.md, "Topology words"):
- NVSwitch domain: GPUs joined all-to-all by NVLink (one node on DGX H100, 18 nodes on NVL72).
- rail: in a rail-optimised fabric, NIC i of every node of a rail group hangs off leaf switch i,
  so GPU i of node A talks to GPU i of node B through one leaf.
- rail group (scalable unit): nodes whose rails share the same leaf switches; traffic between
  rail groups, or between different rails, climbs to the spine.

Network tiers a group's traffic can cross, fastest first: ``nvlink`` (inside one NVSwitch
domain), ``rail`` (several domains of one rail group, each node's members on the same rails),
``spine`` (different rails or different rail groups). ``none`` marks a group of one rank.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

__all__ = [
    "TIERS",
    "LINK_TIERS",
    "COLLECTIVES",
    "ProfileError",
    "ClusterProfile",
    "Node",
    "Allocation",
    "PROFILE_DIR",
    "list_profiles",
    "load_profile",
    "generic_profile",
    "expand_nodelist",
    "parse_topology",
    "read_slurm_topology",
    "synthetic_allocation",
    "allocation_from_names",
]

TIERS = ("none", "nvlink", "rail", "spine")
"""Network tiers, fastest first. A group's tier is the slowest one its traffic crosses."""

LINK_TIERS = TIERS[1:]
"""The tiers that carry traffic (``ClusterProfile.bandwidth``, ``collective_gb_s``)."""

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
"""The collectives the planner times and ``python -m moetrain.calibrate`` measures per tier."""

PROFILE_DIR = Path(__file__).resolve().parents[2] / "slurm" / "profiles"


class ProfileError(ValueError):
    """A cluster profile or node list is malformed; the message says which field and the fix."""


# ---------------------------------------------------------------------------------------------
# Profile
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterProfile:
    """Hardware of one cluster kind. Bandwidths are per GPU and per direction, in GB/s (1e9 B/s);
    ``*_efficiency`` are the fractions of nominal that NCCL's bus bandwidth (nccl-tests
    ``busbw``) reaches for large messages; latencies are per collective step, in µs.

    ``nvswitch_domain_gpus``: GPUs joined by NVSwitch (8 on HGX H100, 72 on GB200 NVL72), a
    multiple of ``gpus_per_node``. ``nodes_per_rail_group``: nodes that share one set of rail
    leaf switches (a SuperPOD scalable unit). ``peak_tflops``: dense bf16 tensor-core peak per
    GPU. ``gemm_efficiency``: fraction of peak a large bf16 GEMM sustains (cuBLAS, long runs,
    clocks under the power cap). ``attention_efficiency``: the same for the fused attention
    kernel. ``fp8_peak_tflops``: dense FP8 tensor-core peak per GPU (``null``: no FP8 tensor
    cores, e.g. A100); ``fp8_gemm_efficiency``: the fraction of it a large FP8 GEMM sustains
    (``null``: ``gemm_efficiency``). ``hbm_gb_s``: datasheet HBM bandwidth, GB/s;
    ``hbm_efficiency``: the fraction of it a streaming kernel reaches (a device-to-device copy,
    bytes read + written; 1.0 where not measured): what every memory-bound term of the planner
    runs at. ``memory_gib``: device memory as the driver reports it;
    ``reserved_gib``: what the CUDA context, NCCL buffers, cuBLAS workspaces and allocator
    fragmentation take from it. ``ep_overlap_efficiency``: the share of the ideal all-to-all
    hiding of ``parallel.ep_overlap`` (the planner's ``merged_pairs`` pieces,
    :func:`moetrain.planner.timing.merged_pair_hidden`) that this cluster achieves, as
    ``benchmarks/bench_emulated_network.py`` measures it (1.0, the ideal, where not measured).

    Measured on the cluster (``python -m moetrain.calibrate`` writes both):
    ``collective_gb_s``: ``{tier: {op: GB/s}}``, the bus bandwidth per GPU that each collective
    (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``p2p``) reached on that tier
    (``nvlink``, ``rail``, ``spine``), efficiency included: where given it replaces
    ``<tier>_gb_s × <tier>_efficiency`` for that collective (:meth:`bandwidth`).
    ``elementwise_efficiency``: the share of the achievable HBM bandwidth that a layer's
    memory-bound kernels (norms, residual adds, RoPE, SwiGLU, routing, permutation), forward and
    backward as autograd runs them, reach (1.0 where not measured).
    ``layer_efficiency``: the planner's compute time of one layer of the calibrated model
    (forward + backward, GEMMs, attention and elementwise kernels at the terms above) over what
    the software measured for it: the host overheads, unfused kernels and dispatch work no
    other term counts. Every compute term of the planner is divided by it (1.0 where not
    measured).
    ``gemm_k0``: the short-K loss of this device's GEMMs in elements of K
    (:func:`moetrain.planner.timing.k_efficiency`), where measured; ``null``: the planner's
    ``TimingAssumptions.gemm_k0``.
    ``calibration``: the record of the measurement (when, where, the raw figures): read by
    people, not by the planner.
    """

    name: str
    gpus_per_node: int
    nvswitch_domain_gpus: int
    rails_per_node: int
    nodes_per_rail_group: int
    peak_tflops: float
    memory_gib: float
    hbm_gb_s: float
    nvlink_gb_s: float
    rail_gb_s: float
    spine_gb_s: float
    gpu: str = "GPU"
    description: str = ""
    sm_count: int = 132
    gemm_efficiency: float = 0.75
    attention_efficiency: float = 0.45
    fp8_peak_tflops: float | None = None
    fp8_gemm_efficiency: float | None = None
    hbm_efficiency: float = 1.0
    nvlink_efficiency: float = 0.80
    network_efficiency: float = 0.90
    nvlink_latency_us: float = 5.0
    rail_latency_us: float = 10.0
    spine_latency_us: float = 15.0
    reserved_gib: float = 5.0
    ep_overlap_efficiency: float = 1.0
    sources: tuple[str, ...] = ()
    elementwise_efficiency: float = 1.0
    layer_efficiency: float = 1.0
    gemm_k0: float | None = None
    collective_gb_s: dict[str, dict[str, float]] = field(default_factory=dict, hash=False)
    calibration: dict[str, Any] = field(default_factory=dict, hash=False)
    path: str | None = None

    @property
    def domain_nodes(self) -> int:
        """Nodes per NVSwitch domain."""
        return max(1, self.nvswitch_domain_gpus // self.gpus_per_node)

    def bandwidth(self, tier: str, op: str | None = None) -> float:
        """Achievable bus bandwidth of ``tier`` per GPU, bytes/s: what ``op`` was measured at
        there (``collective_gb_s``), else nominal × efficiency.

        Raises:
            ValueError: ``tier`` is not nvlink, rail or spine.
        """
        measured = self.collective_gb_s.get(tier, {}).get(op) if op else None
        if measured:
            return measured * 1e9
        if tier == "nvlink":
            return self.nvlink_gb_s * 1e9 * self.nvlink_efficiency
        if tier == "rail":
            return self.rail_gb_s * 1e9 * self.network_efficiency
        if tier == "spine":
            return self.spine_gb_s * 1e9 * self.network_efficiency
        raise ValueError(f"tier {tier!r}: not one of nvlink, rail, spine")

    def hbm_bandwidth(self) -> float:
        """Achievable HBM bandwidth per GPU, bytes/s (datasheet × ``hbm_efficiency``)."""
        return self.hbm_gb_s * 1e9 * self.hbm_efficiency

    def latency(self, tier: str) -> float:
        """Latency of one collective step on ``tier``, seconds."""
        return {"nvlink": self.nvlink_latency_us, "rail": self.rail_latency_us,
                "spine": self.spine_latency_us, "none": 0.0}[tier] * 1e-6

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sources"] = list(self.sources)
        return d


_REQUIRED = ("name", "gpus_per_node", "nvswitch_domain_gpus", "rails_per_node", "nodes_per_rail_group",
             "peak_tflops", "memory_gib", "hbm_gb_s", "nvlink_gb_s", "rail_gb_s", "spine_gb_s")


def list_profiles() -> list[str]:
    """Names of the profiles shipped in ``slurm/profiles/``."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def _profile_from_dict(raw: dict[str, Any], where: str) -> ClusterProfile:
    known = {f.name for f in dataclasses.fields(ClusterProfile)}
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise ProfileError(f"{where}: unknown key {key!r}. Fix: use only {', '.join(sorted(known - {'path'}))}")
        flat[key] = value
    missing = [k for k in _REQUIRED if k not in flat]
    if missing:
        raise ProfileError(f"{where}: missing {', '.join(missing)}. Fix: add them (see slurm/profiles/h100-superpod.yaml)")
    if "sources" in flat:
        flat["sources"] = tuple(flat["sources"] or ())
    for key in ("collective_gb_s", "calibration"):
        if flat.get(key) is None:
            flat.pop(key, None)
        elif not isinstance(flat[key], dict):
            raise ProfileError(f"{where}: {key}: expected a mapping, got {type(flat[key]).__name__}")
    prof = ClusterProfile(**flat, path=where)
    if prof.gpus_per_node <= 0 or prof.nvswitch_domain_gpus % prof.gpus_per_node:
        raise ProfileError(f"{where}: nvswitch_domain_gpus={prof.nvswitch_domain_gpus} must be a positive multiple "
                           f"of gpus_per_node={prof.gpus_per_node}. Fix: give the domain size in GPUs")
    for k in ("rails_per_node", "nodes_per_rail_group", "peak_tflops", "memory_gib", "hbm_gb_s",
              "nvlink_gb_s", "rail_gb_s", "spine_gb_s"):
        if getattr(prof, k) <= 0:
            raise ProfileError(f"{where}: {k}={getattr(prof, k)!r} must be positive")
    if not 0 < prof.hbm_efficiency <= 1:
        raise ProfileError(f"{where}: hbm_efficiency={prof.hbm_efficiency!r} must lie in (0, 1] "
                           "(the measured share of hbm_gb_s a device-to-device copy reaches)")
    for tier, ops in prof.collective_gb_s.items():
        if tier not in LINK_TIERS or not isinstance(ops, dict):
            raise ProfileError(f"{where}: collective_gb_s.{tier}: expected a tier (nvlink, rail, spine) mapping "
                               "collectives to GB/s")
        for op, v in ops.items():
            if op not in COLLECTIVES or not isinstance(v, (int, float)) or v <= 0:
                raise ProfileError(f"{where}: collective_gb_s.{tier}.{op}={v!r}: expected one of "
                                   f"{', '.join(COLLECTIVES)} with a positive bus bandwidth in GB/s")
    if not prof.layer_efficiency > 0:
        raise ProfileError(f"{where}: layer_efficiency={prof.layer_efficiency!r} must be positive")
    if not 0 < prof.elementwise_efficiency <= 1:
        raise ProfileError(f"{where}: elementwise_efficiency={prof.elementwise_efficiency!r} must lie in (0, 1] "
                           "(the measured share of the copy bandwidth the elementwise kernels reach)")
    if not 0 <= prof.ep_overlap_efficiency <= 1:
        raise ProfileError(f"{where}: ep_overlap_efficiency={prof.ep_overlap_efficiency!r} must lie in [0, 1] "
                           "(the measured share of the ideal hiding)")
    return prof


def load_profile(profile: "str | Path | ClusterProfile") -> ClusterProfile:
    """A profile by name (``h100-superpod``), by path, or passed through.

    Raises:
        ProfileError: no such profile, or the file is malformed.
    """
    if isinstance(profile, ClusterProfile):
        return profile
    p = Path(profile)
    if not p.suffix and not p.exists():
        p = PROFILE_DIR / f"{profile}.yaml"
    if not p.is_file():
        raise ProfileError(f"profile {str(profile)!r}: no such file or name. "
                           f"Fix: use one of {', '.join(list_profiles()) or '(none found)'} or a YAML path")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ProfileError(f"profile {str(p)!r}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ProfileError(f"profile {str(p)!r}: expected a mapping of keys to values")
    return _profile_from_dict(raw, str(p))


def generic_profile(gpus_per_node: int, name: str = "generic") -> ClusterProfile:
    """A profile for a job that names none: one NVSwitch domain per node, one rail per GPU, and
    every node in one rail group. Bandwidths are H100-class placeholders; the planner should be
    given a real profile."""
    g = max(1, gpus_per_node)
    return ClusterProfile(
        name=name, gpus_per_node=g, nvswitch_domain_gpus=g, rails_per_node=g, nodes_per_rail_group=1 << 30,
        peak_tflops=989.4, memory_gib=79.1, hbm_gb_s=3350, nvlink_gb_s=450, rail_gb_s=50, spine_gb_s=50,
        description="no profile given: one NVSwitch domain per node, all nodes in one rail group")


# ---------------------------------------------------------------------------------------------
# Nodes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """One node of an allocation. ``domain`` and ``rail_group`` are small integers; nodes with
    equal values share an NVSwitch domain / a set of rail leaf switches."""

    name: str
    domain: int
    rail_group: int


@dataclass(frozen=True)
class Allocation:
    """The job's nodes in SLURM task order (global rank r runs on ``nodes[r // tasks_per_node]``).

    ``source`` says where the domain / rail-group membership came from; ``notes`` records every
    assumption made while building it."""

    nodes: tuple[Node, ...]
    source: str = "synthetic"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def summary(self) -> str:
        groups: dict[int, int] = {}
        domains: dict[int, int] = {}
        for n in self.nodes:
            groups[n.rail_group] = groups.get(n.rail_group, 0) + 1
            domains[n.domain] = domains.get(n.domain, 0) + 1
        gs = sorted(groups.values(), reverse=True)
        ds = sorted(set(domains.values()), reverse=True)
        return (f"{len(self.nodes)} nodes in {len(groups)} rail group(s) of {_sizes(gs)} nodes, "
                f"{len(domains)} NVSwitch domain(s) of {_sizes(ds)} nodes ({self.source})")


def _sizes(values: list[int]) -> str:
    uniq = sorted(set(values), reverse=True)
    return "/".join(str(v) for v in uniq)


_BRACKET = re.compile(r"\[([^\]]*)\]")


def _expand_one(pattern: str) -> list[str]:
    """``gpu[01-03,07]x[a,b]`` → the cartesian product, zero padding kept."""
    m = _BRACKET.search(pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end():]
    out: list[str] = []
    for part in m.group(1).split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()):
                raise ProfileError(f"node list {pattern!r}: range {part!r} is not numeric. Fix: write e.g. gpu[001-016]")
            width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
            a, b = int(lo), int(hi)
            if b < a:
                raise ProfileError(f"node list {pattern!r}: range {part!r} runs backwards")
            values = [str(i).zfill(width) for i in range(a, b + 1)]
        else:
            values = [part]
        for v in values:
            out.extend(head + v + rest for rest in _expand_one(tail))
    return out


def expand_nodelist(text: str) -> list[str]:
    """Expand a SLURM host list (``SLURM_JOB_NODELIST``) into node names, in order.

    ``"gpu[001-003],dgx-a[1,4]"`` → ``["gpu001", "gpu002", "gpu003", "dgx-a1", "dgx-a4"]``.
    Commas inside brackets separate ranges; several bracket groups in one name multiply.

    Raises:
        ProfileError: unbalanced brackets or a non-numeric range.
    """
    names: list[str] = []
    depth, start = 0, 0
    text = text.strip()
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ProfileError(f"node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            item = text[start:i].strip()
            if item:
                names.extend(_expand_one(item))
            start = i + 1
    if depth != 0:
        raise ProfileError(f"node list {text!r}: unbalanced '['")
    return names


def _kv_line(line: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for tok in line.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k.strip().lower()] = v.strip()
    return out


def parse_topology(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Leaf switches and NVLink blocks from ``scontrol show topology`` or a ``topology.conf``.

    Returns ``(leaf_of_node, block_of_node)``: the name of the lowest switch listing each node
    (``SwitchName=s1 Nodes=gpu[01-32]``, topology/tree) and of the block listing it
    (``BlockName=b1 Nodes=...``, topology/block, which SLURM uses for NVL72 racks). Nodes
    under the same leaf switch form one rail group. Comments (``#``) are ignored.
    """
    leaf: dict[str, str] = {}
    leaf_level: dict[str, int] = {}
    block: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kv = _kv_line(line)
        if "nodes" not in kv:
            continue
        names = expand_nodelist(kv["nodes"])
        if "blockname" in kv:
            for n in names:
                block.setdefault(n, kv["blockname"])
        elif "switchname" in kv:
            level = int(kv.get("level", "0") or 0)
            for n in names:
                if n not in leaf or level < leaf_level[n]:
                    leaf[n], leaf_level[n] = kv["switchname"], level
    return leaf, block


def read_slurm_topology(timeout_s: float = 10.0) -> str | None:
    """Text of ``scontrol show topology``, or None where scontrol is absent or fails."""
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        res = subprocess.run([exe, "show", "topology"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 and res.stdout.strip() else None


def synthetic_allocation(n_nodes: int, profile: ClusterProfile, prefix: str = "node") -> Allocation:
    """``n_nodes`` nodes as a scheduler with topology awareness would give them: consecutive
    nodes fill NVSwitch domains, then rail groups. Used for inspection and planning."""
    if n_nodes <= 0:
        raise ProfileError(f"--nodes {n_nodes}: must be positive")
    width = max(4, len(str(n_nodes - 1)))
    nodes = tuple(Node(f"{prefix}{i:0{width}d}", i // profile.domain_nodes, i // profile.nodes_per_rail_group)
                  for i in range(n_nodes))
    return Allocation(nodes, source=f"--nodes {n_nodes}, contiguous")


def allocation_from_names(names: Iterable[str], profile: ClusterProfile, topology: str | None = None) -> Allocation:
    """An allocation of named nodes (SLURM task order kept).

    ``topology``: text of ``scontrol show topology`` / ``topology.conf``. Rail groups are the
    nodes sharing a leaf switch; NVSwitch domains are topology/block blocks. Where the text does
    not place a node (or there is no text), nodes are assumed to fill domains and rail groups
    in list order, and a note says so.
    """
    names = list(names)
    if len(set(names)) != len(names):
        raise ProfileError("node list: a node appears twice. Fix: pass each node once")
    leaf, block = parse_topology(topology) if topology else ({}, {})
    notes: list[str] = []
    groups: list[int] = []
    domains: list[int] = []
    group_ids: dict[str, int] = {}
    block_ids: dict[str, int] = {}
    missing_leaf = [n for n in names if n not in leaf]
    if leaf and missing_leaf:
        notes.append(f"{len(missing_leaf)} node(s) missing from the switch topology (e.g. {missing_leaf[0]}): "
                     f"each put in a rail group of its own")
    if not leaf:
        notes.append(f"no switch topology: assumed the nodes fill rail groups of {profile.nodes_per_rail_group} "
                     f"in list order")
    for i, n in enumerate(names):
        if leaf:
            key = leaf.get(n, f"?{n}")
        else:
            key = f"#{i // profile.nodes_per_rail_group}"
        groups.append(group_ids.setdefault(key, len(group_ids)))
    if profile.domain_nodes > 1:
        if block:
            for i, n in enumerate(names):
                key = block.get(n, f"?{n}")
                domains.append(block_ids.setdefault(key, len(block_ids)))
            lost = [n for n in names if n not in block]
            if lost:
                notes.append(f"{len(lost)} node(s) in no topology/block block: each is its own NVSwitch domain")
        else:
            notes.append(f"no topology/block information: assumed the nodes fill NVSwitch domains of "
                         f"{profile.domain_nodes} in list order")
            domains = [i // profile.domain_nodes for i in range(len(names))]
    else:
        domains = list(range(len(names)))
    src = "switch topology" if leaf else "node order"
    return Allocation(tuple(Node(n, d, g) for n, d, g in zip(names, domains, groups)), source=src,
                      notes=tuple(notes))
