"""``train.compile``: each transformer block's computation compiled with ``torch.compile``.

Applied after activation checkpointing and before ZeRO/FSDP, as torchtitan orders them (TP → AC →
compile → FSDP), to each block's ``_forward`` in place — the block stays the same module, so its
parameter names, FSDP's and TP's hooks, and checkpoints do not change, and full recomputation
(``Block.forward``'s ``torch.utils.checkpoint``) wraps the compiled function, so the
recomputation runs compiled code too.

What compiles into one graph: norms, attention projections, RoPE, the attention kernel and the
dense MLP; the MoE's dispatch reads its split sizes on the host and runs collectives, where
dynamo breaks the graph and the surrounding pieces (router, shared experts, the combine)
compile separately. The ``loop`` experts stay eager (``torch.compiler.disable``: per-expert GEMMs
of data-dependent sizes give nothing to fuse and a recompilation per new size). Measured on the
demo model, CPU: 0.97× the eager step time after ~7 s of compilation with a warm cache
(``benchmarks/bench_compile.py``).

Composes with data, expert and context parallelism, ZeRO (FSDP2) and activation checkpointing
(tests/test_compile.py).

Under tensor parallelism the block is compiled by region: in torch 2.13 a compiled region that
holds DTensor redistributions (the tp plan's input hooks, the sharded projections) fails in
backward ("'Tensor' object has no attribute '_local_tensor'") or, worse, gives the embedding a
wrong gradient without an error. So only the attention core (q/k norm, RoPE, kernel:
:meth:`moetrain.model.layers.Attention.core`), the SwiGLU activation
(:meth:`moetrain.model.layers.FeedForward.act`) and the MoE layer (its tp hooks hand it local
tensors) are compiled; the projections, their redistributions and the norms stay eager (a
compiled norm feeding a tp region gave wrong gradients without SP too, measured). Proved equal
to eager with tp, tp + SP + recomputation, and expert-tensor parallelism.
"""

from __future__ import annotations

import torch

from moetrain.model.transformer import Transformer


def apply_compile(model: Transformer, tensor_parallel: bool = False) -> None:
    """Compile every block of ``model`` (a whole model or a pipeline part) in place: each block's
    ``_forward`` whole, or under ``tensor_parallel`` its regions free of DTensors (module doc)."""
    for block in model.blocks().values():
        if not tensor_parallel:
            block._forward = torch.compile(block._forward)
            continue
        if hasattr(block.attention, "core"):  # attention (gated DeltaNet has no DTensor-free core: eager)
            block.attention.core = torch.compile(block.attention.core)
        if block.feed_forward is not None:
            block.feed_forward.act = torch.compile(block.feed_forward.act)
        if block.moe is not None:
            block.moe.forward = torch.compile(block.moe.forward)
