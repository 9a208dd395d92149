"""The names of the parallel axes, defined once: configs (``parallel.<axis>``), the rank map
(:mod:`moetrain.topology`), the device meshes (:mod:`moetrain.parallel.state`) and the logs use
them. An *axis* is a dimension of the device mesh (a *dim* is a tensor dimension).

* ``pp`` pipeline, ``dp`` data, ``cp`` context, ``tp`` tensor: the dense mesh, world = pp × dp × cp
  × tp, tp innermost;
* ``edp`` × ``ep``: the dp × cp ranks of one pipeline stage split for the experts (ep innermost:
  parallel folding, as Megatron-Core and TorchTitan);
* flattened axes: ``dp_cp`` (the dense parameters' data-parallel group), ``cp_tp`` (the ranks
  that share one sequence), ``dp_cp_tp`` (ranks that see different tokens of a parameter that
  tensor parallelism does not split: the MoE router and shared experts, the q/k norms) and
  ``edp_tp`` (the replicas of the same experts when expert-tensor parallelism is off).
"""

PP, DP, CP, TP = "pp", "dp", "cp", "tp"
EDP, EP = "edp", "ep"
DP_CP, CP_TP, DP_CP_TP, EDP_TP = "dp_cp", "cp_tp", "dp_cp_tp", "edp_tp"
DENSE_AXES = (PP, DP, CP, TP)
# tp before ep: every group the experts use is then a run of consecutive axes (FSDP's edp_tp
# next to the experts' ep), as DTensor needs to flatten or concatenate them.
EXPERT_AXES = (PP, EDP, TP, EP)
