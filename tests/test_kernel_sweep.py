"""benchmarks/kernel_sweep.py (``gpu_check.py --gemm-sweep``): the short-K fit recovers a known
k0, the implied profile values come back from synthetic timings, and the sweep runs end to end
on the CPU (its numbers mean nothing there; on a GPU they set the H100 profile's
hbm_efficiency, gemm_efficiency and the short-K constant)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kernel_sweep as ks  # noqa: E402


def test_fit_k0_recovers_the_fixed_cost_of_a_tile():
    kk = [512.0, 1024.0, 2048.0, 4096.0]
    a, k0 = 3e-9, 1300.0
    k0_fit, a_fit, resid = ks.fit_k0(kk, [a * (k + k0) for k in kk])
    assert k0_fit == pytest.approx(k0, rel=1e-9) and a_fit == pytest.approx(a, rel=1e-9) and resid < 1e-12
    with pytest.raises(ValueError, match="two or more"):
        ks.fit_k0([4096.0], [1.0])
    with pytest.raises(ValueError, match="do not grow with K"):
        ks.fit_k0(kk, [1.0] * len(kk))


def test_implied_profile_values_from_synthetic_timings(monkeypatch):
    """A GPU whose copy reaches 0.9 of its datasheet and whose GEMMs take
    2·m·n·(K + 1500) / (0.72 × peak) seconds gives back hbm_efficiency 0.9, k0 1500 (the points
    above K_REF are left out of the fit) and gemm_efficiency 0.72 × 4096/5596 / wave."""
    from moetrain.planner.timing import K_REF, TimingAssumptions, _wave

    peak, k0 = 989e12, 1500
    monkeypatch.setattr(ks, "time_copy", lambda nbytes, dev, s: 2 * nbytes / (0.9 * 4800e9))
    monkeypatch.setattr(ks, "time_gemm", lambda m, n, k, dev, s: 2 * m * n * (min(k, K_REF) + k0) / (0.72 * peak))
    monkeypatch.setattr(ks, "mlm_rows", lambda: [("1.7b", 2048, 1, 16384)])
    out = ks.kernel_sweep(cuda=False, seconds=0.0, device_name="NVIDIA H200", peak_tflops=989, shrink=1)
    assert out["device_hbm_datasheet_gb_s"] == 4800.0
    imp = out["implied"]
    assert imp["hbm_efficiency"] == 0.9 and imp["gemm_k0"] == k0
    wave = _wave(16384, 8192, 132, TimingAssumptions().tile)
    assert imp["gemm_efficiency"] == round(0.72 * K_REF / (K_REF + k0) / wave, 3)
    assert len(out["mlm_layer_gemms"]) == 4 and out["measured_over_planner_by_model"]["1.7b"] > 0


@pytest.mark.slow
def test_sweep_runs_on_the_cpu():
    out = ks.kernel_sweep(cuda=False, seconds=0.0)
    rows = ks.mlm_rows()
    assert [r[0] for r in rows] == ["1.7b", "7.1b", "16b", "32b", "70b", "119b", "177b", "314b", "462b"]
    assert {r[3] for r in rows} <= {4096, 8192, 16384}  # the planner's micro-batch × 4096
    assert out["hbm"]["bytes_per_s"] > 0 and len(out["k_sweep"]) == 6
    assert set(out["implied"]) == {"hbm_efficiency", "gemm_k0", "gemm_efficiency"}
    assert len(out["mlm_layer_gemms"]) == 4 * len(rows)
    assert set(out["measured_over_planner_by_model"]) == {r[0] for r in rows}
    assert all(r["measured_over_planner"] > 0 for r in out["mlm_layer_gemms"])
