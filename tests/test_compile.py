"""``train.compile`` (moetrain.parallel.compile): compiled blocks give the eager losses and
gradients, alone with full activation recomputation, composed with data + expert parallelism,
FSDP (ZeRO-2) and recomputation, with context parallelism (ring attention), and by region with
tensor parallelism (see moetrain.parallel.compile). Tolerances as in
test_equivalence (1e-5 relative losses; gradients 1e-5 of each tensor's largest entry): inductor
fuses elementwise chains and keeps fp32, so only summation orders change.

Slow by nature (a cold inductor compile of a block costs tens of seconds on this CPU); the
FX-graph cache makes reruns fast.
"""

from __future__ import annotations

import pytest

from multiproc import run_distributed
from test_equivalence import assert_matches, merged, train_and_capture

MODEL = {"vocab_size": 260}  # splits over tp
MOE = {"first_dense": 1}  # block 0 dense, block 1 MoE: both kinds of block compile


@pytest.fixture(scope="module")
def eager_reference(tiny_shards, tmp_path_factory):
    return run_distributed(train_and_capture, 1, str(tiny_shards), str(tmp_path_factory.mktemp("eager")), {}, {},
                           MOE, MODEL)[0]


@pytest.mark.slow
def test_compiled_equals_eager_with_recomputation(eager_reference, tiny_shards, tmp_path):
    result = run_distributed(train_and_capture, 1, str(tiny_shards), str(tmp_path),
                             {"activation_checkpointing": "full"}, {"compile": True}, MOE, MODEL, timeout=600)[0]
    assert_matches(result, eager_reference)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [
    {"dp": 2, "ep": 2, "zero_stage": 2, "activation_checkpointing": "full"},
    {"cp": 2},
    # under tp only the DTensor-free regions compile (moetrain.parallel.compile)
    {"tp": 2},
    {"tp": 2, "sequence_parallel": True, "activation_checkpointing": "full"},
], ids=["dp2-ep2-zero2-ac", "cp2", "tp2", "tp2-sp-ac"])
def test_compiled_composes_with_parallelism(parallel, eager_reference, tiny_shards, tmp_path):
    results = run_distributed(train_and_capture, 2, str(tiny_shards), str(tmp_path), parallel, {"compile": True},
                              MOE, MODEL, timeout=600)
    assert_matches(merged(results), eager_reference)


@pytest.mark.slow
def test_compiled_regions_compose_with_expert_tensor_parallelism(tiny_shards, tmp_path):
    # etp = 2: the tp sum around the expert compute runs inside the compiled MoE layer.
    from test_etp import etp_capture

    ref = run_distributed(etp_capture, 1, str(tiny_shards), str(tmp_path / "ref"), {})[0]
    results = run_distributed(etp_capture, 2, str(tiny_shards), str(tmp_path / "etp"), {"tp": 2, "etp": 2},
                              {"compile": True}, timeout=600)
    assert_matches(merged(results), ref)
