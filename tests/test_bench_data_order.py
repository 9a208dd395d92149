"""benchmarks/bench_data_order.py at a tiny size, so that it cannot rot: the sparse corpus is
one moetrain reads, the report has its fields, the old permutation fails fast under an address
space cap, and the Megatron dataset it writes is a valid Megatron index. Its numbers at 1T and 20T
tokens are in docs/performance.md; nothing here asserts them."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_data_order as bdo  # noqa: E402


@pytest.mark.slow
def test_tiny_run_reports_every_field(tmp_path):
    """1 and 2 billion tokens in 2^27-token shards (8 and 15 sparse files) and in one big
    shard, measured in this process (the benchmark runs each in a fresh one)."""
    args = bdo.parser().parse_args(["--corpus", "1e9,2e9", "--layouts", "2^27,multi-TB", "--baseline-samples", "1e5",
                                    "--baseline-cap-gib", "0", "--old-map-all", "2^27", "--megatron-tokens", "",
                                    "--dp-size", "8", "--global-batch", "64", "--tmp", str(tmp_path)])
    report = bdo.run(args, in_process=True)
    assert [(r["layout"], r["tokens"]) for r in report["data_path"]] == [
        ("2^27", 10**9), ("2^27", 2 * 10**9), ("multi-TB", 10**9), ("multi-TB", 2 * 10**9)]
    row = report["data_path"][1]
    assert row["corpus"]["shards"] == 15 and row["corpus"]["disk_mib"] < 1  # sparse: nothing written
    m = row["moetrain"]
    assert m["samples_per_epoch"] == 14 * ((2**27 - 1) // 4096) + (2 * 10**9 - 14 * 2**27 - 1) // 4096
    assert m["micro_batches"] == 4 and m["micro_batch_shape"] == [2, 4096]
    assert set(m["seconds"]) >= {"open_and_verify", "loader", "first_batch", "to_first_batch",
                                 "resume_next_batch_median"}
    assert set(m["rss_over_imports_mib"]) == {"opened", "loader", "first_batch", "resumed"}
    assert 1 <= m["open_maps_after_first_batch"] <= m["max_open_maps"]
    assert "_keys" in m["order"]["feistel_attributes"] and m["opening_breakdown"]["files_checked"] == 30
    assert row["before_map_all_at_open"]["mapped"] == 15 and row["before_map_all_at_open"]["error"] is None
    perm = report["before_permutation"]
    assert perm["measured"][0]["samples"] == 10**5 and set(perm["extrapolated"]) == {"1B", "2B"}
    assert any(k.startswith("order_state_constant_") for k in report["goals"])
    assert "megatron_core" not in report and not list(tmp_path.iterdir())  # the corpus is deleted


def test_old_permutation_fails_fast_under_the_cap():
    out = bdo._child("old_permutation", num_samples=4 * 10**8, cap_gib=1.5)  # 3 GB of int64
    assert out["error"].startswith("MemoryError") and out["seconds_to_fail"] < 1


def test_megatron_dataset_is_a_valid_index(tmp_path):
    from moetrain.data.megatron import read_index

    info = bdo.write_megatron_dataset(tmp_path / "data", 100_000, mean_document=1000.0)
    index = read_index(tmp_path / "data.idx", bin_bytes=(tmp_path / "data.bin").stat().st_size)
    assert index.num_tokens == 100_000 and index.num_documents == info["documents"] and index.dtype == np.int32
    assert 500 < info["mean_document"] < 2000
    sparse = bdo.write_megatron_dataset(tmp_path / "sparse", 100_000, write_tokens=False)
    assert sparse["bin"] == "sparse" and (tmp_path / "sparse.bin").stat().st_blocks == 0


def test_megatron_part_is_optional_and_extrapolates_linearly(monkeypatch, tmp_path):
    args = bdo.parser().parse_args(["--megatron-tokens", "1e6", "--corpus", "1T,20T"])
    monkeypatch.setattr(bdo, "megatron_available", lambda: "No module named 'megatron'")
    assert "No module named 'megatron'" in bdo.megatron_rows(args, tmp_path)["skipped"]
    row = {"tokens": 10**9, "dataset": {"idx_mib": 19.0, "documents": 10**6},
           "build": {"index_file_mib": {"document_index": 4.0, "sample_index": 2.0, "shuffle_index": 1.0},
                     "seconds": 0.1, "peak_over_imports_mib": 30.0}}
    out = bdo._extrapolate_megatron([row], [10**12, 20 * 10**12], 4096)
    assert out["1T"]["index_gib"] == round(7 * 1000 / 1024, 1) and out["1T"]["one_dataset_possible"]
    assert not out["20T"]["one_dataset_possible"] and out["20T"]["datasets_needed"] == 10
    assert out["20T"]["blended_dataset_index_gib"] == round(10 * (20 * 10**12 // 4096) / 2**30, 1)
