"""Context parallelism in the trainer (ring attention + chunked data + MoE losses over split
sequences) gives the single-process losses and gradients."""

from __future__ import annotations

import pytest

from multiproc import run_distributed
from test_equivalence import assert_matches, merged, reference, train_and_capture  # noqa: F401 - fixture

CASES = [
    {"cp": 2},
    {"cp": 2, "dp": 2, "ep": 2},  # ep folded over cp
    {"cp": 2, "ep": 2},  # ep over the cp ranks of one dp slice
]


@pytest.mark.parametrize("parallel", CASES, ids=["-".join(f"{k}{v}" for k, v in c.items()) for c in CASES])
def test_context_parallel_matches_single_process(parallel, reference, tiny_shards, tmp_path):  # noqa: F811
    world = parallel.get("dp", 1) * parallel["cp"]
    results = run_distributed(train_and_capture, world, str(tiny_shards), str(tmp_path), parallel, {})
    assert_matches(merged(results), reference)


AC_CASES = [
    ({"dp": 2, "ep": 2, "activation_checkpointing": "full"}, 2),
    ({"cp": 2, "activation_checkpointing": "selective"}, 2),
]


@pytest.mark.parametrize("parallel, world", AC_CASES, ids=["dp2-ep2-full-ac", "cp2-selective-ac"])
def test_activation_checkpointing_matches_single_process(parallel, world, reference, tiny_shards, tmp_path):  # noqa: F811
    results = run_distributed(train_and_capture, world, str(tiny_shards), str(tmp_path), parallel, {})
    assert_matches(merged(results), reference)
