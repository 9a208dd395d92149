#!/usr/bin/env bash
# Re-run the negative controls of docs/development.md: for each, copy the tree, plant one break
# in the mechanism a test guards, run that test alone, and report whether it failed (it must).
#
#   tools/negative_controls.sh [WORKDIR]      # default WORKDIR: a new temporary directory
#
# Prints one line per control ("FAILED as it must" / "PASSED: the test cannot see this break")
# and exits 1 if any control passed. Each control takes 10-40 s on 2 cores.
set -u
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d)}"
bad=0

control() {  # control NAME FILE OLD NEW TEST...: replace the one occurrence of OLD in FILE by NEW
    local name=$1 file=$2 old=$3 new=$4; shift 4
    local tree="$work/$name"
    rm -rf "$tree" && mkdir -p "$tree" && rsync -a --exclude /.git --exclude /runs --exclude /data "$root/" "$tree/"
    ln -s "$root/data" "$tree/data" 2>/dev/null || true
    if ! python3 - "$tree/$file" "$old" "$new" <<'PY'
import sys
path, old, new = sys.argv[1:4]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"{path}: the text to replace occurs {text.count(old)} times (expected once)")
open(path, "w").write(text.replace(old, new))
PY
    then
        echo "$name: could not plant the break (the code changed: update this script)"; bad=1; return
    fi
    if (cd "$tree" && PYTHONPATH="$tree" python3 -m pytest -q -n 0 -p no:cacheprovider "$@" >"$work/$name.log" 2>&1); then
        echo "$name: PASSED: the test cannot see this break ($work/$name.log)"; bad=1
    else
        echo "$name: FAILED as it must ($(tail -1 "$work/$name.log"))"
    fi
}

control stragglers-between-steps moetrain/train/stragglers.py \
    "if name == STEP and self._last_end is not None:" "if False:" \
    "tests/test_stragglers.py::test_a_slowed_rank_is_named_within_k_plus_one_windows[between-outside]"
control stop-signal-during-start-up moetrain/launch/job.py \
    "    catch_stop_signals()  # before" "    pass  # before" \
    "tests/test_lifecycle.py::test_a_stop_signal_during_start_up_stops_at_the_first_step"
control wgrad-flush-order moetrain/parallel/ep_overlap.py \
    "        if self._pending:
            pending, self._pending = self._pending, []" \
    "        owed, self._owed = self._owed, []
        for post_backward in owed:
            post_backward()
        if self._pending:
            pending, self._pending = self._pending, []" \
    "tests/test_ep_overlap.py::test_overlap_is_the_same_step[dp2-ep2-zero2-grouped-mm-delay-wgrad]"
control split-divisor moetrain/parallel/runner.py \
    "divisor)
            for s in (slice(0, h)" \
    "None)
            for s in (slice(0, h)" \
    "tests/test_ep_overlap.py::test_split_micro_batches_are_the_same_step_within_fp32[dp2-ep2]"
control fp8-gradient-wire moetrain/parallel/exchange.py \
    "grad_sent, grad.contiguous()," "grad_sent, fp8.round_trip(grad.contiguous(), fp8.E4M3)," \
    "tests/test_dispatch_fp8.py::test_fp8_dispatch_is_the_same_in_every_layout"
control pp-grad-norm moetrain/parallel/data_parallel.py \
    "    if ps.size(PP) > 1:
        dist.all_reduce(total, group=ps.group(PP))" \
    "    if False:
        dist.all_reduce(total, group=ps.group(PP))" \
    "tests/test_hf_train.py::test_layouts_train_alike"
control plan-vocabulary moetrain/plan.py \
    "cfg, vocab_unknown = vocab_for_planning(load_config(args.config, args.sets))" \
    "cfg, vocab_unknown = load_config(args.config, args.sets), 'model.vocab_size is null'" \
    "tests/test_planner.py::test_plan_takes_a_null_vocabulary_from_the_data_as_the_run_does"
control dp-window-shared-link moetrain/planner/timing.py \
    "shares_link = lay.ep > 1 and" "shares_link = False and" \
    "tests/test_planner_moe.py::test_gradient_reduction_does_not_hide_behind_all_to_alls_on_its_own_link"
control submit-imports-torch moetrain/config.py \
    'if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")):' 'if False:' \
    "tests/test_layered_config.py::test_submit_checks_a_local_config_without_importing_torch"
control anomaly-window-restore moetrain/train/trainer.py \
    'if "anomaly" in state:  # checkpoints of older versions start the window empty' 'if False:' \
    "tests/test_anomaly.py::test_a_spike_on_the_first_step_after_a_restart_is_caught"
control mtp-inputs-masked moetrain/model/transformer.py \
    "self.tok_embeddings(future[..., depth + k].clamp(min=0))" "self.tok_embeddings(future[..., k - 1].clamp(min=0))" \
    "tests/test_finetune_data.py::test_the_modules_embed_the_unmasked_tokens"
control mtp-divisor-per-rank moetrain/train/trainer.py \
    "            dist.all_reduce(count, group=self.ps.group(DP_CP))
        divisor = count.clamp(min=1.0) / (len(micro_batches) * self.ps.size(DP_CP))
        if depths == 1:" \
    "            dist.all_reduce(count[:1], group=self.ps.group(DP_CP))
        divisor = count.clamp(min=1.0) / (len(micro_batches) * self.ps.size(DP_CP))
        if depths == 1:" \
    "tests/test_finetune_data.py::test_multi_token_prediction_with_a_loss_mask_equals_one_process[dp2-ep2]"
control kda-decay-per-head-under-tp moetrain/parallel/tensor.py \
    '(attn.v_conv1d, "weight"),
                        (attn, "A_log"), (attn, "dt_bias"))' \
    '(attn.v_conv1d, "weight"),
                        (attn, "dt_bias"))' \
    "tests/test_kda.py::test_a_kimi_linear_like_model_trains_as_in_one_process[dp2-tp2-sp-ep2]"
control mtp-norms-zero-centred moetrain/model/transformer.py \
    "zc = m.zero_centered_norm  # Qwen3-Next's" "zc = False  # Qwen3-Next's" \
    "tests/test_hf_convert.py::test_qwen3_next_mtp_logits_equal_its_definition_with_transformers_layer"
control eplb-replicas-counted-once moetrain/parallel/data_parallel.py \
    "append((rows * row_weights[id(p)]).sum())" "append(rows.sum())" \
    "tests/test_eplb_training.py::test_eplb_trains_as_the_plain_run[dp2-ep2-zero3]"
control eplb-moments-move moetrain/parallel/eplb.py \
    "for t in [p, *(v for v in states.get(id(p), {}).values()" "for t in [p, *(v for v in {}.values()" \
    "tests/test_eplb_training.py::test_eplb_trains_as_the_plain_run[dp2-ep2-zero3]"
control eplb-logical-checkpoint moetrain/parallel/eplb.py \
    "d[key] = self._convert(d[key], experts.slot_map.slots, self._home())" \
    "d[key] = self._convert(d[key], [s % self.num_experts for s in range(len(experts.slot_map.slots))], self._home())" \
    "tests/test_eplb_training.py::test_a_checkpoint_moves_between_eplb_and_plain_runs[eplb-then-plain]"
control eplb-resumed-placement moetrain/train/checkpoint.py \
    'train_state = {**train_state, "eplb": self.eplb.state_dict()}' \
    'train_state = {**train_state, "eplb_off": self.eplb.state_dict()}' \
    "tests/test_eplb_training.py::test_a_resumed_eplb_run_places_its_slots_as_the_saved_run"
control eplb-nodes-respected moetrain/parallel/eplb.py \
    "self.nodes = nodes if even and" "self.nodes = 1 if even and" \
    "tests/test_eplb_training.py::test_eplb_over_two_nodes_with_the_hierarchical_dispatcher"
control peft-fused-orientation moetrain/hf/peft.py \
    "swapped=arch.moe_names.experts == \"fused_cat\")" "swapped=arch.moe_names.experts != \"fused_cat\")" \
    "tests/test_lora.py::test_peft_loads_the_exported_adapters_with_moetrains_logits[llama4_text]" \
    "tests/test_lora.py::test_peft_loads_the_exported_adapters_with_moetrains_logits[gpt_oss]"
control peft-fused-rank-columns moetrain/hf/peft.py \
    "b_e.permute(1, 2, 0).flatten(1)" "b_e.permute(1, 0, 2).flatten(1)" \
    "tests/test_lora.py::test_peft_loads_the_exported_adapters_with_moetrains_logits[llama4_text]"
control peft-fused-interleave moetrain/hf/peft.py \
    "right = m.part.assemble(rights) if m.part is not None else rights[0]" \
    "right = torch.cat(rights, dim=2) if m.part is not None else rights[0]" \
    "tests/test_lora.py::test_peft_loads_the_exported_adapters_with_moetrains_logits[gpt_oss]"
control planner-per-step-imbalance moetrain/planner/search.py \
    "steps = self.expert_load_steps or [self.expert_loads]" "steps = [self.expert_loads]" \
    "tests/test_eplb.py::test_the_planner_takes_the_busiest_rank_from_measured_loads"
exit $bad
