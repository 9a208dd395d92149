"""Layout planner: memory per GPU, step time, TFLOP/s and MFU of parallel layouts.

``Planner(shape, profile, n_nodes, global_batch).search()`` ranks the layouts that fit;
``python -m moetrain.plan`` is the command line. The model: ``model.py`` (parameters, FLOPs),
``memory.py`` (ZeRO and Korthikanti et al. 2022), ``traffic.py`` (collectives, tiers),
``timing.py`` (compute, communication, bubble, overlap; grouped expert GEMMs and the EP
all-to-all), ``search.py`` (enumerate, rank, explain), ``published.py`` (the comparison with
published dense and MoE runs).
"""

from moetrain.planner.layout import Layout, LayoutError, parse_layout_spec
from moetrain.planner.memory import MemoryAssumptions, memory_per_gpu
from moetrain.planner.model import ModelShape
from moetrain.planner.search import Plan, Planner, SearchResult, explain
from moetrain.planner.timing import TimingAssumptions, step_time

__all__ = ["Layout", "LayoutError", "parse_layout_spec", "MemoryAssumptions", "memory_per_gpu", "ModelShape",
           "Plan", "Planner", "SearchResult", "explain", "TimingAssumptions", "step_time"]
