"""``train.anomaly``: a non-finite or spiking loss stops the run, skips the step's update or rolls
back to the latest checkpoint, decided on the device before the optimizer step
(moetrain/train/anomaly.py).

The anomalies are injected from outside the project: the test's own forward hook on the output
head (installed through ``Trainer.before_step``) multiplies the logits by NaN, or by a large
factor for a spike, in one step. Each run is compared with a clean run of the same config: the
losses before the step are equal bit for bit, and the parameters and optimizer state after a
skipped step are those before it, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from moetrain.config import AnomalyConfig
from moetrain.train.anomaly import FLAGS, AnomalyGuard, gated_step
from moetrain.train.records import read_events
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed


# -- the device-side check ----------------------------------------------------------------------


def flags(guard: AnomalyGuard, loss: float, grad_norm: float = 1.0) -> dict:
    out = guard.check(torch.tensor(loss, dtype=torch.float64), torch.tensor(grad_norm))
    return dict(zip(FLAGS, out.tolist()))


def test_a_spike_is_flagged_against_the_window_of_accepted_losses():
    guard = AnomalyGuard(AnomalyConfig(on_spike="skip", spike_z=4.0, window=4), torch.device("cpu"))
    for loss in (5.0, 5.1, 4.9, 5.0):  # the window fills: no spike is checked before
        assert flags(guard, loss) == {"nonfinite": 0, "spike": 0, "skip": 0, "z": 0.0}
    # mean 5.0, std 0.0707: 5.2 is 2.8 deviations above, 5.5 is 7.1 (a spike, skipped)
    assert flags(guard, 5.2)["spike"] == 0
    f = flags(guard, 5.5)
    assert f["spike"] == f["skip"] == 1 and f["z"] > 4
    # the skipped loss did not enter the window: 5.5 again is still a spike
    assert flags(guard, 5.5)["spike"] == 1
    # a falling loss is never a spike
    assert flags(guard, 1.0)["spike"] == 0


def test_the_window_round_trips_in_order_and_shrinks_to_its_latest_losses():
    guard = AnomalyGuard(AnomalyConfig(on_spike="skip", spike_z=4.0, window=3), torch.device("cpu"))
    assert guard.state_dict() == {"losses": []}
    for loss in (5.0, 5.1, 4.9, 5.2, 5.0):  # the ring wraps: the latest three, oldest first
        flags(guard, loss)
    assert guard.state_dict() == {"losses": [4.9, 5.2, 5.0]}
    again = AnomalyGuard(AnomalyConfig(on_spike="skip", spike_z=4.0, window=3), torch.device("cpu"))
    again.load_state_dict(guard.state_dict())
    for loss in (5.1, 9.0, 4.95):  # the same decisions as the guard it came from (z: the sums in another order)
        a, b = flags(again, loss), flags(guard, loss)
        assert a["z"] == pytest.approx(b["z"], rel=1e-12) and {**a, "z": 0} == {**b, "z": 0}
    short = AnomalyGuard(AnomalyConfig(on_spike="skip", window=2), torch.device("cpu"))
    short.load_state_dict({"losses": [4.9, 5.2, 5.0]})
    assert short.state_dict() == {"losses": [5.2, 5.0]}
    with pytest.raises(ValueError, match="non-finite"):
        short.load_state_dict({"losses": [5.0, math.nan]})


def test_non_finite_values_skip_whatever_the_spike_policy_and_never_enter_the_window():
    for on_spike in ("off", "warn"):
        guard = AnomalyGuard(AnomalyConfig(on_spike=on_spike, window=2), torch.device("cpu"))
        assert flags(guard, 5.0)["skip"] == 0 and flags(guard, 5.0)["skip"] == 0
        assert flags(guard, math.nan) == {"nonfinite": 1, "spike": 0, "skip": 1, "z": 0.0}
        assert flags(guard, 5.0, grad_norm=math.inf)["skip"] == 1
        spike = flags(guard, 50.0)  # warned (or not looked at), never skipped
        assert spike["skip"] == 0 and spike["spike"] == (on_spike == "warn")


def test_gated_step_leaves_parameters_moments_and_step_count_when_skipped():
    p = torch.nn.Parameter(torch.ones(3, 3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.ones(3, 3)
    gated_step([opt], torch.tensor(0.0))  # applied
    after_one = (p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["step"].clone())
    p.grad = torch.full((3, 3), math.nan)
    gated_step([opt], torch.tensor(1.0))  # skipped
    assert torch.equal(p.detach(), after_one[0]) and torch.equal(opt.state[p]["exp_avg"], after_one[1])
    assert torch.equal(opt.state[p]["step"], after_one[2]) and not hasattr(opt, "found_inf")
    p.grad = torch.ones(3, 3)
    gated_step([opt], torch.tensor(0.0))  # applied again
    assert not torch.equal(p.detach(), after_one[0])
    with pytest.raises(TypeError, match="takes no device-side skip flag"):
        gated_step([torch.optim.SGD([p], lr=0.1)], torch.tensor(0.0))


# -- in a run -----------------------------------------------------------------------------------


def anomaly_run(rank: int, world: int, data: str, run_dir: str, parallel: dict, anomaly: dict,
                inject: dict[int, float], steps: int = 8, checkpoint_every: int = 0, only_rank: int | None = None,
                resume: bool = False, metrics: dict | None = None) -> dict:
    """Train ``steps`` steps; the first time step s of ``inject`` runs, the output head's logits
    is multiplied by ``inject[s]`` (NaN, or a large factor) on every rank, or on ``only_rank``. Returns the losses
    of every step run, the snapshots of parameters and AdamW step counts taken before each step
    (as (step, snapshot) in order), the outcome and the events."""
    cfg = tiny_config(data, run_dir, parallel=parallel,
                      train={"steps": steps, "grad_clip": 1.0, "anomaly": anomaly},
                      checkpoint={"every": checkpoint_every, "keep": 4, "resume": resume}, metrics=metrics or {})
    trainer = Trainer(cfg)
    head = trainer.model_parts[-1].output
    hooks: list = []
    snapshots: list = []
    losses: list = []

    def before(step: int) -> None:
        for h in hooks:
            h.remove()
        hooks.clear()
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for n, p in trainer.model_parts[0].named_parameters()}
        counts = [s["step"].clone() for opt in trainer.optimizers for s in opt.state.values()]
        bias = [m.expert_bias.clone() for m in trainer.moe_layers.values() if m.expert_bias is not None]
        snapshots.append((step, params, counts, bias))
        if step in inject:  # once: a step that runs again after a rollback runs on other data
            factor = inject.pop(step)
            if only_rank is None or rank == only_rank:
                hooks.append(head.register_forward_hook(lambda m, i, out: out * factor))

    trainer.before_step = before
    step_fn = trainer.train_step

    def recorded():
        res = step_fn()
        losses.append((res.step, res.loss))
        return res

    trainer.train_step = recorded
    try:
        outcome = trainer.run()
    except FloatingPointError as e:
        outcome = f"FloatingPointError: {e}"
    return {"losses": losses, "snapshots": snapshots, "outcome": outcome,
            "events": [e for e in read_events(cfg.run_dir) if e["event"] in ("anomaly", "rolled_back")]}


def same_state(a: tuple, b: tuple) -> bool:
    _, pa, ca, ba = a
    _, pb, cb, bb = b
    return (pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)
            and len(ca) == len(cb) and all(torch.equal(x, y) for x, y in zip(ca, cb))
            and all(torch.equal(x, y) for x, y in zip(ba, bb)))


@pytest.fixture
def clean(tiny_shards, tmp_path):
    return run_distributed(anomaly_run, 1, str(tiny_shards), str(tmp_path / "clean"), {}, {}, {})[0]


def test_a_nan_stops_the_run_by_default_naming_the_step_and_the_setting(clean, tiny_shards, tmp_path):
    out = run_distributed(anomaly_run, 1, str(tiny_shards), str(tmp_path / "stop"), {}, {}, {4: math.nan})[0]
    assert out["outcome"].startswith("FloatingPointError: step 4: loss nan")
    assert "train.anomaly.on_nan: skip or rollback" in out["outcome"]
    assert out["losses"][:3] == clean["losses"][:3]
    assert clean["outcome"] == "done" and clean["events"] == []  # a clean run flags nothing


def test_skip_leaves_the_step_s_update_out_and_goes_on(clean, tiny_shards, tmp_path):
    out = run_distributed(anomaly_run, 1, str(tiny_shards), str(tmp_path / "skip"), {}, {"on_nan": "skip"},
                          {4: math.nan})[0]
    assert out["outcome"] == "done"
    assert out["losses"][:3] == clean["losses"][:3] and math.isnan(out["losses"][3][1])
    snaps = dict((s[0], s) for s in out["snapshots"])
    assert same_state(snaps[4], snaps[5])  # step 4 changed nothing: weights, AdamW steps, expert bias
    assert not same_state(snaps[3], snaps[4])  # control: a normal step does change them
    assert all(math.isfinite(loss) for _, loss in out["losses"][4:])
    assert [(e["step"], e["anomaly"], e["action"]) for e in out["events"]] == [(4, "nan", "skip")]


def test_rollback_reloads_the_latest_checkpoint_and_skips_its_data(clean, tiny_shards, tmp_path):
    out = run_distributed(anomaly_run, 1, str(tiny_shards), str(tmp_path / "rollback"), {}, {"on_nan": "rollback"},
                          {6: math.nan}, 8, 4)[0]
    assert out["outcome"] == "done"
    assert out["losses"][:5] == clean["losses"][:5]
    # steps run: 1-6, then 5-8 again from the step-4 checkpoint
    assert [s for s, _ in out["losses"]] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    before = [s for s in out["snapshots"] if s[0] == 5]
    assert len(before) == 2 and same_state(before[0], before[1])  # back to step 4's state
    # ... with other data: the batches of steps 5-6 are skipped, so step 5 runs clean's step 7's
    # batch on step 4's weights (its loss differs from clean's step 5)
    assert out["losses"][6][1] != clean["losses"][4][1]
    assert [(e["event"], e["step"], e.get("to_step")) for e in out["events"]] == [("anomaly", 6, None),
                                                                                 ("rolled_back", 6, 4)]


def test_a_rollback_is_marked_in_tensorboard_and_the_monitor_and_no_step_is_shown_twice(tiny_shards, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moetrain import monitor

    run_dir = tmp_path / "rollback"
    out = run_distributed(anomaly_run, 1, str(tiny_shards), str(run_dir), {}, {"on_nan": "rollback"},
                          {6: math.nan}, 8, 4, None, False, {"tensorboard": True})[0]
    assert [s for s, _ in out["losses"]] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    # steps 5-6 ran twice: TensorBoard keeps the re-run's (the losses of the run that went on)
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [step for step, _ in loss] == list(range(1, 9)), loss
    final = dict(out["losses"][:4] + out["losses"][6:])
    assert all(value == pytest.approx(final[step], rel=1e-6) for step, value in loss)
    assert [(e.step, e.value) for e in acc.Scalars("train/rollback")] == [(4, 6.0)]  # at step 4, from 6
    text = monitor.render(monitor.collect(run_dir))
    assert "rollbacks" in text and "rolled_back: " in text and "step=6, to_step=4" in text, text


def test_a_spike_is_skipped_and_a_clean_run_has_none(tiny_shards, tmp_path):
    anomaly = {"on_spike": "skip", "spike_z": 6.0, "window": 4}
    out = run_distributed(anomaly_run, 1, str(tiny_shards), str(tmp_path / "spike"), {}, anomaly, {7: 1000.0}, 9)[0]
    clean = run_distributed(anomaly_run, 1, str(tiny_shards), str(tmp_path / "spike-clean"), {}, anomaly, {}, 9)[0]
    assert clean["events"] == [] and out["losses"][:6] == clean["losses"][:6]
    assert [(e["step"], e["anomaly"], e["action"]) for e in out["events"]] == [(7, "spike", "skip")], out["losses"][5:]
    snaps = dict((s[0], s) for s in out["snapshots"])
    assert same_state(snaps[7], snaps[8])


def test_a_spike_on_the_first_step_after_a_restart_is_caught(tiny_shards, tmp_path):
    # The window (4 accepted losses) is in the step-6 checkpoint: the resumed run checks step 7
    # against steps 3-6, where a window that started empty could not check it before step 11.
    anomaly = {"on_spike": "skip", "spike_z": 6.0, "window": 4}
    run_dir = str(tmp_path / "run")
    first = run_distributed(anomaly_run, 1, str(tiny_shards), run_dir, {}, anomaly, {}, 6, 6)[0]
    assert first["outcome"] == "done" and first["events"] == []
    resumed = run_distributed(anomaly_run, 1, str(tiny_shards), run_dir, {}, anomaly, {7: 1000.0}, 8, 6, None, True)[0]
    assert [s for s, _ in resumed["losses"]] == [7, 8]
    assert [(e["step"], e["anomaly"], e["action"]) for e in resumed["events"]] == [(7, "spike", "skip")]


def test_max_skips_stops_the_run_naming_the_steps(tiny_shards, tmp_path):
    out = run_distributed(anomaly_run, 1, str(tiny_shards), str(tmp_path / "max"), {},
                          {"on_nan": "skip", "max_skips": 1}, {3: math.nan, 5: math.nan})[0]
    assert out["outcome"].startswith("FloatingPointError: step 5:") and "(3, 5)" in out["outcome"]
    assert "train.anomaly.max_skips = 1" in out["outcome"]


def test_every_rank_skips_when_one_rank_s_forward_goes_non_finite(tiny_shards, tmp_path):
    """dp2 × ep2: the NaN is injected on rank 1 only; the loss and gradient norm are global, so
    both ranks skip the same step and keep equal weights."""
    outs = run_distributed(anomaly_run, 2, str(tiny_shards), str(tmp_path / "dp2ep2"), {"dp": 2, "ep": 2},
                           {"on_nan": "skip"}, {4: math.nan}, 8, 0, 1)
    for out in outs:
        snaps = dict((s[0], s) for s in out["snapshots"])
        assert out["outcome"] == "done" and same_state(snaps[4], snaps[5])
    assert same_state(dict((s[0], s) for s in outs[0]["snapshots"])[8], dict((s[0], s) for s in outs[1]["snapshots"])[8])
    assert [(e["step"], e["action"]) for e in outs[0]["events"]] == [(4, "skip")]
