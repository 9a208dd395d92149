"""The training loop of one rank.

``Trainer(cfg)`` initialises torch.distributed, builds the mesh, the model (meta device →
parallelize → materialise → initialise), the optimizer, the data loader and the checkpointer,
and resumes from the latest complete checkpoint. ``Trainer.run()`` trains to ``train.steps``
or until a stop is requested (the pre-timeout / preemption signal sets a flag; the loop
finishes the step, checkpoints and returns).

Loss bookkeeping: the objective of a step is the mean over all micro-batches of the global batch
of ``lm + aux_coef·aux + z_coef·z``. Each rank back-propagates ``lm / accum`` per micro-batch;
the MoE losses receive the same 1/accum through ``MoE.aux_loss_scale``; gradients are averaged
over data-parallel ranks after the last micro-batch. With ``data.loss_mask`` each micro-batch's
``lm`` is its summed token losses over a share of the global batch's trained tokens
(:meth:`Trainer._with_loss_divisor`), so that the same averaging gives the mean over every
trained token of the global batch.

Device residency: losses, MoE statistics and the gradient norm stay on the training device and
every collective runs on device tensors; the step's metrics are reduced as one vector and read to
the host once, at the end of the step (:meth:`Trainer.train_step`). The only other host reads in
a step are the expert-parallel split sizes (one per MoE layer per micro-batch,
:mod:`moetrain.parallel.expert`) and the stop-flag agreement, a CPU tensor (gloo on GPU
clusters). ``tests/test_host_syncs.py`` counts them.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from moetrain.config import Config, ConfigError
from moetrain.data.format import ShardError
from moetrain.data.loader import IGNORE_INDEX, BatchLoader, DataSource, MicroBatch, validation_batches
from moetrain.data.reader import MapCache, TokenShards
from moetrain.data.verify import verify_shards
from moetrain.model.fp8 import dispatch_wire, row_bytes as fp8_row_bytes
from moetrain.model.transformer import future_tokens
from moetrain.parallel.apply import build_model_parts
from moetrain.parallel.context import cp_shard
from moetrain.parallel.data_parallel import clip_gradients, global_grad_norm
from moetrain.parallel.eplb import ExpertPlacer
from moetrain.parallel.precision import compute_dtype
from moetrain.parallel.peers import waiting_on_peers
from moetrain.parallel.state import CP, DP, DP_CP, DP_CP_TP, EP, PP, TP, ParallelState, init_distributed
from moetrain.ranges import OPTIMIZER, STEP, observe, phase
from moetrain.train.anomaly import FLAGS, AnomalyGuard, gated_step
from moetrain.train.checkpoint import Checkpointer
from moetrain.train.environment import record_environment
from moetrain.train.flops import flops_per_token
from moetrain.train.memory import PhaseMemory, dump_memory_snapshot, predicted_memory_gib, start_memory_history
from moetrain.train.metrics import EtaClock, MetricSinks, format_duration
from moetrain.train.optim import build_optimizer, lr_at, schedule_fields, set_lr
from moetrain.train.qk_clip import QKClip
from moetrain.train.profile import StepProfiler
from moetrain.train.records import Fence, Heartbeat, append_event, exclude_nodes, node_name
from moetrain.train.stragglers import Straggler, StragglerDetector
from moetrain.train.weights import base_identity, load_initial_weights
from moetrain.utils import atomic_write

log = logging.getLogger("moetrain")


@dataclass
class StepResult:
    step: int
    loss: float
    aux_loss: float
    z_loss: float
    grad_norm: float
    lr: float
    extra: dict[str, Any] = field(default_factory=dict)


class StopFlag:
    """Set from a signal handler; read by the loop at step boundaries (never acts by itself)."""

    def __init__(self) -> None:
        self.requested = False
        self.reason = ""

    def set(self, reason: str) -> None:
        # The first signal is the cause: requeueing the job sends SIGTERM to every task, this
        # one included, after the USR2 (time limit, preemption) that started the stop.
        if not self.requested:
            self.reason = reason
        self.requested = True


class Trainer:
    def __init__(self, cfg: Config, *, job_id: str = "local", restart: int = 0, stop_flag: StopFlag | None = None,
                 mesh_ranks: Any = None, rank_domains: list[int] | None = None, write_files: bool = True,
                 hosts_from_ranks: bool = False):
        """``write_files=False`` (tests) writes no metrics, heartbeats or events; checkpoints are
        still written when asked for. ``hosts_from_ranks``: the rank map's nodes are the hosts the
        ranks report (a launcher such as torchrun that SLURM's node list does not describe)."""
        self.cfg = cfg
        self.stop_flag = stop_flag or StopFlag()
        self.write_files = write_files
        self.device = init_distributed(cfg.parallel.backend, cfg.parallel.collective_timeout_s)
        if mesh_ranks is None:
            mesh_ranks, rank_domains = topology_mesh_ranks(cfg, hosts_from_ranks)
        self.ps = ParallelState.build(cfg.parallel, self.device, mesh_ranks, rank_domains)
        if self.ps.hsdp and self.ps.is_logging_rank:
            par = cfg.parallel
            log.info("HSDP: dense parameters sharded over groups of %d of the %d dp × cp ranks, replicated across %d "
                     "groups; experts sharded over %d of their %d edp replicas (those inside one group: dp_shard / ep)",
                     par.dp_shard, par.dp * par.cp, par.dp * par.cp // par.dp_shard, par.expert_dp_shard, par.edp)
        torch.manual_seed(cfg.run.seed)

        # A new attempt takes the run directory's fence first: writes of older attempts stop.
        self.fence: Fence | None = None
        self.heartbeat: Heartbeat | None = None
        self.watchdog: Any = None  # set by the job (moetrain.launch.lifecycle.Watchdog)
        # Called with the number of the step about to run: the one hook for fault injection and
        # instrumentation, installed from outside (moetrain.launch.job's MOETRAIN_FAULT_HOOK).
        self.before_step: Callable[[int], None] | None = None
        # Called with the number of each step once it is done and logged (the launch layer's
        # recovery clock).
        self.after_step: Callable[[int], None] | None = None
        if write_files:
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
            seq = [Fence.advance(cfg.run_dir, job_id, restart) if self.ps.rank == 0 else None]
            dist.broadcast_object_list(seq, src=0)
            self.fence = Fence(cfg.run_dir, seq[0])
            self.heartbeat = Heartbeat(cfg.run_dir, self.ps.rank, self.fence)
            self.heartbeat.beat(0, "init")
        self.attempt = self.fence.seq if self.fence else 0
        if self.fence is not None:
            # Versions, GPUs, driver and each rank's NCCL / CUDA / launch variables: what a
            # regression between attempts is traced to (environment/ in the run directory).
            record_environment(cfg.run_dir, self.attempt, self.ps.rank,
                               extra_names=cfg.launch.env, fence=self.fence)

        # model_parts: this rank's pieces of the model (one, or one per virtual pipeline stage);
        # runner: runs forward + backward of a step's micro-batches over them.
        self.model_parts, self.runner = build_model_parts(cfg, self.ps)
        # Muon spreads its matrices over this pipeline stage's ranks
        stage = self.ps.group(DP_CP_TP) if self.ps.world_size > 1 else None
        self.optimizers = [build_optimizer(part, cfg.train, stage) for part in self.model_parts]
        # train.qk_clip (MuonClip): the attention modules record their largest logits
        self.qk_clip = QKClip(self.model_parts, cfg.train.qk_clip, self.ps) if cfg.train.qk_clip else None
        # train.anomaly: the device-side check, and the steps skipped or rolled back so far
        self.anomaly = AnomalyGuard(cfg.train.anomaly, self.device)
        self.anomalous_steps: list[int] = []
        self.profiler = StepProfiler(cfg.train.profile, self.ps.rank, cfg.run_dir, self.device.type == "cuda")
        self.phase_memory = PhaseMemory(self.device)
        self.stragglers: StragglerDetector | None = None
        if cfg.train.straggler_every:
            nodes: list = [None] * self.ps.world_size
            dist.all_gather_object(nodes, node_name())
            self.stragglers = StragglerDetector(cfg.train.straggler_every, cfg.train.straggler_threshold,
                                                cfg.train.straggler_windows, self.device, nodes)
        if cfg.train.memory_history and self.device.type == "cuda":
            start_memory_history()
        self.moe_layers = {k: v for part in self.model_parts for k, v in part.moe_layers().items()}
        # moe.eplb: the experts' slots placed by measured load (moetrain.parallel.eplb)
        self.eplb = ExpertPlacer(self.model_parts, self.ps, cfg) if cfg.moe.eplb.enabled else None
        # DeepSeek Sparse Attention's indexers held here (model.dsa), by block index.
        self.indexers = {k: b.attention.indexer for part in self.model_parts for k, b in part.blocks().items()
                         if getattr(b.attention, "indexer", None) is not None}

        manifests = self._verify_data()
        # The padding of packed fine-tuning data is kept out of the MoE layers (moe.route_padding);
        # only under a loss mask, which leaves every target after it untrained.
        self._mask_padding = (cfg.data.loss_mask and not cfg.moe.route_padding and bool(self.moe_layers))
        sources = cfg.data.sources()
        # One cache of memory-mapped files for every source and split of this rank.
        maps = MapCache(cfg.data.max_open_maps)
        # The one source of data.path is shuffled with the key "": moving its directory keeps the order.
        self.loader = BatchLoader([DataSource(src.resolved_name, TokenShards(src.path, "train", maps=maps, manifest=m),
                                              src.weight, None if cfg.data.blend else "")
                                   for src, m in zip(sources, manifests)],
                                  cfg.model.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                                  self.ps.coord(DP), self.ps.size(DP), cfg.run.seed,
                                  document_mask=cfg.data.document_mask, loss_mask=cfg.data.loss_mask,
                                  padding=self._mask_padding)
        if self.ps.is_logging_rank and len(sources) > 1:
            sched = self.loader.order.schedule
            log.info("data blend of %d sources, period %d samples: %s", len(sources), sched.period,
                     ", ".join(f"{n} {w:.4g}" for n, w in self.loader.weights.items()))
            if sched.max_relative_deviation > 0.01:
                log.warning("data blend: the weights are rounded to multiples of 1/%d, a small one by up to %.1f %% of "
                            "itself; give the weights as fractions of a denominator up to 4096 (e.g. 0.25, 1/3) to "
                            "follow them exactly", sched.period, 100 * sched.max_relative_deviation)
        # Validation: a fixed set of each source's val split; the blended val_loss weighs them
        # by the blend's weights.
        self.val_batches: dict[str, list[MicroBatch]] = {}
        if cfg.train.val_every:
            for src, m in zip(sources, manifests):
                batches = self._to_device(validation_batches(
                    TokenShards(src.path, "val", maps=maps, manifest=m), cfg.model.seq_len, cfg.train.micro_batch_size,
                    cfg.data.val_batches, self.ps.coord(DP), self.ps.size(DP), document_mask=cfg.data.document_mask,
                    loss_mask=cfg.data.loss_mask, padding=self._mask_padding))
                if batches:
                    self.val_batches[src.resolved_name] = self._with_loss_divisor(batches)
                elif self.ps.is_logging_rank:
                    log.warning("data source %r has no validation sample of %d tokens: val_loss leaves it out",
                                src.resolved_name, cfg.model.seq_len + 1)
        lora = cfg.train.lora.r > 0
        self.checkpointer = Checkpointer(cfg.checkpoint_dir, self.ps, cfg.checkpoint.keep, self.attempt, self.fence,
                                         async_save=cfg.checkpoint.async_, timeout_s=cfg.checkpoint.timeout_s,
                                         trained_only=lora, eplb=self.eplb)
        # LoRA: the frozen base the adapters apply to; its checkpoints hold the adapters only.
        self.lora_base = base_identity(cfg) if lora else None
        self.step = 0
        self._trained_tokens: torch.Tensor | None = None
        self.flops_per_token = flops_per_token(cfg)
        # Bytes of one dispatched row on the wire (moe.dispatch_dtype; fp8 counts its scales).
        wire = dispatch_wire(cfg.moe.dispatch_dtype, cfg.train.precision)
        self.dispatch_row_bytes = fp8_row_bytes(cfg.model.hidden, wire or compute_dtype(cfg.train.precision))
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
        self.metrics_path = cfg.run_dir / "metrics.jsonl"
        if lora and cfg.checkpoint.init_from is not None:  # the base first: a LoRA checkpoint has none
            self._init_from(cfg.checkpoint.init_from)
        resumed = self._resume() if cfg.checkpoint.resume else False
        self._first_step = self.step  # this attempt's first step is _first_step + 1
        # Resume wins: once the run has a checkpoint it has moved on from its initial weights.
        if cfg.checkpoint.init_from is not None and not resumed and not lora:
            self._init_from(cfg.checkpoint.init_from)
        # Rank 0 writes the step records to metrics.jsonl and the configured sinks; refused here,
        # before any step, when a sink's package is missing.
        self.sinks = MetricSinks(cfg, self.metrics_path, self.device, start_step=self.step) \
            if write_files and self.ps.is_logging_rank else None
        self.eta = EtaClock(cfg.train.steps)

    def _verify_data(self) -> list[dict]:
        """Check every source's shards against their manifest before training (``data.verify``):
        each rank checks its own ~1/ranks of the bytes, skipping contents already verified (the
        cache beside the data, or in the run directory when the data directory is read-only); one
        collective agrees, so every rank raises the same :class:`~moetrain.data.format.ShardError`,
        naming the source and the shard. Returns the sources' manifests, as verified."""
        cfg, t0 = self.cfg, time.time()

        def agree(result: dict) -> list[dict]:
            out: list[Any] = [None] * self.ps.world_size
            dist.all_gather_object(out, result)
            return out

        sources = cfg.data.sources()
        manifests = []
        for i, src in enumerate(sources):
            data_dir = Path(src.path)
            cache = data_dir / ".moetrain-verified.json" if os.access(data_dir, os.W_OK) \
                else cfg.run_dir / ("verified-shards.json" if cfg.data.path is not None
                                    else f"verified-shards-{src.resolved_name}.json")
            try:
                manifests.append(verify_shards(data_dir, cfg.data.verify, None if cfg.train.val_every else "train",
                                               rank=self.ps.rank, world=self.ps.world_size, agree=agree, cache=cache))
            except ShardError as e:
                where = f"data.blend[{i}] ({src.resolved_name!r})" if cfg.data.blend else "data.path"
                raise ShardError(f"{where}: {e}") from None
        if self.ps.is_logging_rank:
            log.info("data verified (%s, %d source%s, spread over %d ranks) in %.1f s", cfg.data.verify, len(sources),
                     "" if len(sources) == 1 else "s", self.ps.world_size, time.time() - t0)
        return manifests

    # -- resume / checkpoint ------------------------------------------------------------------

    def _init_from(self, path: str) -> None:
        """``checkpoint.init_from``: the weights only; optimizer, step and data position stay fresh."""
        loaded = load_initial_weights(path, self.model_parts, self.ps, self.eplb)
        if self.ps.is_logging_rank:
            log.info("initialised the weights from %s (fresh optimizer, step 0)", loaded)
            if self.write_files:
                append_event(self.cfg.run_dir, self.fence, "initialised", weights=str(loaded))

    def _check_dsa_stage(self, path: Path) -> None:
        """A checkpoint of DSA's dense warm-up holds optimizer states for the indexers alone: the
        sparse stage (or a model without DSA) starts from its weights, not by resuming it."""
        saved = json.loads((path / "manifest.json").read_text()).get("train_state", {}).get("dsa_stage")
        dsa = self.cfg.model.dsa
        now = dsa.stage if dsa.enabled else None
        if "dense_warmup" in (saved, now) and saved != now:
            raise ConfigError(f"checkpoint {path} was saved with model.dsa.stage = {saved!r} and this run has "
                              f"{now!r}: the warm-up trains the indexers alone, so its optimizer state does not fit "
                              f"the other stage. Fix: start the new stage in another run.dir with "
                              f"checkpoint.init_from={path} (its weights, a fresh optimizer)")

    def _resume(self) -> bool:
        """Load the latest complete checkpoint when there is one; True if it did."""
        found = self.checkpointer.latest_valid()
        if found is not None:
            _, path = found
            self._check_dsa_stage(path)
            state = self.checkpointer.load(path, self.model_parts, self.optimizers)
            if self.lora_base is not None and state.get("lora_base") != self.lora_base:
                raise ConfigError(f"checkpoint {path} holds low-rank adapters trained on the base "
                                  f"{state.get('lora_base')}, and this run's base is {self.lora_base}. Fix: set "
                                  f"checkpoint.init_from to the base the adapters were trained on, or start the new "
                                  f"base in another run.dir")
            self.step = int(state["step"])
            if "anomaly" in state:  # checkpoints of older versions start the window empty
                self.anomaly.load_state_dict(state["anomaly"])
            blend_change = self.loader.load_state_dict(state)
            self._check_schedule(state.get("lr_schedule"), path)
            if blend_change is not None and self.ps.is_logging_rank:
                log.warning("the data differs from what steps 1-%d were trained with: %s", self.step, blend_change)
                if self.write_files:
                    append_event(self.cfg.run_dir, self.fence, "data_changed", step=self.step, changed=blend_change)
        if self.ps.is_logging_rank:
            if found is not None:
                log.info("resumed from %s at step %d (%d samples consumed)", path, self.step,
                         self.loader.consumed_samples)
            if self.write_files:
                for bad, reason in self.checkpointer.skipped:
                    append_event(self.cfg.run_dir, self.fence, "checkpoint_skipped", checkpoint=str(bad), reason=reason)
                # Steps after the checkpoint (every step, when an earlier attempt ended before its
                # first checkpoint) will run again: drop their old records so that no step appears
                # twice in the metrics.
                truncate_metrics(self.metrics_path, self.step, self.fence)
                if found is not None:
                    append_event(self.cfg.run_dir, self.fence, "resumed", step=self.step, checkpoint=str(path))
        return found is not None

    def _check_schedule(self, trained: dict | None, path: Path) -> None:
        """Say when the learning-rate schedule of this run differs from the one the checkpoint's
        steps were trained with (e.g. ``train.steps`` raised without ``train.decay_steps``)."""
        now = schedule_fields(self.cfg.train)
        if trained is None or not self.ps.is_logging_rank:
            return
        changed = {k: (trained.get(k), v) for k, v in now.items() if trained.get(k) != v}
        if not changed:
            return
        what = ", ".join(f"{k} {a} → {b}" for k, (a, b) in changed.items())
        hint = f"; to keep it, set train.decay_steps={trained['decay_steps']}" if "decay_steps" in changed else ""
        log.warning("the learning-rate schedule differs from the one steps 1-%d were trained with (%s): steps from %d "
                    "follow the new one%s", self.step, what, self.step + 1, hint)
        if self.write_files:
            append_event(self.cfg.run_dir, self.fence, "schedule_changed", step=self.step, changed=what, hint=hint)

    def save_checkpoint(self, wait: bool = True) -> Path:
        """Checkpoint the current step; ``wait=False`` returns once the state is staged (with
        ``checkpoint.async``) and the write goes on in the background
        (:meth:`moetrain.train.checkpoint.Checkpointer.save`)."""
        p = self.cfg.parallel
        layout = {"pp": p.pp, "dp": p.dp, "cp": p.cp, "tp": p.tp, "ep": p.ep, "etp": p.etp, "zero_stage": p.zero_stage}
        train_state = {"step": self.step, **self.loader.state_dict(), "lr_schedule": schedule_fields(self.cfg.train),
                       "anomaly": self.anomaly.state_dict()}
        if self.lora_base is not None:
            train_state["lora_base"] = self.lora_base
        if self.cfg.model.dsa.enabled:
            train_state["dsa_stage"] = self.cfg.model.dsa.stage
        return self.checkpointer.save(self.step, self.model_parts, self.optimizers, train_state, layout,
                                      wait=wait or not self.cfg.checkpoint.async_)

    # -- one step -----------------------------------------------------------------------------

    def _to_device(self, micro_batches: list[MicroBatch], mtp: bool = False) -> list[MicroBatch]:
        """This rank's part of the micro-batches on the training device: under context
        parallelism its two sequence chunks (:func:`moetrain.parallel.context.cp_shard`) of the
        inputs and targets (document ids and the padding mask stay whole: ring attention needs the
        other chunks', the MoE layers the whole sequences' real lengths); on
        CUDA copied from pinned memory without waiting. ``mtp``: the targets become
        [B, S, 1 + 2·mtp_depth] (:func:`moetrain.model.transformer.future_tokens`: the targets of
        every depth, then the unmasked tokens the MTP modules embed), built on whole samples
        before the split."""
        cp_rank, cp = self.ps.coord(CP), self.ps.size(CP)
        cuda = self.device.type == "cuda"

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or not cuda:
                return t
            return t.pin_memory().to(self.device, non_blocking=True)

        out = []
        for mb in micro_batches:
            inputs, targets = mb.inputs, mb.targets
            if mtp:
                targets = future_tokens(targets, self.cfg.model.mtp_depth, mb.next_tokens)
            if cp > 1:
                inputs, targets = cp_shard(inputs, cp_rank, cp, 1), cp_shard(targets, cp_rank, cp, 1)
            out.append(MicroBatch(move(inputs), move(targets), move(mb.doc_ids), padding=move(mb.padding)))
        return out

    def _announce_epochs(self) -> None:
        """Say once, on the console and in the event log, when a source of the data has run
        through its samples and starts a new, reshuffled epoch."""
        for name, epoch in self.loader.new_epochs():
            if not self.ps.is_logging_rank:
                continue
            samples = self.loader.num_samples[name]
            log.info("data source %r ran through its %s samples in step %d: epoch %d begins, reshuffled", name,
                     f"{samples:,}", self.step + 1, epoch + 1)
            if self.write_files:
                append_event(self.cfg.run_dir, self.fence, "data_epoch", step=self.step + 1, source=name,
                             epoch=epoch + 1, samples=samples)

    def _with_loss_divisor(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """With ``data.loss_mask``: every micro-batch's loss divisor, so that the loss is the
        mean over the trained tokens of the whole batch in every layout: each micro-batch sums
        its token losses and divides by ``N / (n · dp·cp)``, with ``N`` the trained targets of
        all ranks' micro-batches (their local counts summed over dp × cp: each cp rank holds its
        own chunks of the sequence) and ``n`` the micro-batches per rank; averaging over
        micro-batches and dp × cp then gives ``sum / N`` (Megatron-Core's per-token loss, its
        ``calculate_per_token_loss``). With multi-token prediction one divisor per depth, [1 + D]
        (each depth's own trained targets). One all-reduce of a device tensor; no host read.
        Without the loss mask the micro-batches are returned as they are."""
        if not self.cfg.data.loss_mask or not micro_batches:
            return micro_batches
        depths = 1 + self.cfg.model.mtp_depth
        count = torch.zeros(depths, dtype=torch.float64, device=self.device)
        for mb in micro_batches:
            trained = mb.targets != IGNORE_INDEX
            count += trained[..., :depths].flatten(0, 1).sum(0) if mb.targets.dim() == 3 else trained.sum()
        if self.ps.size(DP_CP) > 1:
            dist.all_reduce(count, group=self.ps.group(DP_CP))
        divisor = count.clamp(min=1.0) / (len(micro_batches) * self.ps.size(DP_CP))
        if depths == 1:
            divisor = divisor[0]
        for mb in micro_batches:
            mb.loss_divisor = divisor
        self._trained_tokens = count[0]  # read with the step's metrics
        return micro_batches

    def train_step(self) -> StepResult:
        """One optimizer step over this rank's share of the next global batch. Reads the step's
        metrics to the host once, at the end. Profiled when ``train.profile`` names the step."""
        self.profiler.begin(self.step + 1)
        try:
            with observe(self.phase_memory.enter, self.phase_memory.leave), self._watch_stragglers(), phase(STEP):
                res = self._train_step()
        except torch.OutOfMemoryError:
            if self.device.type == "cuda":
                path = dump_memory_snapshot(self.cfg.run_dir, self.ps.rank, f"oom.step{self.step + 1}")
                log.error("rank %d: CUDA out of memory in step %d: the allocator's state is in %s (open it in "
                          "https://pytorch.org/memory_viz)%s", self.ps.rank, self.step + 1, path,
                          "" if self.cfg.train.memory_history else
                          "; train.memory_history: true adds which code made each allocation")
            raise
        res.extra["memory_by_phase"] = self.phase_memory.take()
        if self.stragglers is not None:
            named = self.stragglers.end_step(res.step)
            if res.step % self.stragglers.every == 0:
                res.extra["busy_over_median"] = self.stragglers.last_factors
            for s in named:
                self._report_straggler(res.step, s)
        if res.step == self._first_step + 1:
            self._compare_memory_with_plan()
        self.profiler.end(res.step)
        return res

    def _watch_stragglers(self) -> AbstractContextManager:
        if self.stragglers is None:
            return nullcontext()
        return observe(self.stragglers.enter, self.stragglers.leave)

    def _report_straggler(self, step: int, s: Straggler) -> None:
        """One console line and an event for a rank named slow; its node excluded at the next
        requeue with ``launch.exclude_stragglers``."""
        if not self.ps.is_logging_rank:
            return
        excluded = self.cfg.launch.exclude_stragglers
        every = self.cfg.train.straggler_every
        log.warning("straggler at step %d: rank %d on %s was busy %.2f× the median rank in %d windows of %d steps in "
                    "a row, most of it in %s (%.2f×)%s", step, s.rank, s.node, s.factor, s.windows, every, s.phase,
                    s.phase_factor, f"; {s.node} is excluded at the next requeue (launch.exclude_stragglers)"
                    if excluded else "")
        if self.write_files:
            append_event(self.cfg.run_dir, self.fence, "straggler", step=step, rank=s.rank, node=s.node,
                         factor=s.factor, phase=s.phase, phase_factor=s.phase_factor, excluded=excluded)
            if excluded:
                exclude_nodes(self.cfg.run_dir, [s.node])

    def _report_replacements(self, replaced: list) -> None:
        """A console line and a ``replaced`` event per re-placed MoE layer (moe.eplb), or a
        warning naming the ranks short of memory when the move was skipped."""
        if not self.ps.is_logging_rank:
            return
        for r in replaced:
            if r.skipped:
                log.warning("step %d: EPLB skipped the re-placement of MoE layer %s (the placement stays): %s",
                            self.step, r.layer, r.skipped)
            else:
                log.info("step %d: EPLB re-placed MoE layer %s: experts %s changed rank (%d slots moved, %d bytes "
                         "sent by this rank in %.3f s); over the last %d steps the busiest ep rank had %.2f× the mean "
                         "tokens, %.2f× placed anew", self.step, r.layer, r.moved, r.slots_moved, r.bytes_sent,
                         r.seconds, self.cfg.moe.eplb.window, r.busiest_before, r.busiest_after)
            if self.write_files:
                append_event(self.cfg.run_dir, self.fence, "replaced", step=self.step, layer=r.layer,
                             **r.as_record())

    def _compare_memory_with_plan(self) -> None:
        """After the first step on CUDA: the measured peak beside the planner's prediction for this
        layout, with a warning past 20 % (on the CPU the interpreter's own memory makes the
        comparison meaningless)."""
        if self.device.type != "cuda" or not self.ps.is_logging_rank:
            return
        predicted, measured = predicted_memory_gib(self.cfg), self.phase_memory.peak_gib()
        if predicted is None:
            return
        ratio = measured / predicted
        (log.warning if abs(ratio - 1) > 0.2 else log.info)(
            "memory after the first step: peak %.2f GiB allocated on rank 0, the planner predicted %.2f GiB for this "
            "layout (%.2f×)%s", measured, predicted, ratio,
            "" if abs(ratio - 1) <= 0.2 else ": more than 20 % off; plans made with `python -m moetrain.plan` "
            "are off by as much")

    def _train_step(self) -> StepResult:
        t0 = time.perf_counter()
        for part in self.model_parts:
            part.train()
        micro_batches = self._to_device(self.loader.next_batch(), mtp=self.cfg.model.mtp_depth > 0)
        self._announce_epochs()
        micro_batches = self._with_loss_divisor(micro_batches)
        accum = len(micro_batches)
        lr = lr_at(self.step, self.cfg.train)
        for opt in self.optimizers:
            set_lr(opt, lr)
        forwards = self.runner.forwards_per_step(accum)  # 2 per micro-batch when ep_overlap splits them
        for moe in self.moe_layers.values():
            moe.begin_step(forwards)
        for indexer in self.indexers.values():
            indexer.begin_step(forwards)
        if self.qk_clip is not None:  # the logits of this step's forwards only (not validation's)
            self.qk_clip.reset()

        # Forward + backward of every micro-batch (FSDP2 reduces the gradients during the last
        # one's backward); each MoE layer sums its statistics.
        loss_sums = self.runner.forward_backward(micro_batches)
        moe_stats = {name: moe.take_statistics() for name, moe in self.moe_layers.items()}

        if self.eplb is not None:  # an expert's replicas are one parameter: one gradient
            self.eplb.sum_replica_grads()
        grad_norm = global_grad_norm(self.model_parts, self.ps, self.eplb.norm_weights() if self.eplb else None)
        scalars, loads = self._reduce_metrics(loss_sums, accum, {n: s for n, (s, _) in moe_stats.items()}, forwards)
        # train.anomaly: a non-finite or spiking loss skips the update, decided on the device from
        # the global loss and gradient norm (the same on every rank).
        anomaly = self.anomaly.check(scalars[0], grad_norm)
        skip = anomaly[FLAGS.index("skip")]
        if self.cfg.train.grad_clip > 0:
            clip_gradients(self.model_parts, self.cfg.train.grad_clip, grad_norm)
        with phase(OPTIMIZER):
            gated_step(self.optimizers, skip)
            max_logit = self.qk_clip.apply() if self.qk_clip is not None else None
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.step += 1

        E = self.cfg.moe.num_experts
        for name, moe in self.moe_layers.items():  # aux-loss-free balancing: on the device
            if moe.expert_bias is not None:
                moe.update_expert_bias(loads[name][:E], skip)
        # The step's one host read, of named values: the step's scalars, the gradient norm, the
        # anomaly flags, the dispatch bytes (with ep) and every MoE layer's tokens per expert.
        readings = {**dict(zip(STEP_SCALARS, scalars)), "grad_norm": grad_norm.double(), "anomaly": anomaly}
        if self.cfg.data.loss_mask:
            readings["trained_tokens"] = self._trained_tokens
        if max_logit is not None:
            readings["max_logit"] = max_logit
        if self.cfg.model.dsa.enabled:
            readings["indexer"] = self._indexer_loss(forwards)
        a2a = self._a2a_bytes([rows for _, rows in moe_stats.values()])
        if a2a is not None:
            readings.update(intra_node=a2a[0], inter_node=a2a[1])
        readings.update({f"load.{n}": t for n, t in loads.items()})
        with waiting_on_peers():  # on GPU the read completes the step's queued collectives
            host = read_to_host(readings)
        rows = {n: host[f"load.{n}"][:E] for n in loads}
        rank_tokens = {n: self._rank_tokens(host[f"load.{n}"]) for n in loads}
        replaced = []
        if self.eplb is not None:
            self.eplb.observe(rows)
            replaced = self.eplb.maybe_replace(self.step, self.optimizers)
        dt = time.perf_counter() - t0
        extra: dict[str, Any] = {
            "tokens_per_s": self.tokens_per_step / dt,
            "step_time_s": dt,
            "tflops_per_device": self.flops_per_token * self.tokens_per_step / dt / self.ps.world_size / 1e12,
            "dropped_fraction": host["dropped"][0],
            "consumed_samples": self.loader.consumed_samples,
            "consumed_samples_by_source": self.loader.consumed_samples_by_source(),
            **({"mtp_loss": host["mtp"][0]} if self.cfg.model.mtp_depth else {}),
            **({"indexer_loss": host["indexer"][0]} if self.cfg.model.dsa.enabled else {}),
            "expert_load": {n: load_record(row, rank_tokens[n]) for n, row in rows.items()},
        }
        if self.cfg.data.loss_mask:
            extra["trained_tokens"] = int(host["trained_tokens"][0])
            if extra["trained_tokens"] == 0 and self.ps.is_logging_rank:
                log.warning("step %d: the loss mask excludes every target of the global batch: its LM loss is 0, and "
                            "only the MoE balancing losses, weight decay and the optimizer's momentum moved the "
                            "weights", self.step)
        if max_logit is not None:
            extra["max_logit"] = host["max_logit"][0]
        if replaced:
            extra["eplb_replaced"] = {r.layer: r.as_record() for r in replaced}
            self._report_replacements(replaced)
        if a2a is not None:
            extra["dispatch_bytes"] = {"intra_node": int(host["intra_node"][0]), "inter_node": int(host["inter_node"][0])}
        flags = dict(zip(FLAGS, host["anomaly"]))
        if flags["nonfinite"] or flags["spike"]:
            extra["anomaly"] = {"kind": "nan" if flags["nonfinite"] else "spike", "skipped": bool(flags["skip"]),
                                "z": flags["z"]}
        return StepResult(self.step, host["lm"][0], host["aux"][0], host["z"][0], host["grad_norm"][0], lr, extra)

    def _indexer_loss(self, forwards: int) -> torch.Tensor:
        """The step's DSA indexer loss (float64 scalar on the device): the mean over the model's
        DSA layers, the forwards and the data-parallel ranks of each forward's KL per token.
        Each rank's share covers its queries: the shares add up over cp, stages hold their own
        layers (summed over pp with their count), and the tp ranks hold the same value (taken
        once)."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss sum, DSA layers]
        for indexer in self.indexers.values():
            value = indexer.take_loss_sum()
            if value is not None:
                total[0] += value
        total[1] = float(len(self.indexers))
        if self.ps.size(PP) > 1:
            dist.all_reduce(total, group=self.ps.group(PP))
        if self.ps.size(DP_CP) > 1:  # the cp shares add up; the dp ranks' means add up: divided below
            dist.all_reduce(total[:1], group=self.ps.group(DP_CP))
        return total[0] / (total[1].clamp(min=1.0) * forwards * self.ps.size(DP))

    def _a2a_bytes(self, rows_sent: list[tuple[int, int]]) -> torch.Tensor | None:
        """Bytes the forward dispatch all-to-alls of this step sent within and across NVLink
        domains, summed over all ranks ([2] float64 on the device; None without expert
        parallelism). ``rows_sent``: each local MoE layer's (within, across) rows, host integers
        from the split sizes: no device read."""
        if self.ps.size(EP) == 1 or self.cfg.moe.num_experts == 0:
            return None  # (a pipeline stage without MoE layers still joins the all-reduce)
        intra = sum(r[0] for r in rows_sent) * self.dispatch_row_bytes
        inter = sum(r[1] for r in rows_sent) * self.dispatch_row_bytes
        full = functools.partial(torch.full, (), dtype=torch.float64, device=self.device)  # fill kernels, no copy
        out = torch.stack([full(float(intra)), full(float(inter))])
        dist.all_reduce(out)
        return out

    def _reduce_metrics(self, loss_sums: torch.Tensor, accum: int, moe_stats: dict[str, dict[str, torch.Tensor]],
                        forwards: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The step's metrics, reduced over the ranks, on the device: (:data:`STEP_SCALARS` as
        means over micro-batches, data-parallel ranks and MoE layers; float64 [5]) and each local
        MoE layer's tokens per expert summed over the whole batch ([E] float64). ``loss_sums``:
        the runner's LM and MTP loss sums ([2]); ``moe_stats``: each local MoE layer's
        :meth:`~moetrain.model.moe.MoE.take_statistics` sums, over ``forwards`` forward passes
        (``accum`` unless the runner splits micro-batches).

        Under pipeline parallelism the LM loss lives on the last stage and each stage holds its
        own MoE layers: sums over pp gather them (MoE-layer counts too). Each tp rank routes its
        own 1/tp of the tokens: its aux / z parts (already scaled by ``sequence_split``)
        and expert loads add up over tp; the LM loss, the MoE-layer count and (as a mean) the
        dropped fraction are taken once."""
        dev = self.device
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        aux_sum, z_sum, dropped = zero.clone(), zero.clone(), zero.clone()
        loads = {}
        for name, acc in moe_stats.items():
            aux_sum += acc["aux_loss"]
            z_sum += acc["z_loss"]
            dropped += acc["dropped_fraction"]
            # Under EPLB the tokens per slot ride along: [E + R], split after the sums.
            loads[name] = (torch.cat([acc["tokens_per_expert"], acc["tokens_per_slot"]]) if "tokens_per_slot" in acc
                           else acc["tokens_per_expert"])
        n_moe = torch.full((), float(len(self.moe_layers)), dtype=torch.float64, device=dev)
        lm_mtp = loss_sums.to(dev, torch.float64)
        sums = torch.cat([lm_mtp, torch.stack([aux_sum, z_sum, dropped, n_moe])])
        if self.ps.size(PP) > 1:
            dist.all_reduce(sums, group=self.ps.group(PP))
        # Under expert-tensor parallelism every tp rank routed the same tokens: nothing to add.
        tp = self.ps.size(TP) if self.cfg.parallel.etp == 1 else 1
        if tp > 1:
            dist.all_reduce(sums, group=self.ps.group(TP))
        lm, mtp, aux, z, dropped, n_moe = sums
        if tp > 1:
            for once in (lm, mtp, dropped, n_moe):  # the same on every tp rank; python divisors: no copy
                once /= tp
        per_forward = forwards / accum  # the MoE sums count each forward pass
        moe_div = n_moe.clamp(min=1.0) * per_forward
        scalars = torch.stack([lm, mtp, aux / moe_div, z / moe_div, dropped / moe_div]) / accum
        if self.ps.size(DP_CP) > 1:
            dist.all_reduce(scalars, group=self.ps.group(DP_CP))
            scalars /= self.ps.size(DP_CP)
        if loads:
            load_t = torch.stack(list(loads.values()))
            if self.ps.size(DP_CP) > 1:
                dist.all_reduce(load_t, group=self.ps.group(DP_CP))
            if tp > 1:
                dist.all_reduce(load_t, group=self.ps.group(TP))
            loads = dict(zip(loads, load_t))
        return scalars, loads

    def _rank_tokens(self, row: list[float]) -> list[float] | None:
        """Each ep rank's tokens of one MoE layer from its host row of :meth:`_reduce_metrics`
        (tokens per expert, then under EPLB per slot): the sums of the slots, or of the experts,
        each rank holds; None without expert parallelism."""
        ep, E = self.ps.size(EP), self.cfg.moe.num_experts
        if ep == 1:
            return None
        held = row[E:] if len(row) > E else row
        per = len(held) // ep
        return [sum(held[r * per:(r + 1) * per]) for r in range(ep)]

    @torch.no_grad()
    def evaluate(self) -> tuple[float, dict[str, float]] | None:
        """Mean LM loss over each source's fixed validation batches (all dp ranks), and the
        blended one: the sources' losses weighted by the blend's weights (over the sources that
        have a validation split). None when no source has one. One host read per evaluation."""
        if not self.val_batches:
            return None
        for part in self.model_parts:
            part.eval()
        losses = []
        for batches in self.val_batches.values():
            total = self.runner.forward_only(batches) / len(batches)
            if self.ps.size(PP) > 1:
                dist.all_reduce(total, group=self.ps.group(PP))
            if self.ps.size(DP_CP) > 1:
                dist.all_reduce(total, group=self.ps.group(DP_CP))
                total /= self.ps.size(DP_CP)
            losses.append(total)
        for part in self.model_parts:
            part.train()
        by_source = dict(zip(self.val_batches, torch.stack(losses).tolist()))
        weights = self.loader.weights
        norm = sum(weights[n] for n in by_source)
        return sum(weights[n] * v for n, v in by_source.items()) / norm, by_source

    # -- the loop -----------------------------------------------------------------------------

    def _stop_agreed(self) -> bool:
        """All ranks stop at the same step: any rank's flag stops everyone. A CPU tensor on
        purpose: on GPU clusters the default group maps CPU tensors to gloo
        (:func:`moetrain.parallel.state.init_distributed`), so this costs no device sync."""
        flag = torch.tensor([1 if self.stop_flag.requested else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _log(self, res: StepResult, val: tuple[float, dict[str, float]] | None) -> None:
        if self.sinks is None:  # not the logging rank, or write_files=False
            return
        self.fence.check()
        elapsed, eta = self.eta.tick(res.step, res.extra["step_time_s"])
        rec = {"step": res.step, "loss": res.loss, "aux_loss": res.aux_loss, "z_loss": res.z_loss, "lr": res.lr,
               "grad_norm": res.grad_norm, **res.extra, "attempt": self.attempt, "time": time.time(),
               "elapsed_s": elapsed, "eta_s": eta}
        mem = self.phase_memory.peak_gib()
        rec["mem_gib"] = mem
        val_loss = None
        if val is not None:
            val_loss, rec["val_loss_by_source"] = val
            rec["val_loss"] = val_loss
        self.sinks.write(rec)
        if res.step % self.cfg.train.log_every == 0 or val_loss is not None:
            loads = " ".join(f"L{n}:{v['max_over_mean']:.2f}" for n, v in res.extra["expert_load"].items())
            mtp = f" | mtp {res.extra['mtp_loss']:.4f}" if "mtp_loss" in res.extra else ""
            if "indexer_loss" in res.extra:
                mtp += f" | indexer {res.extra['indexer_loss']:.4f}"
            log.info("step %d/%d | loss %.4f%s | aux %.4f | lr %.2e | grad %.3f | %.0f tok/s | %.3f TFLOP/s/dev | "
                     "mem %.2f GiB | load max/mean %s%s | %s elapsed | eta %s", res.step, self.cfg.train.steps,
                     res.loss, mtp, res.aux_loss, res.lr, res.grad_norm, res.extra["tokens_per_s"],
                     res.extra["tflops_per_device"], mem, loads, f" | val {val_loss:.4f}" if val_loss is not None else "",
                     format_duration(elapsed), format_duration(eta))

    def run(self) -> str:
        """Train until ``train.steps``; returns ``"done"`` or ``"stopped"`` (checkpoint saved).
        Periodic checkpoints go on in the background (``checkpoint.async``); the last one, and
        the one on a stop, are complete when this returns."""
        try:
            return self._run()
        finally:
            if self.sinks is not None:
                self.sinks.close()

    def _run(self) -> str:
        cfg = self.cfg
        if self.ps.is_logging_rank:
            log.info("training %s: world %d (pp %d dp %d cp %d tp %d ep %d), %d micro-batches/step, from step %d",
                     cfg.run.name, self.ps.world_size, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.cp,
                     cfg.parallel.tp, cfg.parallel.ep, cfg.grad_accum_steps, self.step)
        if self.write_files and self.ps.is_logging_rank:
            append_event(cfg.run_dir, self.fence, "started", step=self.step, world_size=self.ps.world_size)
        while self.step < cfg.train.steps:
            self._beat("train")
            if self.before_step is not None:
                self.before_step(self.step + 1)
            res = self.train_step()
            if self.watchdog is not None:
                self.watchdog.step_done(res.extra["step_time_s"])
            if "anomaly" in res.extra and self._on_anomaly(res) == "rollback":
                self._log(res, None)
                self._rollback(res.step)
                continue
            val = None
            if cfg.train.val_every and (self.step % cfg.train.val_every == 0 or self.step == cfg.train.steps):
                val = self.evaluate()
            self._log(res, val)
            if self.after_step is not None:
                self.after_step(self.step)
            if self._stop_agreed():
                self._beat("checkpoint")
                self.save_checkpoint()
                if self.write_files and self.ps.is_logging_rank:
                    append_event(cfg.run_dir, self.fence, "stopped", step=self.step, reason=self.stop_flag.reason)
                return "stopped"
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < cfg.train.steps:
                self._beat("checkpoint")
                self.save_checkpoint(wait=False)
        self.checkpointer.wait()
        if cfg.checkpoint.every or cfg.checkpoint.resume:
            self._beat("checkpoint")
            self.save_checkpoint()
        self._beat("done")
        if self.write_files and self.ps.is_logging_rank:
            append_event(cfg.run_dir, self.fence, "finished", step=self.step)
        return "done"

    def _on_anomaly(self, res: StepResult) -> str:
        """Apply ``train.anomaly``'s policy to a step whose loss or gradient norm was non-finite
        or whose loss spiked (its update already skipped on the device where the policy says so);
        returns the action taken: ``warn``, ``skip`` or ``rollback``.

        Raises:
            FloatingPointError: ``on_nan: stop``, or more than ``max_skips`` skipped steps — one
                line naming the step(s), the values and the setting that changes it.
        """
        an, info = self.cfg.train.anomaly, res.extra["anomaly"]
        nan = info["kind"] == "nan"
        policy = an.on_nan if nan else an.on_spike
        what = (f"loss {res.loss:.6g}, gradient norm {res.grad_norm:.6g}" if nan else
                f"loss {res.loss:.6g}, {info['z']:.1f} standard deviations above the mean of the last "
                f"{an.window} steps")
        if nan and policy == "stop":
            raise FloatingPointError(f"step {res.step}: {what}: not finite; its update was not applied and the run "
                                     f"stops (train.anomaly.on_nan: stop). Set train.anomaly.on_nan: skip or rollback "
                                     f"to go on past such steps, or lower train.lr / check the data")
        if policy != "warn":
            self.anomalous_steps.append(res.step)
            if len(self.anomalous_steps) > an.max_skips:
                raise FloatingPointError(f"step {res.step}: {what}: {len(self.anomalous_steps)} anomalous steps "
                                         f"({', '.join(map(str, self.anomalous_steps))}), more than "
                                         f"train.anomaly.max_skips = {an.max_skips}: the run stops")
        action = {"warn": "warned", "skip": "update skipped", "rollback": "update skipped, rolling back"}[policy]
        if self.ps.is_logging_rank:
            log.warning("step %d: %s %s: %s (train.anomaly.on_%s: %s)", res.step,
                        "non-finite" if nan else "loss spike,", what, action, "nan" if nan else "spike", policy)
            if self.write_files:
                append_event(self.cfg.run_dir, self.fence, "anomaly", step=res.step, anomaly=info["kind"],
                             loss=res.loss, grad_norm=res.grad_norm, z=info["z"], action=policy)
        return policy

    def _rollback(self, step: int) -> None:
        """``rollback``: reload the latest complete checkpoint on every rank and go on from its
        step, the data going on after the anomalous batch (the batches since the checkpoint are
        skipped: the loader's position is not restored).

        Raises:
            FloatingPointError: no complete checkpoint to roll back to.
        """
        self.checkpointer.wait()
        found = self.checkpointer.latest_valid()
        if found is None:
            raise FloatingPointError(f"step {step}: train.anomaly asks for a rollback, and {self.cfg.run_dir / 'checkpoints'} "
                                     f"holds no complete checkpoint yet: the run stops (use skip until the first "
                                     f"checkpoint, or checkpoint more often)")
        _, path = found
        state = self.checkpointer.load(path, self.model_parts, self.optimizers)
        self.step = int(state["step"])
        if "anomaly" in state:  # the window as it was at the checkpoint's step
            self.anomaly.load_state_dict(state["anomaly"])
        if self.ps.is_logging_rank:
            log.warning("step %d: rolled back to %s (step %d); steps %d-%d go on with the data after step %d's batch",
                        step, path, self.step, self.step + 1, step, step)
            if self.write_files:
                truncate_metrics(self.metrics_path, self.step, self.fence)
                append_event(self.cfg.run_dir, self.fence, "rolled_back", step=step, to_step=self.step,
                             checkpoint=str(path))
            if self.sinks is not None:
                self.sinks.rewind(step, self.step)

    def _beat(self, phase: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat(self.step, phase)


# The step's scalar metrics, in the order of Trainer._reduce_metrics.
STEP_SCALARS = ("lm", "mtp", "aux", "z", "dropped")


def load_record(tokens: list[float], rank_tokens: list[float] | None) -> dict:
    """A MoE layer's ``expert_load`` metrics: the tokens of each logical expert and the largest
    over the mean; with expert parallelism also each ep rank's tokens (its slots' under EPLB) and
    the busiest rank's over the mean."""
    def over_mean(xs: list[float]) -> float:
        return max(xs) / (sum(xs) / len(xs)) if sum(xs) > 0 else 0.0

    out = {"tokens": [int(x) for x in tokens], "max_over_mean": over_mean(tokens)}
    if rank_tokens is not None:
        out.update(rank_tokens=[int(x) for x in rank_tokens], rank_max_over_mean=over_mean(rank_tokens))
    return out


def read_to_host(readings: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Named device tensors → their values on the host, read in one copy (one sync on a GPU)."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in readings.values()]).tolist()
    out, at = {}, 0
    for name, t in readings.items():
        out[name], at = flat[at:at + t.numel()], at + t.numel()
    return out


def rank_hosts(world: int) -> list[str] | None:
    """Node names in rank order, one per node, from every rank's host name (a collective); None
    when a node's ranks are not contiguous (the rank map then takes ``launch.nodes`` nodes)."""
    hosts: list = [None] * world
    dist.all_gather_object(hosts, node_name())
    nodes = [h for i, h in enumerate(hosts) if i == 0 or hosts[i - 1] != h]
    return nodes if len(nodes) == len(set(nodes)) and world % len(nodes) == 0 else None


def topology_mesh_ranks(cfg: Config, hosts_from_ranks: bool = False) -> tuple[list, list[int]]:
    """The [pp, dp, cp, tp] rank layout from the topology mapper (the job's nodes and cluster
    profile) and the NVLink domain of every rank, computed on rank 0 and broadcast so every rank
    builds the same mesh — the map that ``python -m moetrain.ranks`` shows is the one used.
    ``hosts_from_ranks``: the nodes are the ranks' own hosts (:func:`rank_hosts`), not SLURM's
    node list or ``launch.nodes``."""
    from moetrain.topology import build_rank_map

    nodes = rank_hosts(dist.get_world_size()) if hosts_from_ranks else None
    holder: list = [None]
    if dist.get_rank() == 0:
        if hosts_from_ranks:
            log.info("rank map: nodes %s as the ranks report them%s", ", ".join(nodes) if nodes else "(not contiguous)",
                     "" if cfg.launch.profile else "; no launch.profile, so a flat generic topology (one NVLink "
                     "domain per node)")
        rank_map = build_rank_map(cfg, nodes=nodes if nodes and len(nodes) == cfg.launch.nodes else None)
        holder[0] = (rank_map.mesh_ranks.tolist(), [rank_map.domain_of(r) for r in range(rank_map.world)])
        for rule in rank_map.rules:
            if rule.status == "broken":
                log.warning("rank placement breaks %r: %s", rule.text, rule.detail)
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def truncate_metrics(path: Path, last_step: int, fence: Fence | None) -> None:
    """Keep only the metrics records of steps <= ``last_step`` (atomic rewrite)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                keep.append(line)
        except json.JSONDecodeError:
            continue
    if fence is not None:
        fence.check()
    atomic_write(path, "".join(k + "\n" for k in keep))
