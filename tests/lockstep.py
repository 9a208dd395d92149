"""Compare two training runs of the same mathematics whose last bits differ: tight while every
token goes to the same experts, exact in what cannot change after.

Two layouts (or a layout and its overlapped schedule) add their fp32 sums in different orders, so
their values differ in the last bits (u = 2⁻²⁴ relative per operation), and three mechanisms carry
that difference on, each bounding what a comparison can ask:

1. **fp32 reordering** alone: the losses stay within ~1e-6 relative over 20 steps (AdamW moves an
   element whose gradient is near zero by about its learning rate whatever the gradient's size, so
   the last bits grow a little each step).
2. **E4M3 rounding boundaries** (the fp8 dispatch wire, ``moe.dispatch_dtype: fp8``, keeps 3
   mantissa bits): an element within the last-bit difference of a boundary rounds up in one run and
   down in the other, one E4M3 step (2⁻³ of its binade) where the difference was 2⁻²⁴. The two runs
   cross boundaries from their second step on (every step, some of the ~30,000 routed elements lie
   that close), each crossing moves the loss by little, and together they keep the runs within
   1e-4 (measured: ≤ 2e-5 over 20 steps, three layouts, three instruction sets).
3. **A near-tie expert flip**: a token whose top-k router scores tie within the difference goes
   to another expert in one run, and its whole expert output changes: the loss jumps by ~1e-4
   relative that step (3e-4 measured) and the runs part as any two whose weights differ do. At which
   step this happens depends on the machine's summation order (its SIMD width, its BLAS kernels),
   not on whether the layout is right: one machine had none in 20 steps, others one at step 9 or 15.

So :func:`compare_in_lockstep` compares every step before the first one whose expert loads (the
tokens each expert received, per MoE layer, which a flipped token changes) differ at the tolerance
of mechanisms 1-2 the caller states; from that step on, what a flip cannot change exactly (the
samples each step draws, the step count) and finite losses within an envelope of what rounding
can do to this run at all (:func:`envelope`: the distance, by that step, between the reference and
the same run with its wire in another format, measured in the same test).

:class:`Recorder` is installed inside each rank's process (it wraps the trainer's batch loader);
the test process merges the ranks' records with :func:`merge_ranks`.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch


def _row_hashes(rows: torch.Tensor) -> set[int]:
    """64-bit digests of the rows of a 2-D tensor (their bytes), the same in every process."""
    data = rows.detach().cpu().contiguous()
    return {int.from_bytes(hashlib.blake2b(r.numpy().tobytes(), digest_size=8).digest(), "little") for r in data}


class Recorder:
    """Per optimizer step, in this rank: the set of samples drawn (digests of their input
    tokens). A step starts when the trainer draws its batch (``trainer.loader.next_batch``)."""

    def __init__(self) -> None:
        self.samples: list[set[int]] = []

    def install(self, trainer: Any) -> "Recorder":
        next_batch = trainer.loader.next_batch

        def recording_next_batch():
            micro_batches = next_batch()
            self.samples.append(set().union(*(_row_hashes(mb.inputs) for mb in micro_batches)))
            return micro_batches

        trainer.loader.next_batch = recording_next_batch
        return self

    def result(self) -> list[list[int]]:
        return [sorted(s) for s in self.samples]


def merge_ranks(records: list[list[list[int]]]) -> list[set[int]]:
    """The union over ranks, per step, of :meth:`Recorder.result` (each data-parallel rank draws
    its own share; tensor-parallel ranks the same samples)."""
    steps = len(records[0])
    assert all(len(r) == steps for r in records), "the ranks trained different numbers of steps"
    return [set().union(*(set(r[i]) for r in records)) for i in range(steps)]


def expert_loads(results: list[Any]) -> list[dict[str, list[int]]]:
    """Per step, the tokens each expert received, per MoE layer (``StepResult.extra``)."""
    return [{name: load["tokens"] for name, load in r.extra["expert_load"].items()} for r in results]


def steps_before_a_flip(loads: list[dict], ref_loads: list[dict]) -> int:
    """How many leading steps routed the same number of tokens to every expert in both runs."""
    k = 0
    for a, b in zip(loads, ref_loads):
        if a != b:
            break
        k += 1
    return k


def envelope(ref_losses: list[float], other_losses: list[float]) -> list[float]:
    """Per step, the largest relative distance by then between the reference and the same run with
    its wire in another format: how far rounding can move this run at all."""
    out, worst = [], 0.0
    for a, b in zip(other_losses, ref_losses):
        worst = max(worst, abs(a - b) / abs(b))
        out.append(worst)
    return out


def compare_in_lockstep(name: str, run: dict, ref: dict, rel: float, bound: list[float] | None = None) -> int:
    """Compare ``run`` with ``ref`` as the module docstring says. Each is a dict with ``losses``
    (per step), ``loads`` (:func:`expert_loads`) and ``samples`` (:func:`merge_ranks`). The losses
    are within ``rel`` (relative) at every step before the first expert flip; the samples and the
    step count are equal and the losses finite at every step; with ``bound`` (:func:`envelope`),
    each loss from the flip on is within that step's envelope. Step 1 (the same weights) must
    route alike. Returns the number of steps before the flip; ``name`` labels the messages."""
    losses, ref_losses = run["losses"], ref["losses"]
    assert len(losses) == len(ref_losses), f"{name}: {len(losses)} steps, the reference {len(ref_losses)}"
    assert run["samples"] == ref["samples"], f"{name}: the steps drew other samples than the reference"
    assert all(math.isfinite(x) for x in losses), f"{name}: non-finite losses {losses}"
    k = steps_before_a_flip(run["loads"], ref["loads"])
    assert k >= 1, f"{name}: step 1, from the same weights, routed other tokens: {run['loads'][0]} vs {ref['loads'][0]}"
    for step, (a, b) in enumerate(zip(losses[:k], ref_losses[:k]), 1):
        assert abs(a - b) <= rel * abs(b), f"{name}: step {step} (before any expert flip): loss {a} vs {b}"
    if bound is not None:
        for step, (a, b, e) in enumerate(zip(losses, ref_losses, bound), 1):
            if step > k:
                assert abs(a - b) <= max(e, rel) * abs(b), \
                    f"{name}: step {step} (an expert flipped at step {k + 1}): loss {a} vs {b}, beyond the envelope {e:.2e}"
    return k
