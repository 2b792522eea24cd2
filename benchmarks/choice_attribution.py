"""Where a mode-mixed run's choice comes from: per step and per level, which rows of the loss push log pi(</think>)
of each level's prompts up or down, and how far it actually moved.

Runs ``fasttnt train`` on the embedded task (any variant and overrides; one optimizer step per rollout) and,
before each update, takes the gradient of the step's loss restricted to one subset of its tokens at a time (the
first tokens of the forced direct rows of level l, of the thinking rows of level l, of the free direct rows of
level l; every other token of direct rows; every other token of thinking rows: a partition, so the subsets'
gradients add up to the step's) and
the gradient h_l of the mean log pi(</think> | x) over level l's prompts. The push of subset S on level l is the
first-order change of that mean under one Adam step taken on S's gradient alone:

    push(S -> l) = -lr * c * <g_S / (sqrt(v_hat) + eps), h_l> / (1 - beta1)

with v_hat this step's bias-corrected second moment and c the step's gradient-clipping factor (dividing by
1 - beta1 counts a gradient's whole contribution through the momentum, spread over later steps). ``dlogp_l`` is
the change the real update made, on the same prompts. Writes one JSON row per step to OUT/attribution.jsonl
beside the run's own files; the run trains as ``fasttnt train`` would, at a few extra backwards a step.

    python benchmarks/choice_attribution.py runs/attribution --variant tnt+mix+acc --steps 30 \\
        warmup.direct_share=0.5 warmup.choose_direct=false rollout.temperature=0.6 seed=1

``--summary FILE ...`` reads such rows instead and prints the spill of each level's push onto the others: per step
where level s's forced first tokens push its own choice up, push(forced_first_ls -> l) / push(forced_first_ls -> ls)
for every other level l (median and range over those steps), and the median push of the direct rows' other tokens
on each level's choice (what a tied embedding adds: the ``</think>`` row is also their input).

    python benchmarks/choice_attribution.py --summary runs/tied/attribution.jsonl runs/untied/attribution.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import replace
from pathlib import Path

import torch

import fasttnt.trainer as trainer_module
from fasttnt.config import load_config
from fasttnt.data import PromptMode
from fasttnt.engines.batch import FORCED_CODES
from fasttnt.modes import first_token_index, think_end_rows
from fasttnt.policy import UpdateInputs, plan_micro_batches, response_logprobs
from fasttnt.trainer import Trainer
from fasttnt.variants import variant_overrides


class Attribution:
    """Wraps a trainer's update: the pushes of each subset of the step's tokens on each level's choice."""

    def __init__(self, trainer: Trainer, out: Path) -> None:
        self.trainer, self.out = trainer, out
        self.actor, self.model = trainer.actor, trainer.parts.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.temperature = trainer.cfg.rollout.temperature
        self.update = self.actor.update
        self.rewards = None

    def levels(self, batch) -> torch.Tensor:
        """(G,) digits per operand of each group's problem, read from its prompt (the embedded task's sums)."""
        out = []
        for ids in batch.prompt_ids[:: batch.group_size]:
            text = self.trainer.parts.tokenizer.decode(ids)
            sum_ = re.search(r"(\d+)\+\d+", text)
            if sum_ is None:
                raise SystemExit(f"choice_attribution.py: a prompt without a sum a+b (the embedded task's): {text!r}")
            out.append(len(sum_.group(1)))
        return torch.tensor(out, device=batch.response_ids.device)

    def flat_grad(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])

    def probe_logp(self, batch, *, grad: bool = False) -> torch.Tensor:
        probe = think_end_rows(batch, self.trainer.parts.think_end_id)
        plan = plan_micro_batches(probe, self.trainer.cfg.micro_batch_tokens)
        with torch.set_grad_enabled(grad):
            return response_logprobs(self.actor.head, probe, plan, temperature=self.temperature)[0]

    def subset_grad(self, inputs: UpdateInputs, mask: torch.Tensor) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        masked = replace(inputs, is_weights=mask.float() if inputs.is_weights is None else inputs.is_weights * mask)
        batch = inputs.batch
        n_tokens, n_seqs = float(batch.bounds[-1]), float(batch.lengths.numel())
        for mb in plan_micro_batches(batch, self.trainer.cfg.micro_batch_tokens):
            total, _ = self.actor._micro_batch_loss(masked, mb, n_tokens=n_tokens, n_seqs=n_seqs)
            total.backward()
        return self.flat_grad()

    def __call__(self, inputs: UpdateInputs, **update_options):
        batch, token_weights = inputs.batch, inputs.is_weights
        step, k = self.trainer.state.step + 1, batch.group_size
        levels = self.levels(batch)  # (G,)
        row_levels = levels.repeat_interleave(k)  # (S,)
        first = first_token_index(batch)
        device = batch.response_ids.device
        is_first = torch.zeros(int(batch.bounds[-1]), dtype=torch.bool, device=device)  # (N,)
        is_first[first] = True
        seq_of = torch.repeat_interleave(torch.arange(batch.lengths.numel(), device=device), batch.lengths)  # (N,)
        forced_direct = batch.forced == FORCED_CODES[PromptMode.NON_THINKING]
        direct = batch.response_ids[first] == self.trainer.parts.think_end_id  # (S,)
        rows = {}
        for lv in sorted(set(levels.tolist())):
            at = row_levels == lv
            rows[f"forced_first_l{lv}"] = at & forced_direct
            rows[f"think_first_l{lv}"] = at & ~direct
            rows[f"free_direct_first_l{lv}"] = at & direct & ~forced_direct
        masks = {name: is_first & r[seq_of] for name, r in rows.items()}
        masks["direct_rest"] = ~is_first & direct[seq_of]
        masks["think_rest"] = ~is_first & ~direct[seq_of]
        self.model.train()
        h = {}
        for lv in sorted(set(levels.tolist())):
            self.model.zero_grad(set_to_none=True)
            self.probe_logp(batch, grad=True)[levels == lv].mean().backward()
            h[lv] = self.flat_grad()
        g = {name: self.subset_grad(inputs, m) for name, m in masks.items() if m.any()}
        total = sum(g.values())
        before = self.probe_logp(batch)
        # this step's Adam preconditioner, with the clipping the update will apply
        opt = self.actor.optimizer
        group = opt.param_groups[0]
        (b1, b2), lr, eps = group["betas"], group["lr"], group["eps"]
        clip = min(1.0, self.trainer.cfg.optim.grad_clip / (float(total.norm()) + 1e-6))
        states = [opt.state.get(p, {}) for p in self.params]
        v = torch.cat(
            [s.get("exp_avg_sq", torch.zeros_like(p)).reshape(-1) for s, p in zip(states, self.params, strict=True)]
        )
        t = int(states[0]["step"]) + 1 if states[0] else 1
        v = b2 * v + (1 - b2) * (clip * total) ** 2
        precondition = 1.0 / ((v / (1 - b2**t)).sqrt() + eps)
        result = self.update(inputs, **update_options)
        after = self.probe_logp(batch)
        row = {"step": step}
        for lv, h_l in h.items():
            at = levels == lv
            row[f"logp_l{lv}"] = float(before[at].mean())
            row[f"dlogp_l{lv}"] = float((after[at] - before[at]).mean())
            for name, g_s in g.items():
                row[f"push_{name}->l{lv}"] = float(-lr * clip * (precondition * g_s) @ h_l) / (1 - b1)
            at_rows = row_levels == lv
            for name, sel in (("forced_direct", at_rows & forced_direct), ("thinking", at_rows & ~direct),
                              ("free_direct", at_rows & direct & ~forced_direct)):  # fmt: skip
                if sel.any():
                    row[f"reward_{name}_l{lv}"] = float(self.rewards[sel].mean())
            # under "policy" the first tokens' weights are the fade's alone
            if token_weights is not None and self.trainer.mode_mix.mode_token_logp == "policy":
                row[f"faded_l{lv}"] = float((token_weights[first][at_rows & forced_direct] < 1).float().mean())
        with open(self.out / "attribution.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        return result

    def step_advantages(self, real):
        """``fasttnt.advantages.step_advantages`` with the step's rewards kept for the rows above."""

        def wrapped(rewards, *args):
            self.rewards = rewards.rewards
            return real(rewards, *args)

        return wrapped


def spill_summary(rows: list[dict]) -> list[str]:
    """The spill lines of ``--summary`` for one run's rows."""
    levels = sorted({int(k.rsplit("->l", 1)[1]) for row in rows for k in row if k.startswith("push_")})
    lines = []
    for src in levels:
        own = f"push_forced_first_l{src}->l{src}"
        steps = [row for row in rows if row.get(own, 0) > 0]
        parts = []
        for dst in levels:
            if dst != src and steps:
                spill = [row.get(f"push_forced_first_l{src}->l{dst}", 0.0) / row[own] for row in steps]
                parts.append(f"l{dst} {statistics.median(spill):+.3f} ({min(spill):+.3f}..{max(spill):+.3f})")
        if parts:
            lines.append(f"  level {src}'s push ({len(steps)} steps) spills onto " + ", ".join(parts))
    rest = [f"l{lv} {statistics.median(row.get(f'push_direct_rest->l{lv}', 0.0) for row in rows):+.3f}"
            for lv in levels]  # fmt: skip
    lines.append("  the direct rows' other tokens push, median per step: " + ", ".join(rest))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--summary", nargs="+", type=Path, help="attribution.jsonl files to summarise, not a run")
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--variant", default="tnt+mix+acc")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    if args.summary:
        for path in args.summary:
            print(path)
            print("\n".join(spill_summary([json.loads(line) for line in path.read_text().splitlines()])))
        return
    if args.out is None:
        parser.error("give the run's folder OUT, or --summary FILE ...")
    base = load_config(None, args.overrides)
    cfg = load_config(None, [*args.overrides, *variant_overrides(args.variant, base, None), f"steps={args.steps}"])
    if cfg.loss.mini_batches != 1 or cfg.loss.ppo_epochs != 1:  # the push is that of one Adam step per rollout
        parser.error("needs one optimizer step per rollout: loss.mini_batches=1 loss.ppo_epochs=1")
    trainer = Trainer(cfg, args.out, progress=True)
    attribution = Attribution(trainer, args.out)
    trainer.actor.update = attribution  # the update of this run only: its own instance
    trainer_module.step_advantages = attribution.step_advantages(trainer_module.step_advantages)  # this process only
    trainer.run()


if __name__ == "__main__":  # the verifier's worker processes import this module again
    main()
