"""The equivalence tests can fail: a planted fault in what a layout adds must break them.

Each case trains the layout of an equivalence test (tests/test_equivalence.py,
tests/test_context_integration.py) with one fault planted in the running ranks, and checks that
``assert_matches`` — the same comparison with the same tolerances — rejects the result:

* ``dispatch_split``: the expert all-to-all sends each rank's rows in the right amount but splits
  them over that rank's local experts one expert off (the per-expert counts rotated), so tokens
  reach the wrong expert (dp2 × ep2, 2 local experts).
* ``zero_divide``: FSDP2 divides the reduced gradients by 2 × dp instead of dp (dp2).
* ``cp_causal``: ring attention takes the visible half of an off-diagonal block from the wrong
  side (keys of the later chunk for the queries of the earlier one: the future leaks) (cp2).

The unfaulted layouts pass in their own modules.
"""

from __future__ import annotations

import pytest

from multiproc import run_distributed
from test_equivalence import assert_matches, merged, reference, train_and_capture  # noqa: F401 - fixture


def _plant(fault: str) -> None:
    if fault == "dispatch_split":
        from moetrain.parallel.expert import AllToAllDispatcher

        send_sorted = AllToAllDispatcher.send_sorted

        def wrong_split(self, x_sorted, counts_E, local):
            rotated = counts_E.view(self.ep, self.num_local).roll(1, dims=1).reshape(-1)
            return send_sorted(self, x_sorted, rotated, local)

        AllToAllDispatcher.send_sorted = wrong_split
    elif fault == "zero_divide":
        from torch.distributed.fsdp import FSDPModule

        set_factor = FSDPModule.set_gradient_divide_factor
        FSDPModule.set_gradient_divide_factor = lambda self, factor: set_factor(self, 2 * factor)
    elif fault == "cp_causal":
        from moetrain.parallel import context

        visible = context._visible_part
        swap = {context._KV_FIRST: context._Q_SECOND, context._Q_SECOND: context._KV_FIRST}
        context._visible_part = lambda rank, src, causal: (lambda p: swap.get(p, p))(visible(rank, src, causal))
    else:
        raise ValueError(fault)


def train_with_fault(rank: int, world: int, data: str, run_dir: str, parallel: dict, fault: str) -> dict:
    _plant(fault)  # in this rank's process only
    return train_and_capture(rank, world, data, run_dir, parallel)


CASES = [("dispatch_split", {"dp": 2, "ep": 2}, 2), ("zero_divide", {"dp": 2}, 2), ("cp_causal", {"cp": 2}, 2)]


@pytest.mark.parametrize("fault, parallel, world", CASES, ids=[c[0] for c in CASES])
def test_planted_fault_fails_the_equivalence_test(fault, parallel, world, reference, tiny_shards, tmp_path):  # noqa: F811
    results = run_distributed(train_with_fault, world, str(tiny_shards), str(tmp_path), parallel, fault)
    result = merged(results)  # the ranks agree with each other, faulty or not
    with pytest.raises(AssertionError):
        assert_matches(result, reference)
