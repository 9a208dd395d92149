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
(tests/test_compile.py). Not with tensor parallelism: in torch 2.13 a compiled region holding
DTensor redistributions fails in backward or, worse, gives the embedding a wrong gradient without
an error (:func:`moetrain.parallel.support.check_supported` refuses it).
"""

from __future__ import annotations

import torch

from moetrain.model.transformer import Transformer


def apply_compile(model: Transformer) -> None:
    """Compile every block of ``model`` (a whole model or a pipeline part) in place."""
    for block in model.layers.values():
        block._forward = torch.compile(block._forward)
