"""Kimi Delta Attention (KDA): the gated delta rule with a decay per key channel (Kimi Team 2025,
"Kimi Linear: An Expressive, Efficient Attention Architecture", §3), as Kimi Linear's linear
attention layers compute it.

Shape legend: B batch, S sequence, D hidden, H heads (queries, keys and values alike), Dh head
dim, R the gates' low rank (= Dh, as Kimi Linear has it).

The recurrence per head, with a state S_t ∈ R^{Dh×Dh} (ibid., eq. 1):

    S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ,      o_t = S_tᵀ q_t

It is gated DeltaNet's (:mod:`moetrain.model.gated_deltanet`) with the scalar decay α_t replaced
by a vector α_t ∈ (0, 1]^{Dh} that decays each row of the state (each key channel) at its own rate,
so the two share their paths: :func:`~moetrain.model.gated_deltanet.chunk_gated_delta_rule` (the
chunked WY form, pure PyTorch, what runs on CPU) and
:func:`~moetrain.model.gated_deltanet.recurrent_gated_delta_rule` take a per-channel log decay
g [B, S, H, Dh]; :func:`fla_kda` is flash-linear-attention's Triton kernel
(``fla.ops.kda.chunk_kda``, ``model.linear_attention_backend: fla``).

The layer (:class:`KimiDeltaAttention`, Kimi Linear's ``KimiDeltaAttention`` with its checkpoint's
parameter names): q, k, v projections, each followed by a causal depthwise convolution of width
``conv_kernel`` and SiLU; β = σ(b_proj x) per head; the decay through a rank-R bottleneck,
g = −exp(A_log_h) · softplus(f_b_proj(f_a_proj x) + dt_bias) per channel; the delta rule (q, k
L2-normalised, q scaled by Dh^−½); each head's output RMS-normalised and gated by the sigmoid of
another rank-R projection, g_b_proj(g_a_proj x) (``o_norm``); ``o_proj``.

Packed documents, tensor and context parallelism work as for gated DeltaNet: the state and the
convolution restart at every document; tp splits the heads (q/k/v/b/f_b/g_b projections by rows,
the convolutions, ``A_log`` and ``dt_bias`` by head, ``o_proj`` by columns; the rank-R
down-projections ``f_a_proj`` and ``g_a_proj`` and the norm's weight whole on every rank); cp
exchanges each token's q, k, v, f, b for the whole sequence of 1/cp of the heads (Ulysses), which
per layer and micro-batch moves 4·Dh + 1 values per head and token to the heads, Dh back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.attention import DocumentMask
from moetrain.model.gated_deltanet import GatedRMSNorm, HeadExchange, chunk_gated_delta_rule, over_heads
from moetrain.model.layers import Linear, local_cast

__all__ = ["KimiDeltaAttention", "fla_kda", "kda_rule"]


def fla_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            chunk_size: int = 64, initial_state: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~moetrain.model.gated_deltanet.chunk_gated_delta_rule` with per-channel decays
    through flash-linear-attention's KDA kernel (``fla.ops.kda.chunk_kda``, Triton: CUDA): the same
    arguments (q, k [B, S, H, Dh] not yet normalised, v [B, S, H, Dh], g [B, S, H, Dh] log decays,
    beta [B, S, H]) and output o [B, S, H, Dh] in v's dtype; q and k are normalised in the kernel
    (``use_qk_l2norm_in_kernel``), the kernel chooses its chunk length, and the final state is not
    returned (None). g and beta go in fp32."""
    from fla.ops.kda import chunk_kda

    o, _ = chunk_kda(q, k, v.to(q.dtype), g.float(), beta.float(), scale=q.shape[-1] ** -0.5,
                     initial_state=initial_state, output_final_state=False, use_qk_l2norm_in_kernel=True)
    return o.to(v.dtype), None


def kda_rule(backend: str):
    """The delta rule of ``model.linear_attention_backend`` for KDA layers: ``torch``
    (:func:`~moetrain.model.gated_deltanet.chunk_gated_delta_rule`) or ``fla`` (:func:`fla_kda`).

    Raises:
        ValueError: an unknown backend.
    """
    if backend == "torch":
        return chunk_gated_delta_rule
    if backend == "fla":
        return fla_kda
    raise ValueError(f"linear attention backend {backend!r}: expected torch or fla")


class KimiDeltaAttention(nn.Module):
    """Kimi Linear's KDA token mixer (module docstring). x: [B, S, D] → [B, S, D].

    Args:
        dim: D. num_heads: H (HF ``linear_num_heads``). head_dim: Dh (``linear_head_dim``).
        conv_kernel: the causal depthwise convolutions' width (``linear_conv_kernel_dim``).
        norm_eps: the gated norm's epsilon. chunk_size: C of the chunked rule.

    Parameters (the names of Kimi Linear's checkpoints): ``q_proj``, ``k_proj``, ``v_proj``
    [H·Dh, D]; ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` weights [H·Dh, 1, conv_kernel];
    ``b_proj`` [H, D]; ``f_a_proj`` [Dh, D], ``f_b_proj`` [H·Dh, Dh]; ``A_log`` [H] (the checkpoint's
    [1, 1, H, 1]); ``dt_bias`` [H·Dh]; ``g_a_proj`` [Dh, D], ``g_b_proj`` [H·Dh, Dh];
    ``o_norm.weight`` [Dh]; ``o_proj`` [D, H·Dh].
    """

    compute_dtype: torch.dtype | None = None

    def __init__(self, dim: int, num_heads: int, head_dim: int, conv_kernel: int = 4, norm_eps: float = 1e-6,
                 chunk_size: int = 64):
        super().__init__()
        self.num_heads, self.head_dim, self.chunk_size = num_heads, head_dim, chunk_size
        width = num_heads * head_dim
        self.q_proj = Linear(dim, width, bias=False)
        self.k_proj = Linear(dim, width, bias=False)
        self.v_proj = Linear(dim, width, bias=False)
        self.q_conv1d = nn.Conv1d(width, width, conv_kernel, groups=width, bias=False)
        self.k_conv1d = nn.Conv1d(width, width, conv_kernel, groups=width, bias=False)
        self.v_conv1d = nn.Conv1d(width, width, conv_kernel, groups=width, bias=False)
        self.b_proj = Linear(dim, num_heads, bias=False)
        self.f_a_proj = Linear(dim, head_dim, bias=False)
        self.f_b_proj = Linear(head_dim, width, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.g_a_proj = Linear(dim, head_dim, bias=False)
        self.g_b_proj = Linear(head_dim, width, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, norm_eps, gate="sigmoid")
        self.o_proj = Linear(width, dim, bias=False)
        # The delta rule's implementation (chunk_gated_delta_rule's signature).
        self.rule = chunk_gated_delta_rule
        # Context parallelism: exchanges tokens for heads (module docstring); None in one process.
        self.context: HeadExchange | None = None

    def _mix(self, mixed: torch.Tensor, first_head: int) -> torch.Tensor:
        """One stretch of tokens that shares a state (a sequence, or one document of it) of heads
        ``first_head`` … of this rank's: ``mixed`` [B, S, h, 4·Dh + 1] holds each head's q, k, v,
        the decay's pre-activation f and b; the convolutions, the gates and the delta rule.
        → o [B, S, h, Dh]."""
        B, S, h, _ = mixed.shape
        Dh = self.head_dim
        q, k, v, f, b = mixed.split([Dh, Dh, Dh, Dh, 1], dim=-1)
        rows = (first_head * Dh, h * Dh)  # this rank's heads (under tp these tensors hold them already)

        def conv(x: torch.Tensor, conv1d: nn.Conv1d) -> torch.Tensor:
            # Causal depthwise convolution: left-pad by width − 1, so position t sees t − width + 1 … t.
            w = local_cast(conv1d.weight, self.compute_dtype).narrow(0, *rows)
            x = F.pad(x.reshape(B, S, -1).transpose(1, 2), (w.shape[-1] - 1, 0)).to(w.dtype)
            return F.silu(F.conv1d(x, w, groups=w.shape[0])).transpose(1, 2).reshape(B, S, h, Dh)

        q, k, v = conv(q, self.q_conv1d), conv(k, self.k_conv1d), conv(v, self.v_conv1d)
        A_log = local_cast(self.A_log, None).narrow(0, first_head, h).float()
        dt_bias = local_cast(self.dt_bias, None).narrow(0, *rows).float().view(h, Dh)
        g = -A_log.exp().unsqueeze(-1) * F.softplus(f.float() + dt_bias)  # [B, S, h, Dh] log decays
        beta = torch.sigmoid(b.squeeze(-1).float())
        o, _ = self.rule(q, k, v, g, beta, self.chunk_size)
        return o

    def forward(self, x_BSD: torch.Tensor, doc: DocumentMask | None = None) -> torch.Tensor:
        """``doc``: the documents of the whole samples (:class:`~moetrain.model.attention.DocumentMask`):
        the state and the convolutions start afresh at every document; None: each sequence is one
        document."""
        B, S, _ = x_BSD.shape
        Dh = self.head_dim
        # -1 heads: under tensor parallelism the projections hold this rank's.
        q, k, v = (proj(x_BSD).view(B, S, -1, Dh) for proj in (self.q_proj, self.k_proj, self.v_proj))
        f = self.f_b_proj(self.f_a_proj(x_BSD)).view(B, S, -1, Dh)
        b = self.b_proj(x_BSD).view(B, S, -1, 1)
        z = self.g_b_proj(self.g_a_proj(x_BSD)).view(B, S, -1, Dh)
        mixed = torch.cat([q, k, v, f.to(q.dtype), b.to(q.dtype)], dim=-1)  # per head what the recurrence reads
        o = over_heads(mixed, doc, self.context, self._mix)
        o = self.o_norm(o, z.to(o.dtype))
        return self.o_proj(o.reshape(B, S, -1))
