"""benchmarks/kernel_sweep.py (``gpu_check.py --gemm-sweep``): the short-K fit recovers a known
k0, and the sweep runs end to end on the CPU (its numbers mean nothing there; on a GPU they set
the H100 profile's hbm_efficiency, gemm_efficiency and the short-K constant)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from kernel_sweep import MLM_ROWS, fit_k0, kernel_sweep  # noqa: E402


def test_fit_k0_recovers_the_fixed_cost_of_a_tile():
    ks = [512.0, 1024.0, 2048.0, 4096.0, 8192.0]
    a, k0 = 3e-9, 1300.0
    k0_fit, a_fit = fit_k0(ks, [a * (k + k0) for k in ks])
    assert k0_fit == pytest.approx(k0, rel=1e-9) and a_fit == pytest.approx(a, rel=1e-9)
    with pytest.raises(ValueError, match="two or more"):
        fit_k0([4096.0], [1.0])
    with pytest.raises(ValueError, match="do not grow with K"):
        fit_k0(ks, [1.0] * len(ks))


def test_sweep_runs_on_the_cpu():
    out = kernel_sweep(cuda=False, seconds=0.0)
    assert out["hbm"]["bytes_per_s"] > 0 and len(out["k_sweep"]) == 6
    assert set(out["implied"]) == {"hbm_efficiency", "gemm_k0", "gemm_efficiency"}
    assert len(out["mlm_layer_gemms"]) == 4 * len(MLM_ROWS)
    assert set(out["measured_over_planner_by_model"]) == {m for m, _, _ in MLM_ROWS}
    assert all(r["measured_over_planner"] > 0 for r in out["mlm_layer_gemms"])
