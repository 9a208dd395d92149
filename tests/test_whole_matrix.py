"""moetrain/parallel/whole_matrix.py: every matrix of a sharded layout computed whole, once, on
one owner, the work spread over the ranks that share it, and the traffic the least a
gather-to-owner-and-scatter-back can send — on four gloo ranks, for the placements moetrain's
layouts produce (FSDP's row shards, tensor parallelism's column shards, both on a 2-D mesh,
HSDP's replicated shards, ZeRO-0's replicas, expert stacks sharded along the expert dim)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from moetrain.parallel.whole_matrix import WholeMatrices
from moetrain.planner.model import newton_schulz_flops

from multiproc import run_distributed


def matrix_fn(x: torch.Tensor) -> torch.Tensor:
    """A function of the whole matrix (each block of the result depends on every block of x)."""
    return x @ x.mT @ x + 1.0


# (shapes, mesh shape, placements, elements one apply() sends over all ranks, as a function of
# the shapes) — the analytic minimum of computing each matrix once on one of its holders
CASES = {
    "fsdp-rows": ([(12, 8)] * 6 + [(8, 20)] * 2, (4,), (Shard(0),), lambda sizes: sum(2 * s * 3 // 4 for s in sizes)),
    "tp-cols-on-fsdp": ([(8, 12)] * 4, (2, 2), (Shard(0), Shard(1)), lambda sizes: sum(2 * s * 3 // 4 for s in sizes)),
    # HSDP: two replicas of two row shards: the other half in, the result out to 3 holders
    "hsdp": ([(12, 8)] * 4, (2, 2), (Replicate(), Shard(0)), lambda sizes: sum(s // 2 + 3 * s // 2 for s in sizes)),
    "zero0-replicas": ([(6, 10)] * 8, (4,), (Replicate(),), lambda sizes: sum(3 * s for s in sizes)),
    "expert-stack": ([(8, 6, 10)] * 2, (4,), (Shard(0),), lambda sizes: 0),
}


def whole_matrix_run(rank: int, world: int, case: str) -> dict:
    shapes, mesh_shape, placements, _ = CASES[case]
    mesh = init_device_mesh("cpu", mesh_shape)
    full = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    params = [distribute_tensor(f, mesh, placements) for f in full]
    seen = []

    def counted(x):
        seen.append(x.shape[0])
        return matrix_fn(x)

    plan = WholeMatrices(params, torch.distributed.group.WORLD, cost=newton_schulz_flops)
    out = plan.apply([p.to_local() for p in params], counted)
    errors = []
    for f, p, o in zip(full, params, out):
        want = distribute_tensor(matrix_fn(f if f.ndim == 3 else f[None])[0 if f.ndim == 2 else slice(None)],
                                 mesh, placements).to_local()
        errors.append((o - want).abs().max().item() if o.numel() else 0.0)
    return {"errors": errors, "computed": sum(seen), "traffic": plan.traffic(4)}


@pytest.mark.parametrize("case", list(CASES))
def test_each_matrix_is_computed_once_whole_and_sent_no_more_than_needed(case):
    shapes, _, _, least = CASES[case]
    outs = run_distributed(whole_matrix_run, 4, case)
    for rank, out in enumerate(outs):
        assert max(out["errors"]) < 1e-4, f"rank {rank}: its blocks differ from the whole matrix's result"
    matrices = [(s[-2], s[-1]) for s in shapes for _ in range(s[0] if len(s) == 3 else 1)]
    # each matrix once, over all ranks
    assert sum(out["computed"] for out in outs) == len(matrices)
    traffic = outs[0]["traffic"]
    assert all(out["traffic"] == traffic for out in outs)  # the plan is the same on every rank
    sizes = [m * n for m, n in matrices]
    assert traffic["total"] == 4 * least(sizes), f"{traffic['total']} bytes sent, least {4 * least(sizes)}"
    # the work is spread: no rank owns more than its quarter plus one matrix
    work = traffic["work"]
    assert sum(work) == sum(newton_schulz_flops(m, n) for m, n in matrices)
    assert max(work) <= sum(work) / 4 + max(newton_schulz_flops(m, n) for m, n in matrices)


def test_a_rank_with_a_different_parameter_list_is_refused():
    with pytest.raises(RuntimeError, match="different parameter lists"):
        run_distributed(_mismatched, 2)


def _mismatched(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2,))
    params = [distribute_tensor(torch.zeros(4, 4), mesh, (Shard(0),), src_data_rank=None) for _ in range(1 + rank)]
    WholeMatrices(params, mesh.get_group())


def test_one_process_needs_no_group():
    x = [torch.randn(5, 7), torch.randn(3, 4, 6)]
    out = WholeMatrices(x).apply(x, matrix_fn)
    torch.testing.assert_close(out[0], matrix_fn(x[0][None])[0])
    torch.testing.assert_close(out[1], matrix_fn(x[1]))
    with pytest.raises(ValueError, match="not a matrix"):
        WholeMatrices([torch.zeros(3)])
