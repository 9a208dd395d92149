"""``train.compile`` (moetrain.parallel.compile): compiled blocks give the eager losses and
gradients, alone with full activation recomputation, composed with data + expert parallelism,
FSDP (ZeRO-2) and recomputation, and with context parallelism (ring attention). Refused with
tensor parallelism (wrong gradients in torch 2.13, see moetrain.parallel.support). Tolerances as in
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
], ids=["dp2-ep2-zero2-ac", "cp2"])
def test_compiled_composes_with_parallelism(parallel, eager_reference, tiny_shards, tmp_path):
    results = run_distributed(train_and_capture, 2, str(tiny_shards), str(tmp_path), parallel, {"compile": True},
                              MOE, MODEL, timeout=600)
    assert_matches(merged(results), eager_reference)


def test_compile_with_tensor_parallelism_is_refused(tiny_shards, tmp_path):
    from moetrain.config import ConfigError
    from moetrain.parallel.support import check_supported

    from conftest import tiny_config

    with pytest.raises(ConfigError, match="train.compile"):
        check_supported(tiny_config(tiny_shards, tmp_path, parallel={"tp": 2}, model=MODEL, train={"compile": True}),
                        "cpu")
