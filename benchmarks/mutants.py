"""Mutation check of the code since 8cade57: one-line realistic bugs in the pipeline, the written-out decode step, the
policy-loss family, the mode choice's estimators, the sampling seeds and compare's evaluated steps, each applied to a
scratch copy of the working tree and held against the tests that should catch it.

    python benchmarks/mutants.py                    # every mutant; a table, the rate, a JSON of every row
    python benchmarks/mutants.py --list             # the mutants, without running anything
    python benchmarks/mutants.py --only W01,P03     # some of them
    python benchmarks/mutants.py --files pipeline/  # those of files whose path contains the pattern

Each mutant replaces ``original``, a substring that occurs exactly once in ``file`` (an anchor, not a line number, so
that the list survives edits elsewhere in the file), by ``replacement``. The repository's working tree (tracked files
and untracked files that git does not ignore) is copied once into a temporary folder; a mutant is applied there, its
module byte-compiled (a mutant that does not compile is ``invalid``), its tests run with that folder first on
``PYTHONPATH`` (``python -c "import fasttnt"`` there is checked to import the copy), and the file restored. Outcomes:

* ``caught``: a test failed (or the run hit the timeout while the same tests pass unmutated: ``timeout``, counted as
  caught);
* ``survived``: every test passed;
* ``invalid``: the mutant does not compile, or none of its tests passes unmutated;
* ``anchor missing``: ``original`` no longer occurs exactly once in the file (the file changed): not counted.

The tests of each distinct set run once unmutated first; a test that fails unmutated is deselected from the mutants'
runs (and listed in the JSON), so that a test broken by work in progress neither catches nor invalidates a mutant.

The rate is caught / (caught + survived), timeouts counted as caught. A survivor's ``why`` says why it is equivalent
(no input the code can receive tells it apart) where it is; a mutant's ``tests`` name the tests that should catch it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    why: str


PIPE = "tests/test_pipeline.py::"
CATCH = "tests/test_mutant_catches.py::"
CLIPPED = "tests/kernels/test_clipped_policy_loss.py::"
LINEAR = "tests/kernels/test_linear_policy_loss.py::"
CHOICE = "tests/test_mode_choice.py::"
MODES = "tests/test_modes.py::"
HF = "tests/test_hf_engine.py::"
COMPARE = "tests/test_compare.py::"

STALENESS_T = (PIPE + "test_the_staleness_bound_by_hand",)
ROLES_T = (PIPE + "test_the_roles_a_world_cannot_hold_are_refused_naming_the_key",)
WIRE_T = (
    PIPE + "test_the_fields_of_a_scored_batch_round_trip",
    PIPE + "test_a_malformed_batch_is_refused_naming_the_worker",
    PIPE + "test_a_header_announcing_more_than_a_shipment_holds_is_refused_before_anything_is_allocated",
    PIPE + "test_a_flipped_bit_in_the_batches_in_flight_is_refused_or_reads_back_unchanged",
    PIPE + "test_a_damaged_in_flight_file_is_refused_naming_it_and_what_is_wrong",
    PIPE + "test_the_batches_in_flight_read_back_per_worker_and_a_checkpoint_of_other_workers_is_refused",
    PIPE + "test_the_workers_shipments_join_in_worker_order",
    CATCH + "TestWire",
)
PUSH_T = (
    PIPE + "test_a_push_over_a_link_of_its_own_arrives_whole_and_a_mismatched_one_is_refused",
    CATCH + "TestWeightPush",
)
REMOTE_T = (
    PIPE + "test_the_workers_shipments_join_in_worker_order",
    PIPE + "test_the_trainers_share_a_step_as_the_colocated_ranks_share_its_prompts",
    PIPE + "test_a_damaged_in_flight_file_is_refused_naming_it_and_what_is_wrong",
    CATCH + "TestPushCheck",
)
VESPO_T = (
    CLIPPED + "test_vespo_by_hand",
    CLIPPED + "test_a_vespo_weight_past_float32_is_zero",
    CLIPPED + "test_other_policy_losses_match_float64_reference",
    CLIPPED + "test_vespo_on_the_torch_path_by_hand",
    CLIPPED + "test_vespo_clamps_each_tokens_log_ratio_before_the_sum",
)
LOSS_T = (
    *VESPO_T,
    CLIPPED + "test_sequence_level_cispo_and_sapo_by_hand",
    CLIPPED + "test_policy_loss_settings_are_checked",
    CLIPPED + "test_bad_options_name_the_problem",
)
CHOICE_T = (
    CHOICE + "test_the_saturating_choice_by_hand",
    CHOICE + "test_the_saturating_choice_steps_with_the_gaps_sign_and_saturates_at_each_mode",
    CHOICE + "test_the_evidence_choice_steps_with_the_gaps_sign_and_sizes_a_clear_level_alike",
    CHOICE + "test_the_centered_choice_steps_by_each_groups_gap_against_the_batchs_mean",
    CHOICE + "test_the_evidence_and_centered_choices_are_refused_where_they_cannot_work",
    CHOICE + "test_the_saturating_choice_needs_mode_mixed_rollouts_and_the_policy_rule",
    CATCH + "TestModeChoice",
)
BEHAVIOUR_T = (
    MODES + "test_the_first_tokens_behaviour_log_probs_by_hand",
    MODES + "test_a_stale_batch_weighs_its_mode_tokens_against_the_weights_that_sampled_it",
    MODES + "test_the_fade_by_hand",
    MODES + "test_log1mexp_is_finite_where_p_rounds_to_one",
    CHOICE + "test_below_the_floor_the_step_fades_and_keeps_its_sign",
    CATCH + "TestModeChoice",
)
DECODE_T = (
    HF + "test_generation_equals_the_generate_reference",
    HF + "test_the_written_out_step_only_where_it_is_the_models_forward",
    HF + "test_a_row_is_the_same_alone_and_in_a_batch",
)
COMPARE_T = (
    COMPARE + "test_the_mean_of_evaluations",
    COMPARE + "test_the_checkpoints_of_the_evaluated_steps_are_kept",
    COMPARE + "test_the_numbers_behind_the_report",
    CATCH + "TestCompare",
)
SEEDS_T = ("tests/test_sampler.py", CATCH + "TestSamplingSeeds")
GUARD_T = ("tests/test_trainer.py::test_the_guard_stops_past_its_limit_and_at_nan", CATCH + "TestGuard")

M = Mutant
STALENESS = "fasttnt/pipeline/staleness.py"
ROLES = "fasttnt/pipeline/roles.py"
WIRE = "fasttnt/pipeline/wire.py"
WEIGHTS = "fasttnt/pipeline/weights.py"
BUCKETS = "fasttnt/engines/weight_buckets.py"
REMOTE = "fasttnt/pipeline/remote.py"
PUSH = "fasttnt/pipeline/push.py"
PEER = "fasttnt/pipeline/peer.py"
DECODE = "fasttnt/engines/decode_step.py"
POLICY = "kernels/fasttnt_kernels/_policy_loss.py"
CLIPPED_SRC = "kernels/fasttnt_kernels/clipped_policy_loss.py"
MODES_SRC = "fasttnt/modes.py"
GUARD = "fasttnt/guard.py"
ROLLOUTS = "fasttnt/rollouts.py"
SAMPLER = "fasttnt/engines/sampler.py"
JOBS = "fasttnt/compare/jobs.py"
PLAN = "fasttnt/compare/plan.py"
VARIANTS = "fasttnt/variants.py"

MUTANTS: list[Mutant] = [
    # -- the staleness bound ---------------------------------------------------------------------------------------
    M(
        "S01",
        STALENESS,
        "return max(0, step - 1 - max_staleness)",
        "return max(0, step - max_staleness)",
        STALENESS_T,
        "off by one: the oldest version one newer than the bound allows",
    ),
    M(
        "S02",
        STALENESS,
        "return max(0, step - 1 - max_staleness)",
        "return max(1, step - 1 - max_staleness)",
        STALENESS_T,
        "the first steps ask for version 1, which the start (version 0) is not",
    ),
    M("S03", STALENESS, "return step - 1 - version", "return step - version", STALENESS_T, "staleness off by one"),
    M(
        "S04",
        STALENESS,
        "if version > step - 1:",
        "if version > step:",
        STALENESS_T,
        "a batch of a version the trainer has not made yet passes",
    ),
    M(
        "S05",
        STALENESS,
        "if version < oldest_version(step, max_staleness):",
        "if version <= oldest_version(step, max_staleness):",
        STALENESS_T,
        "< for <=: the oldest fresh version refused",
    ),
    M(
        "S06",
        STALENESS,
        "if version < oldest_version(step, max_staleness):",
        "if version < oldest_version(step, max_staleness) - 1:",
        STALENESS_T,
        "one version past the bound passes",
    ),
    # -- the roles ---------------------------------------------------------------------------------------------------
    M("R01", ROLES, "if w >= world:", "if w > world:", ROLES_T, "a world of workers only passes"),
    M("R02", ROLES, "if prompts % w:", "if prompts % world:", ROLES_T, "the wrong divisor of the prompts"),
    M(
        "R03",
        ROLES,
        "if prompts % (trainers * minis):",
        "if prompts % trainers:",
        (*ROLES_T, CATCH + "TestRoles"),
        "the mini-batches left out of the trainers' share",
    ),
    M(
        "R04",
        ROLES,
        "return rank >= self.world - self.workers",
        "return rank > self.world - self.workers",
        (*ROLES_T, CATCH + "TestRoles"),
        "the first worker rank taken for a trainer",
    ),
    M(
        "R05",
        ROLES,
        "return range(self.world - self.workers, self.world)",
        "return range(self.world - self.workers + 1, self.world)",
        (*ROLES_T, CATCH + "TestRoles"),
        "the first worker left out of the worker ranks",
    ),
    # -- the policy loss family: VESPO's weights (the torch path, and the kernel), the sequence log-ratios ------------
    M(
        "L01",
        POLICY,
        "log_phi = lam + k * log_w - lam * torch.exp(log_w)",
        "log_phi = lam + k * log_w - k * torch.exp(log_w)",
        VESPO_T,
        "VESPO's weight with k for lambda (torch path)",
    ),
    M(
        "L02",
        POLICY,
        "k = torch.where(nonneg, config.vespo_k_pos, config.vespo_k_neg).to(log_w.dtype)",
        "k = torch.where(nonneg, config.vespo_k_neg, config.vespo_k_pos).to(log_w.dtype)",
        VESPO_T,
        "VESPO's k of the other sign of the advantage (torch path)",
    ),
    M(
        "L03",
        POLICY,
        "return torch.where(log_phi > VESPO_LOG_PHI_MAX, 0.0, torch.exp(log_phi.clamp(max=VESPO_LOG_PHI_MAX)))",
        "return torch.exp(log_phi.clamp(max=VESPO_LOG_PHI_MAX))",
        VESPO_T,
        "a weight past float32 kept at its cap instead of 0 (torch path)",
    ),
    M("L04", POLICY, "nonneg = a >= 0", "nonneg = a <= 0", VESPO_T, "the sign test of the advantage reversed"),
    M(
        "L05",
        POLICY,
        "    diff = diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)\n    if is_weights",
        "    diff = diff.clamp(-LOG_RATIO_CLAMP, 2 * LOG_RATIO_CLAMP)\n    if is_weights",
        VESPO_T,
        "the per-token clamp of VESPO's log-ratio loosened",
    ),
    M(
        "L06",
        POLICY,
        "diff = diff + is_weights.detach().double().log().clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)",
        "diff = diff + is_weights.detach().double().log().clamp(max=VESPO_LOG_W_MAX)",
        VESPO_T,
        "a zero rollout weight's log unclamped (-inf)",
    ),
    M(
        "L07",
        POLICY,
        "return _sequence_sums(diff, cu_seqlens).clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX).float()",
        "return _sequence_sums(diff, cu_seqlens).clamp(max=VESPO_LOG_W_MAX).float()",
        VESPO_T,
        "the sequence's log-weight unclamped below",
    ),
    M(
        "L08",
        POLICY,
        "return (_sequence_sums(diff, cu_seqlens) / lengths.clamp(min=1).double()).float()",
        "return (_sequence_sums(diff, cu_seqlens) / lengths.clamp(min=1).double().sqrt()).float()",
        LOSS_T,
        "GSPO's mean log-ratio over the wrong length",
    ),
    M(
        "L09",
        POLICY,
        "return ends[cu_seqlens[1:].long()] - ends[cu_seqlens[:-1].long()]",
        "return ends[cu_seqlens[1:].long()] - ends[cu_seqlens[:-1].long() + 1]",
        LOSS_T,
        "each sequence's sum leaves out its first token",
    ),
    M(
        "L10",
        POLICY,
        'return self.policy_loss in ("gspo", "vespo") or self.ratio_level == "sequence"',
        'return self.policy_loss in ("gspo",) or self.ratio_level == "sequence"',
        LOSS_T,
        "VESPO without its per-sequence log-ratio",
    ),
    M(
        "L11",
        POLICY,
        "need(math.isfinite(getattr(self, key)) and getattr(self, key) >= 0.0, key, finite_nonnegative)",
        "need(math.isfinite(getattr(self, key)), key, finite_nonnegative)",
        LOSS_T,
        "a negative VESPO k accepted",
    ),
    M(
        "L12",
        CLIPPED_SRC,
        "phi = tl.where(log_phi > vespo_log_phi_max, 0.0, tl.exp(tl.minimum(log_phi, vespo_log_phi_max)))",
        "phi = tl.exp(tl.minimum(log_phi, vespo_log_phi_max))",
        VESPO_T,
        "the kernel's weight past float32 kept",
    ),
    M(
        "L13",
        CLIPPED_SRC,
        "k = tl.where(nonneg, vespo_k_pos, vespo_k_neg)",
        "k = tl.where(nonneg, vespo_k_neg, vespo_k_pos)",
        VESPO_T,
        "the kernel's k of the other sign",
    ),
    M(
        "L14",
        CLIPPED_SRC,
        'is_w = x.is_weights[rows] if x.is_weights is not None and self.config.policy_loss != "vespo" else None',
        "is_w = x.is_weights[rows] if x.is_weights is not None else None",
        VESPO_T,
        "VESPO's rollout weights applied per token as well as in the sequence's weight",
    ),
    M(
        "L15",
        CLIPPED_SRC,
        "seq_log_ratio = sums.clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)[seq]  # (N,)",
        "seq_log_ratio = sums.clamp(max=VESPO_LOG_W_MAX)[seq]  # (N,)",
        VESPO_T,
        "the float64 reference's VESPO log-weight unclamped below",
    ),
    M(
        "L16",
        CLIPPED_SRC,
        "pg = -vespo_weights(seq_log_ratio.to(dtype), a, config) * a * logp",
        "pg = -vespo_weights(seq_log_ratio.to(dtype), a, config) * a",
        VESPO_T,
        "the torch path's VESPO term without its log-prob (no gradient)",
    ),
    # -- the mode choice: the estimators, the behaviour log-probs, the fade ------------------------------------------
    M(
        "C01",
        MODES_SRC,
        "up, down = (1 - p) ** CHOICE_POWER, p**CHOICE_POWER",
        "up, down = p**CHOICE_POWER, (1 - p) ** CHOICE_POWER",
        CHOICE_T,
        "the saturating sizes swapped",
    ),
    M(
        "C02",
        MODES_SRC,
        "return CHOICE_SCALE * torch.where(gap > 0, up, down)",
        "return CHOICE_SCALE * torch.where(gap < 0, up, down)",
        CHOICE_T,
        "the saturating size of the wrong sign",
    ),
    M(
        "C03",
        MODES_SRC,
        "return EVIDENCE_SCALE / gap.abs().clamp(min=EVIDENCE_FLOOR)",
        "return EVIDENCE_SCALE / gap.clamp(min=EVIDENCE_FLOOR)",
        CHOICE_T,
        "missing abs: a negative gap floored",
    ),
    M(
        "C04",
        MODES_SRC,
        "odd = ((position - start) % 2).bool()",
        "odd = (position % 2).bool()",
        CHOICE_T,
        "the halves split by the row's position, not by its place in its block",
    ),
    M(
        "C05",
        MODES_SRC,
        "step = (gap_b * size(gap_a) + gap_a * size(gap_b)) / 2  # (G,)",
        "step = (gap_a * size(gap_a) + gap_b * size(gap_b)) / 2  # (G,)",
        CHOICE_T,
        "each half sized by its own gap (not independent)",
    ),
    M(
        "C06",
        MODES_SRC,
        "step = torch.where(both_a & both_b, step, 0.0)",
        "step = torch.where(both_a | both_b, step, 0.0)",
        CHOICE_T,
        "a half without both modes still steps",
    ),
    M(
        "C07",
        MODES_SRC,
        "on_thinking = (-step / p.clamp(min=0.5)).unsqueeze(1) / n_thinking.clamp(min=1)",
        "on_thinking = (step / p.clamp(min=0.5)).unsqueeze(1) / n_thinking.clamp(min=1)",
        CHOICE_T,
        "the thinking rows' share of the step of the wrong sign",
    ),
    M(
        "C08",
        MODES_SRC,
        "low = (p < 0.5).unsqueeze(1)  # (G, 1)",
        "low = (p < 0.1).unsqueeze(1)  # (G, 1)",
        CHOICE_T,
        "the switch between the direct and the thinking rows at the wrong p",
    ),
    M(
        "C09",
        MODES_SRC,
        "both = (n_direct > 0) & (n_direct < k)  # (G,)",
        "both = n_direct > 0  # (G,)",
        CHOICE_T,
        "the centered mean over groups of one mode too",
    ),
    M(
        "C10",
        MODES_SRC,
        "mean = step[both].mean() if both.any() else step.new_zeros(())",
        "mean = step.mean() if both.any() else step.new_zeros(())",
        CHOICE_T,
        "the centered mean over every group",
    ),
    M(
        "C11",
        MODES_SRC,
        "on_direct = torch.where(both, (step - mean) / n_direct.clamp(min=1), 0.0)  # (G,)",
        "on_direct = torch.where(both, step - mean, 0.0)  # (G,)",
        CHOICE_T,
        "the centered step not spread over the rows",
    ),
    M(
        "C12",
        MODES_SRC,
        "gap = torch.where(direct, mode_gap.double().view(-1, k), -mode_gap.double().view(-1, k))[:, 0]",
        "gap = mode_gap.double().view(-1, k)[:, 0]",
        CHOICE_T,
        "a group led by a thinking row read with its sign",
    ),
    M(
        "C13",
        MODES_SRC,
        "p = think_end_logp.double().clamp(max=0.0).exp()  # (G,) a log-prob",
        "p = think_end_logp.double().exp()  # (G,) a log-prob",
        CHOICE_T,
        "a log-prob rounded above 0 makes p > 1 (NaN sizes)",
    ),
    M(
        "C14",
        MODES_SRC,
        'return "decoupled" if sum(cfg.rollout.forced_rows()) > 0 else "shared"',
        'return "decoupled" if sum(cfg.rollout.forced_rows()) >= 0 else "shared"',
        CHOICE_T,
        "auto picks the decoupled choice without forced rows",
    ),
    M(
        "C15",
        MODES_SRC,
        'if self.mode_token_floor == "auto" and self.mode_advantage in UNFADED:  # no fade',
        'if self.mode_token_floor == "auto" and self.mode_advantage == "saturating":  # no fade',
        CHOICE_T,
        "the centered choice faded (breaks its zero mean)",
    ),
    M(
        "C16",
        MODES_SRC,
        "log_end = torch.logaddexp(torch.full_like(end, _log(s_n)), end + _log(s_f))",
        "log_end = torch.logaddexp(torch.full_like(end, _log(s_t)), end + _log(s_f))",
        BEHAVIOUR_T,
        "the mixture's </think> probability with the thinking share",
    ),
    M(
        "C17",
        MODES_SRC,
        "log_other = first_logp.double() + torch.logaddexp(_log(s_t) - not_end, torch.full_like(end, _log(s_f)))",
        "log_other = first_logp.double() + torch.logaddexp(_log(s_t) + not_end, torch.full_like(end, _log(s_f)))",
        BEHAVIOUR_T,
        "the forced-thinking renormalisation multiplied instead of divided",
    ),
    M(
        "C18",
        MODES_SRC,
        "first_logp, end = batch.behaviour_first_logp, batch.behaviour_think_end_logp.double()",
        "end = batch.behaviour_think_end_logp.double()",
        BEHAVIOUR_T,
        "a stale batch's first tokens read under the trainer's weights",
    ),
    M(
        "C19",
        MODES_SRC,
        "return torch.exp(FADE_POWER * (think_end_logp.float() - floor_logp).clamp(max=0.0))",
        "return torch.exp(FADE_POWER * (think_end_logp.float() - floor_logp).clamp(min=0.0))",
        BEHAVIOUR_T,
        "the fade clamped on the wrong side",
    ),
    M(
        "C20",
        MODES_SRC,
        "think_end_logp = batch.behaviour_think_end_logp[:: self.group_size]",
        "think_end_logp = batch.behaviour_think_end_logp[: self.group_size]",
        BEHAVIOUR_T,
        "the fade reads the first group's rows, not one row per group",
    ),
    # -- the written-out decode step ---------------------------------------------------------------------------------
    M(
        "D01",
        DECODE,
        "return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin",
        "return x * cos + torch.cat((x[..., half:], -x[..., :half]), -1) * sin",
        DECODE_T,
        "the rotary of the wrong sign",
    ),
    M(
        "D02",
        DECODE,
        "x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)",
        "x = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + norm.variance_epsilon)",
        DECODE_T,
        "RMS over a sum",
    ),
    M(
        "D03",
        DECODE,
        "cached.keys[:, :, length - 1] = qk[:, heads:]",
        "cached.keys[:, :, length - 2] = qk[:, heads:]",
        DECODE_T,
        "the new key written over the previous position",
    ),
    M(
        "D04",
        DECODE,
        "q = qk[:, :heads].reshape(rows, kv_heads, heads // kv_heads, dim)",
        "q = qk[:, :heads].reshape(rows, heads // kv_heads, kv_heads, dim).transpose(1, 2)",
        DECODE_T,
        "the query heads grouped across the kv heads",
    ),
    M(
        "D05",
        DECODE,
        "probs = torch.softmax(scores, -1, dtype=torch.promote_types(scores.dtype, torch.float32))",
        "probs = torch.softmax(scores, -2, dtype=torch.promote_types(scores.dtype, torch.float32))",
        DECODE_T,
        "the softmax over the wrong axis",
    ),
    M(
        "D06",
        DECODE,
        'masked_fill_(mask == 0, -float("inf"))',
        'masked_fill_(mask == 1, -float("inf"))',
        DECODE_T,
        "the mask's bias inverted",
    ),
    M(
        "D07",
        DECODE,
        "if len(layers) != cfg.num_hidden_layers:",
        "if len(layers) < cfg.num_hidden_layers:",
        DECODE_T,
        "a model whose forward runs fewer layers than it holds decoded with all of them",
    ),
    M(
        "D08",
        DECODE,
        'if module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"):',
        'if module._forward_hooks or hasattr(module, "_hf_hook"):',
        DECODE_T,
        "a forward pre-hook inside a layer passed by",
    ),
    M(
        "D09",
        DECODE,
        "scores = torch.matmul(q, keys.transpose(2, 3)) * attn.scaling + bias",
        "scores = torch.matmul(q, keys.transpose(2, 3)) + bias",
        DECODE_T,
        "the attention scores unscaled",
    ),
    M(
        "D10",
        DECODE,
        "gate, up = F.linear(_rms_norm(x, layer.post_attention_layernorm), *joined.gate_up).chunk(2, -1)",
        "up, gate = F.linear(_rms_norm(x, layer.post_attention_layernorm), *joined.gate_up).chunk(2, -1)",
        DECODE_T,
        "the MLP's gate and up swapped",
    ),
    # -- the guard's statistic ---------------------------------------------------------------------------------------
    M("G01", GUARD, "return not diff <= limit", "return diff > limit", GUARD_T, "a NaN difference passes the guard"),
    M(
        "G02",
        GUARD,
        "diff = (a.double() - b.to(a.device).double()).abs()",
        "diff = a.double() - b.to(a.device).double()",
        GUARD_T + REMOTE_T,
        "the log-prob checks' statistic (guard, push check, engine check) without abs",
    ),
    M(
        "G03",
        GUARD,
        "return float(total[0] / total[1].clamp(min=1.0))",
        "return float(total[0])",
        GUARD_T,
        "the guard's statistic a sum, not a mean per token",
    ),
    M(
        "G04",
        GUARD,
        "limit = self.limit if self.floor is None else max(self.limit, GUARD_NOISE_FACTOR * self.floor)",
        "limit = self.limit if self.floor is None else min(self.limit, GUARD_NOISE_FACTOR * self.floor)",
        GUARD_T,
        "the bf16 floor lowers the limit instead of raising it",
    ),
    # -- the ranks' sampling seeds -----------------------------------------------------------------------------------
    M(
        "F01",
        ROLLOUTS,
        "first_row = (draw * r.prompts_per_step + self.rank * per_rank) * r.group_size",
        "first_row = (draw * per_rank + self.rank * per_rank) * r.group_size",
        SEEDS_T,
        "a later draw's rows overlap another rank's seeds",
    ),
    M(
        "F02",
        ROLLOUTS,
        "first_row = (draw * r.prompts_per_step + self.rank * per_rank) * r.group_size",
        "first_row = (draw * r.prompts_per_step + self.rank) * r.group_size",
        SEEDS_T,
        "the ranks' rows overlap (rank, not its first prompt)",
    ),
    M(
        "F03",
        ROLLOUTS,
        "problems = problems[self.rank * per_rank : (self.rank + 1) * per_rank]",
        "problems = problems[self.rank : self.rank + per_rank]",
        SEEDS_T,
        "the ranks' shares of the prompts overlap",
    ),
    M(
        "F04",
        SAMPLER,
        "return run_seed * SEED_STRIDE + step",
        "return run_seed + step",
        SEEDS_T,
        "consecutive run seeds share their calls' seeds",
    ),
    M(
        "F06",
        SAMPLER,
        "kept = (cum - p < top_p * total).sum(-1, keepdim=True).clamp_(min=1)",
        "kept = (cum - p < top_p * total).sum(-1, keepdim=True)",
        SEEDS_T,
        "a NaN row keeps no token",
    ),
    # -- compare's evaluated steps -----------------------------------------------------------------------------------
    M(
        "E01",
        JOBS,
        "out[key] = sum(numbers) / len(numbers) if numbers else None",
        "out[key] = sum(numbers) / len(values) if numbers else None",
        COMPARE_T,
        "the mean over every evaluation, missing ones as 0",
    ),
    M("E02", JOBS, "elif isinstance(first, bool) or not all(", "elif not all(", COMPARE_T, "flags averaged"),
    M(
        "E03",
        JOBS,
        'out["te"] = token_efficiency(out["acc"], out["len"])',
        'out["te"] = out["te"]',
        COMPARE_T,
        "the token efficiency the mean of the steps', not that of the mean accuracy and length",
    ),
    M(
        "E04",
        PLAN,
        "every = math.gcd(*settings.evaluated_steps)",
        "every = min(settings.evaluated_steps)",
        COMPARE_T,
        "checkpoints every smallest evaluated step, missing the others",
    ),
    M(
        "E05",
        PLAN,
        "saves = -(-settings.steps // every)",
        "saves = settings.steps // every",
        COMPARE_T,
        "one checkpoint too few kept where the steps are no multiple",
    ),
    M(
        "E06",
        JOBS,
        'out = run.out / self.eval_dir if not self.steps else run.out / self.eval_dir / f"step-{step}"',
        "out = run.out / self.eval_dir",
        COMPARE_T,
        "every evaluated step written to one folder (each overwrites)",
    ),
    M(
        "E07",
        JOBS,
        'model = run.out / "final" if step == run.cfg.steps else checkpoint_paths(run.out / "checkpoints", step)[0]',
        'model = checkpoint_paths(run.out / "checkpoints", step)[0]',
        COMPARE_T,
        "the last step evaluated from a checkpoint folder, not final/",
    ),
    # -- variants (AdaptThink) ---------------------------------------------------------------------------------------
    M(
        "V01",
        VARIANTS,
        '"loss.mode_token_logp": "half",',
        '"loss.mode_token_logp": "mixture",',
        (CHOICE + "test_adaptthinks_objective_ratchets_up_on_short_answers_and_follows_the_gap_on_long_ones",),
        "AdaptThink's forced token with the mixture's behaviour log-prob",
    ),
    M(
        "V02",
        VARIANTS,
        '"loss.adv_scale": "none",\n        "loss.mode_token_floor": 0,',
        '"loss.adv_scale": "std",\n        "loss.mode_token_floor": 0,',
        (CHOICE + "test_adaptthinks_objective_ratchets_up_on_short_answers_and_follows_the_gap_on_long_ones",),
        "AdaptThink with GRPO's std scaling",
    ),
    # -- the wire (files edited by others: last) ---------------------------------------------------------------------
    M(
        "W01",
        WIRE,
        '("solution_len", torch.int32),',
        '("solution_len", torch.int64),',
        WIRE_T,
        "solution_len shipped as int64 (the trainer's int32 expected)",
    ),
    M(
        "W02",
        WIRE,
        '("forced", torch.int8),',
        '("forced", torch.int64),',
        WIRE_T,
        "the forced codes arrive int64, not the engine's int8",
    ),
    M("W03", PEER, "ALIGN = 8  #", "ALIGN = 4  #", WIRE_T + PUSH_T, "tensors padded to 4 bytes: float64 misaligned"),
    M(
        "W04",
        WIRE,
        "parts += [raw, torch.zeros(padding(raw.numel()), dtype=torch.uint8)]",
        "parts += [raw]",
        WIRE_T,
        "the sender packs the fields without padding",
    ),
    M("W05", WIRE, "size += nbytes + padding(nbytes)", "size += nbytes", WIRE_T, "the receiver forgets the padding"),
    M(
        "W06",
        WIRE,
        "if codes.get(code) != dtype or numel < 0:",
        "if code not in codes or numel < 0:",
        WIRE_T,
        "a field's dtype code not held against its dtype",
    ),
    M(
        "W07",
        WIRE,
        "if codes.get(code) != dtype or numel < 0:",
        "if codes.get(code) != dtype:",
        WIRE_T,
        "a negative count accepted",
    ),
    M(
        "W08",
        WIRE,
        "if limits is not None and numel > most[name]:",
        "if limits is not None and numel >= most[name]:",
        WIRE_T,
        "a shipment at the limits refused",
    ),
    M(
        "W09",
        WIRE,
        'most["cu_seqlens"] = limits.rows + 1',
        'most["cu_seqlens"] = limits.rows',
        WIRE_T,
        "the bounds' count one short",
    ),
    M(
        "W10",
        WIRE,
        'most["text_bytes"] = min(response_tokens, most["response_ids"]) * MAX_TOKEN_BYTES',
        'most["text_bytes"] = most["response_ids"] * MAX_TOKEN_BYTES',
        WIRE_T,
        "the text bounded by the limits' tokens, not the announced ones",
    ),
    M(
        "W11",
        WIRE,
        "return {**most, **FIXED_SIZE}",
        "return {**FIXED_SIZE, **most}",
        WIRE_T,
        "the fixed sizes overridden by the per-row bound",
    ),
    M(
        "W12",
        WIRE,
        "if header.numel() != HEADER_LEN or magic != MAGIC or n_fields != len(MESSAGE_FIELDS):",
        "if header.numel() != HEADER_LEN or magic != MAGIC:",
        WIRE_T,
        "the header's field count not checked",
    ),
    M(
        "W13",
        WIRE,
        "_check(group_size >= 1 and s % group_size == 0",
        "_check(s % max(group_size, 1) == 0",
        WIRE_T,
        "a group size of 0 accepted",
    ),
    M(
        "W14",
        WIRE,
        "_check(bounds[0] == 0 and bounds[-1] == n and",
        "_check(bounds[-1] == n and",
        WIRE_T,
        "bounds that do not start at 0 accepted",
    ),
    M(
        "W15",
        WIRE,
        '"solution_len", "hacked", "levels", "behaviour_first_logp", "behaviour_think_end_logp")',
        '"solution_len", "hacked", "levels", "behaviour_first_logp")',
        WIRE_T,
        "one per-sequence field's count not checked",
    ),
    M(
        "W16",
        WIRE,
        "_check(logp is None or logp.numel() == n,",
        "_check(logp is None or logp.numel() <= n,",
        WIRE_T,
        "too few rollout log-probs accepted",
    ),
    M(
        "W17",
        WIRE,
        '_check(sum(prompt_lengths) == fields["prompt_tokens"].numel() and min(prompt_lengths, default=0) >= 0,',
        "_check(min(prompt_lengths, default=0) >= 0,",
        WIRE_T,
        "prompt lengths that do not add up accepted",
    ),
    M(
        "W18",
        WIRE,
        "row = bisect.bisect_right(bounds, at) - 1",
        "row = bisect.bisect_left(bounds, at) - 1",
        WIRE_T,
        "the row of a bad id off by one at a row's first token",
    ),
    M(
        "W19",
        WIRE,
        'row = _first(~torch.isfinite(fields["rewards"]))',
        'row = _first(torch.isnan(fields["rewards"]))',
        WIRE_T,
        "an infinite reward accepted",
    ),
    M(
        "W20",
        WIRE,
        "times.numel() != len(TIMED) or draws < 1:",
        "times.numel() != len(TIMED) or draws < 0:",
        WIRE_T,
        "a shipment of no draws accepted",
    ),
    M(
        "W21",
        WIRE,
        'PER_TOKEN = frozenset({"prompt_tokens", "response_ids", "rollout_logp", "probe_logp"})',
        'PER_TOKEN = frozenset({"prompt_tokens", "response_ids", "rollout_logp"})',
        WIRE_T,
        "the probe's log-probs bounded per row, not per token: a whole probe refused",
    ),
    M(
        "W22",
        WIRE,
        "header = [MAGIC, shipment.step, shipment.version,",
        "header = [MAGIC, shipment.version, shipment.step,",
        WIRE_T,
        "the step and the version swapped in the header",
    ),
    M(
        "W23",
        WIRE,
        '_check(counts.numel() == FIXED_SIZE["counts"], worker,',
        '_check(counts.numel() >= FIXED_SIZE["counts"], worker,',
        WIRE_T,
        "a counts field too long accepted",
    ),
    # -- the weight push (edited by others: last) --------------------------------------------------------------------
    M(
        "P01",
        PEER,
        "return -nbytes % ALIGN",
        "return nbytes % ALIGN",
        WIRE_T + PUSH_T,
        "the padding's sign: a tensor after an odd-sized one misaligned",
    ),
    M(
        "P02",
        BUCKETS,
        "if bucket and layer != current and size >= bucket_bytes:",
        "if bucket and size >= bucket_bytes:",
        PUSH_T,
        "a bucket may end inside a decoder layer",
    ),
    M(
        "P03",
        BUCKETS,
        'LAYER = re.compile(r"(.*\\.layers\\.\\d+)\\.")',
        'LAYER = re.compile(r"(.*\\.layers\\.)\\d+\\.")',
        PUSH_T,
        "every decoder layer read as one: the buckets never end between layers",
    ),
    M(
        "P04",
        BUCKETS,
        "if bucket and layer != current and size >= bucket_bytes:",
        "if bucket and layer != current and size > bucket_bytes:",
        PUSH_T,
        "a bucket of exactly bucket_bytes takes the next layer too",
    ),
    M(
        "P05",
        WEIGHTS,
        'text = ";".join(f"{s.name}:{s.shape}:{s.dtype}" for bucket in buckets for s in bucket)',
        'text = ";".join(f"{s.name}:{s.shape}" for bucket in buckets for s in bucket)',
        PUSH_T,
        "the signature blind to dtypes",
    ),
    M(
        "P06",
        WEIGHTS,
        "if count != sum(len(bucket) for bucket in buckets) or sent != mine:",
        "if sent != mine:",
        PUSH_T,
        "the push's parameter count not checked",
    ),
    M(
        "P07",
        WEIGHTS,
        "if magic != MAGIC:",
        "if magic != MAGIC and magic != 0:",
        PUSH_T,
        "a zeroed header (magic 0) taken for a push",
    ),
    M(
        "P08",
        WEIGHTS,
        "at += slot.nbytes + padding(slot.nbytes)",
        "at += slot.nbytes",
        PUSH_T,
        "the receiver's views skip no padding",
    ),
    M(
        "P09",
        WEIGHTS,
        "return torch.empty(sum(s.nbytes + padding(s.nbytes) for s in bucket)",
        "return torch.empty(sum(s.nbytes for s in bucket)",
        PUSH_T,
        "the receive buffer without the padding",
    ),
    M(
        "P10",
        WEIGHTS,
        "parts += [raw, torch.zeros(padding(raw.numel()), dtype=torch.uint8, device=device)]",
        "parts += [raw]",
        PUSH_T,
        "the sender packs without padding",
    ),
    M(
        "P11",
        WEIGHTS,
        "return math.prod(self.shape) * self.dtype.itemsize",
        "return math.prod(self.shape)",
        PUSH_T,
        "a slot's size in elements, not bytes",
    ),
    M(
        "P12",
        BUCKETS,
        'size += getattr(param, "ds_numel", param.numel()) * param.element_size()',
        "size += param.numel() * param.element_size()",
        PUSH_T,
        "a ZeRO-3 shard's local size taken for its full size (buckets of whole models)",
    ),
    M(
        "P13",
        WEIGHTS,
        "send(torch.tensor([MAGIC, version, count, signature(buckets)], dtype=torch.int64))",
        "send(torch.tensor([MAGIC, version + 1, count, signature(buckets)], dtype=torch.int64))",
        PUSH_T,
        "the pushed version off by one",
    ),
    # -- the trainer's side of the pipeline and the push check (edited by others: last) ------------------------------
    M(
        "M01",
        PUSH,
        "if stale_weights(diffs[-1], limit):",
        "if stale_weights(-diffs[-1], limit):",
        REMOTE_T,
        "the push check's rule reads the difference with the wrong sign: no push is ever stale",
    ),
    M(
        "M02",
        GUARD,
        "return float(total[0] / total[1].clamp(min=1.0))",
        "return float(total[0])",
        GUARD_T + REMOTE_T,
        "the log-prob checks' statistic a sum, not a mean per token",
    ),
    M(
        "M03",
        PUSH,
        "return max(diffs)",
        "return min(diffs)",
        REMOTE_T,
        "the logged difference the best worker's",
    ),
    M(
        "M04",
        REMOTE,
        "draws = r.max_draws if r.dynamic_sampling else 1",
        "draws = 1",
        REMOTE_T,
        "a shipment of several draws refused",
    ),
    M(
        "M05",
        REMOTE,
        "row_tokens=prompt + r.max_new_tokens,",
        "row_tokens=max(prompt, r.max_new_tokens),",
        REMOTE_T,
        "a row's tokens bounded by the longer part alone",
    ),
    M(
        "M06",
        REMOTE,
        "vocab=model.get_input_embeddings().num_embeddings",
        "vocab=model.get_input_embeddings().embedding_dim",
        REMOTE_T,
        "the vocabulary read as the hidden size",
    ),
    M(
        "M07",
        REMOTE,
        "return Shipment(concat_draws([s.scored for s in shipments]), first.step, min(s.version for s in shipments),",
        "return Shipment(concat_draws([s.scored for s in shipments]), first.step, max(s.version for s in shipments),",
        REMOTE_T,
        "a step's version the newest worker's, hiding the oldest",
    ),
    M(
        "M08",
        REMOTE,
        "mine = list(range(rank * per_drawn, (rank + 1) * per_drawn))",
        "mine = list(range(rank, rank + per_drawn))",
        REMOTE_T,
        "the trainers' shares overlap",
    ),
    M(
        "M09",
        PUSH,
        "return cfg.rollout.max_staleness > 0 and cfg.rollout.max_logp_diff is not None",
        "return cfg.rollout.max_staleness >= 0 and cfg.rollout.max_logp_diff is not None",
        REMOTE_T,
        "pushes checked on-policy, where there are none",
    ),
    M(
        "M10",
        PUSH,
        "if shipment.probe_version != v:",
        "if shipment.probe_version > v:",
        REMOTE_T,
        "a worker that checked no version passes beside one that did",
    ),
]


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int | None, str, float]:
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout + done.stderr, time.perf_counter() - start
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return None, out, time.perf_counter() - start


def copy_tree(dest: Path) -> None:
    """The working tree's tracked files and untracked files git does not ignore, as they are now, into ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def environment(tree: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        {
            "PYTHONPATH": f"{tree}:{tree / 'kernels'}",
            "OMP_NUM_THREADS": "1",
            "TRITON_INTERPRET": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    return env


def pytest_cmd(tests: list[str], deselect: list[str]) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:randomly",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-rfE",
    ]
    for node in deselect:
        cmd += ["--deselect", node]
    return [*cmd, *tests]


def failing_nodes(output: str) -> list[str]:
    """The node ids pytest's summary lists as failed or erroring."""
    nodes = []
    for line in output.splitlines():
        for prefix in ("FAILED ", "ERROR "):
            if line.startswith(prefix):
                nodes.append(line[len(prefix) :].split(" - ")[0].strip())
    return nodes


def check_anchor(tree: Path, mutant: Mutant) -> str | None:
    path = tree / mutant.file
    if not path.is_file():
        return "file missing"
    count = path.read_text().count(mutant.original)
    return None if count == 1 else f"anchor occurs {count} times"


def write(out: Path, rows: list[dict], *, partial: bool) -> tuple[dict, float]:
    """The JSON of ``rows``: the counts by outcome, the rate caught / (caught + survived), a timeout caught."""
    outcomes = ("caught", "timeout", "survived", "invalid", "anchor missing")
    counts = {k: sum(r["outcome"] == k for r in rows) for k in outcomes}
    valid = counts["caught"] + counts["timeout"] + counts["survived"]
    rate = (counts["caught"] + counts["timeout"]) / valid if valid else float("nan")
    out.write_text(json.dumps({"partial": partial, "counts": counts, "rate": rate, "rows": rows}, indent=1) + "\n")
    return counts, rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated mutant ids")
    parser.add_argument("--files", help="only mutants of files whose path contains this")
    parser.add_argument("--jobs", type=int, default=1, help="1: one mutant at a time (the only mode)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per mutant's tests")
    parser.add_argument("--out", type=Path, help="the JSON of every row (default benchmarks/mutants-cpu-DATE.json)")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    args = parser.parse_args()
    ids = [m.id for m in MUTANTS]
    assert len(ids) == len(set(ids)), "mutant ids are unique"
    chosen = MUTANTS
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - set(ids)
        if unknown:
            parser.error(f"unknown mutant ids {sorted(unknown)}")
        chosen = [m for m in chosen if m.id in wanted]
    if args.files:
        chosen = [m for m in chosen if args.files in m.file]
    if args.list:
        for m in chosen:
            print(
                f"{m.id}  {m.file}\n    - {m.original}\n    + {m.replacement}\n    why: {m.why}\n    tests: "
                f"{' '.join(m.tests)}"
            )
        print(f"{len(chosen)} mutants")
        return 0
    if args.jobs != 1:
        parser.error("--jobs: one mutant at a time (the machine's cores are shared)")
    out = args.out or ROOT / "benchmarks" / f"mutants-cpu-{datetime.date.today().isoformat()}.json"

    tree = Path(tempfile.mkdtemp(prefix="fasttnt-mutants-"))
    try:
        copy_tree(tree)
        env = environment(tree)
        code, where, _ = _run(
            [
                sys.executable,
                "-c",
                "import fasttnt, fasttnt_kernels; print(fasttnt.__file__, fasttnt_kernels.__file__)",
            ],
            tree,
            env,
            120,
        )
        if code != 0 or not all(p.startswith(str(tree)) for p in where.split()):
            print(f"the scratch copy is not what imports: {where}", file=sys.stderr)
            return 2
        print(f"scratch copy: {tree} (imports {where.strip()})", flush=True)
        baselines: dict[tuple[str, ...], dict] = {}
        rows = []
        for m in chosen:
            row = {**asdict(m), "tests": list(m.tests)}
            missing = check_anchor(tree, m)
            if missing:
                row.update(outcome="anchor missing", detail=missing, seconds=0.0)
                rows.append(row)
                print(f"{m.id:4} {m.file:48} anchor missing ({missing})", flush=True)
                continue
            if m.tests not in baselines:
                code, output, seconds = _run(pytest_cmd(list(m.tests), []), tree, env, args.timeout)
                code_all = code
                bad = failing_nodes(output) if code not in (0, None) else []
                if bad:  # run without -x to find every failing test
                    full = [c for c in pytest_cmd(list(m.tests), []) if c != "-x"]
                    code_all, output, seconds = _run(full, tree, env, args.timeout)
                    bad = failing_nodes(output)
                baselines[m.tests] = {
                    "code": code_all,
                    "deselect": bad,
                    "seconds": seconds,
                    "tail": output[-1500:] if code_all not in (0, 1) or bad else "",
                }
                if bad:
                    print(f"     unmutated failures, deselected: {bad}", flush=True)
            base = baselines[m.tests]
            row["deselected"] = base["deselect"]
            if base["code"] is None or base["code"] not in (0, 1) or (base["code"] == 1 and not base["deselect"]):
                row.update(
                    outcome="invalid", detail=f"unmutated tests: exit {base['code']}: {base['tail']}", seconds=0.0
                )
                rows.append(row)
                print(f"{m.id:4} {m.file:48} invalid (unmutated tests fail)", flush=True)
                continue
            path = tree / m.file
            text = path.read_text()
            try:
                path.write_text(text.replace(m.original, m.replacement, 1))
                compiled = subprocess.run(
                    [sys.executable, "-m", "py_compile", str(path)], capture_output=True, text=True, env=env
                )
                if compiled.returncode != 0:
                    row.update(outcome="invalid", detail=compiled.stderr[-800:], seconds=0.0)
                else:
                    code, output, seconds = _run(pytest_cmd(list(m.tests), base["deselect"]), tree, env, args.timeout)
                    if code is None:
                        outcome = "timeout"
                    elif code == 0:
                        outcome = "survived"
                    elif code == 5:  # every test deselected
                        outcome = "invalid"
                    else:
                        outcome = "caught"
                    first = failing_nodes(output)
                    row.update(outcome=outcome, seconds=round(seconds, 1), detail=first[0] if first else "")
            finally:
                path.write_text(text)
            rows.append(row)
            print(f"{m.id:4} {m.file:48} {row['outcome']:9} {row['seconds']:6.1f}s  {row['detail'][:90]}", flush=True)
            write(out, rows, partial=True)  # an interrupted run leaves the rows so far
    finally:
        shutil.rmtree(tree, ignore_errors=True)

    counts, rate = write(out, rows, partial=False)
    valid = counts["caught"] + counts["timeout"] + counts["survived"]
    print(f"\n{counts}\nrate: {counts['caught'] + counts['timeout']}/{valid} = {rate:.1%}")
    for r in rows:
        if r["outcome"] == "survived":
            print(f"survivor {r['id']} {r['file']}: {r['why']}")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
