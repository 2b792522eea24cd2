"""Does the choice read what the first position knows? For each model, a linear probe of the problem's level on the
hidden state at the first generated position, beside the same question asked of the model's own log pi(</think>).

At the first generated position (the prompt's last token, whose state the head turns into the first response
token's distribution) a hybrid model must know how hard the query is before it chooses to think. Two numbers per
model, on the same problems:

* ``probe_auroc``: a logistic probe (L2, standardised features) of "level 1 against the rest" on the final-norm
  hidden state there, scored out of fold (two stratified folds, each scored by the probe fitted on the other), and
  the held-out accuracy of the 4-way probe of the level (``probe_accuracy``);
* ``choice_auroc``: the AUROC of log pi(</think> | x) at the sampling temperature for the same labels: how well the
  model's own choice separates the level the table pays to answer directly.

The </think> logit is one linear read-out of that same state (log pi adds the log-normaliser), so a fitted linear probe
usually does at least as well; the choice follows the table when ``choice_auroc`` rises toward ``probe_auroc``
during training. With
``--run`` every checkpoint of a run (its warm-up at step 0 when the model is the embedded one, each
``checkpoints/step-N``, ``final/``) is measured in order, which is how the two move during training.

The problems are the embedded task's (all 100 one-digit sums and ``--per-level`` sums of each other level, train
and test splits alike: the probe is fitted here, not by the run) or, with ``--problems``, a JSONL file of
``{"problem": ..., "level": ...}`` rows for another model. One JSON row per model goes to ``--out``.

    python benchmarks/choice_probe.py --run runs/x/tnt+mix+acc-w0-s3 --temperature 0.6 --out probe.jsonl
    python benchmarks/choice_probe.py ~/.cache/fasttnt/tiny-warmup-... --temperature 0.6
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

PROBE_L2 = 1e-2
"""The probe's ridge penalty on standardised features, per example: enough to keep a separable fit finite."""


# -- the statistics --------------------------------------------------------------------------------------------------


def auroc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """The probability that a random positive scores above a random negative, ties counted half (the Mann-Whitney
    statistic over the average ranks): ``scores`` (n,), ``positive`` (n,) bool with both classes present."""
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"auroc needs both classes, got {n_pos} positives and {n_neg} negatives")
    scores = scores.double()
    order = scores.argsort()
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    values, inverse = scores.unique(return_inverse=True)  # ties share their average rank
    mean_rank = torch.zeros(len(values), dtype=scores.dtype).index_add_(0, inverse, ranks)
    mean_rank /= torch.bincount(inverse, minlength=len(values)).to(scores.dtype)
    rank_sum = mean_rank[inverse][positive].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def fit_probe(features: torch.Tensor, labels: torch.Tensor, classes: int) -> torch.nn.Linear:
    """A multinomial logistic regression (``classes`` outputs) of ``labels`` (n,) int on ``features`` (n, H),
    standardised by the fit's own mean and spread, fitted to convergence by L-BFGS in float64."""
    x = features.double()
    mean, std = x.mean(0), x.std(0).clamp(min=1e-12)
    x = (x - mean) / std
    linear = torch.nn.Linear(x.shape[1], classes, dtype=torch.float64)
    torch.nn.init.zeros_(linear.weight)
    torch.nn.init.zeros_(linear.bias)
    opt = torch.optim.LBFGS(linear.parameters(), max_iter=500, tolerance_grad=1e-10, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(linear(x), labels) + PROBE_L2 * linear.weight.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():  # fold the standardisation into the layer: it takes raw features
        linear.weight /= std
        linear.bias -= linear.weight @ mean
    return linear


def folds(labels: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """(n,) 0 or 1: two folds, each holding half of every label's examples (a seeded shuffle within each label)."""
    rng = random.Random(seed)
    fold = torch.zeros(len(labels), dtype=torch.long)
    for value in labels.unique().tolist():
        idx = (labels == value).nonzero().flatten().tolist()
        rng.shuffle(idx)
        fold[idx[len(idx) // 2 :]] = 1
    return fold


def out_of_fold(features: torch.Tensor, labels: torch.Tensor, classes: int) -> torch.Tensor:
    """Each example's class log-probabilities (n, classes) from the probe fitted on the other fold."""
    fold = folds(labels)
    out = torch.empty(len(labels), classes, dtype=torch.float64)
    for k in (0, 1):
        probe = fit_probe(features[fold != k], labels[fold != k], classes)
        with torch.no_grad():
            out[fold == k] = torch.log_softmax(probe(features[fold == k].double()), -1)
    return out


def choice_probe(states: torch.Tensor, think_end_logp: torch.Tensor, levels: torch.Tensor, easy: int = 1) -> dict:
    """The probe's and the choice's numbers for one model: ``states`` (n, H) at the first generated position,
    ``think_end_logp`` (n,) log pi(</think>) there, ``levels`` (n,) int; level ``easy`` against the rest."""
    values = sorted(levels.unique().tolist())
    label = torch.tensor([values.index(v) for v in levels.tolist()])  # (n,) 0..L-1
    positive = levels == easy
    binary = out_of_fold(states, positive.long(), 2)
    multi = out_of_fold(states, label, len(values))
    row = {
        "probe_auroc": auroc(binary[:, 1], positive),
        "probe_accuracy": float((multi.argmax(1) == label).double().mean()),
        "choice_auroc": auroc(think_end_logp, positive),
    }
    for v in values:
        row[f"think_end_logp_l{v}"] = float(think_end_logp[levels == v].double().mean())
    return row


# -- the model's side ------------------------------------------------------------------------------------------------


@torch.no_grad()
def first_position(model, tokenizer, prompts: list[str], think_end_id: int, temperature: float, batch: int = 64):
    """The final-norm hidden states (n, H) at each prompt's last token and log pi(</think>) (n,) there at
    ``temperature``. Right-padded batches: a causal model's states at the real tokens do not see the padding."""
    states, logps = [], []
    for start in range(0, len(prompts), batch):
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[start : start + batch]]
        width = max(map(len, ids))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(ids), width), pad)  # (B, T)
        mask = torch.zeros((len(ids), width), dtype=torch.long)  # (B, T)
        for i, row in enumerate(ids):
            input_ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        out = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
        last = mask.sum(1) - 1  # (B,)
        rows = torch.arange(len(ids))
        states.append(out.hidden_states[-1][rows, last].float())  # (B, H): what the head reads
        logits = out.logits[rows, last].float() / temperature  # (B, V)
        logps.append(torch.log_softmax(logits, -1)[:, think_end_id])
    return torch.cat(states), torch.cat(logps)


def synthetic_problems(per_level: int, levels: tuple[int, ...]) -> list[tuple[str, int]]:
    """All 100 one-digit sums and ``per_level`` distinct sums of each other level (a seeded draw), both splits."""
    from fasttnt.embedded.synthetic import _candidate_pairs

    out = []
    for level in levels:
        seen: set[str] = set()
        for a, b in _candidate_pairs(level, random.Random(f"probe-{level}")):
            text = f"{a}+{b}"
            if text not in seen:
                seen.add(text)
                out.append((text, level))
            if len(seen) == (100 if level == 1 else per_level):
                break
    return out


def read_problems(path: Path) -> list[tuple[str, int]]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or "problem" not in row or not isinstance(row.get("level"), int):
            raise SystemExit(f"choice_probe.py: {path} row {n}: needs a 'problem' string and an integer 'level'")
        out.append((str(row["problem"]), row["level"]))
    return out


def run_models(run: Path) -> list[tuple[int, Path]]:
    """A run's models in training order as (step, folder): its warm-up (step 0, the embedded model's cached one),
    each kept checkpoint and ``final/`` (at the run's last step)."""
    from fasttnt.checkpoint import list_checkpoints, read_trainer_state
    from fasttnt.config import load_config
    from fasttnt.embedded.tiny import warmup_cache_path

    config = run / "config.yaml"
    if not config.is_file():
        raise SystemExit(f"choice_probe.py: {run} is no run folder (no config.yaml)")
    cfg = load_config(config, [])
    out = []
    if cfg.model.name == "tiny":
        warm = warmup_cache_path(Path(cfg.cache_dir).expanduser(), cfg.model.tiny, cfg.warmup)
        if warm.is_dir():
            out.append((0, warm))
        else:
            print(f"choice_probe.py: the run's warm-up {warm} is not cached (other code?); starting at its first "
                  "checkpoint", file=sys.stderr)  # fmt: skip
    out += [(read_trainer_state(p).step, p) for p in list_checkpoints(run / "checkpoints")]
    if (run / "final" / "config.json").is_file():
        out.append((cfg.steps, run / "final"))
    return sorted(dict(out).items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", type=Path, help="model folders (a checkpoint, final/, a warm-up)")
    parser.add_argument("--run", type=Path, action="append", default=[], help="every model of a run, in order")
    parser.add_argument("--temperature", type=float, default=0.6, help="the sampling temperature of the choice")
    parser.add_argument("--per-level", type=int, default=300, help="problems of each level above 1")
    parser.add_argument("--levels", default="1,2,3,4")
    parser.add_argument("--problems", type=Path, help="JSONL rows {problem, level} instead of the embedded task's")
    parser.add_argument("--out", type=Path, help="append one JSON row per model here")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fasttnt.data import build_prompt, think_end_token_id

    models = [(None, m, None) for m in args.models]
    models += [(step, m, run) for run in args.run for step, m in run_models(run)]
    if not models:
        parser.error("give model folders or --run")
    levels = tuple(int(v) for v in args.levels.split(","))
    problems = read_problems(args.problems) if args.problems else synthetic_problems(args.per_level, levels)
    level_of = torch.tensor([lv for _, lv in problems])  # (n,)
    header = f"{'model':<60} {'step':>5} {'probe AUROC':>11} {'4-way acc':>9} {'choice AUROC':>12}"
    print(header + "  log pi(</think>) by level")
    for step, path, run in models:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = [build_prompt(tokenizer, text).text for text, _ in problems]
        states, logp = first_position(model, tokenizer, prompts, think_end_token_id(tokenizer), args.temperature)
        row = {"model": str(path), "run": str(run) if run else None, "step": step, "temperature": args.temperature,
               **choice_probe(states, logp, level_of, easy=min(levels))}  # fmt: skip
        by_level = " / ".join(f"{row[f'think_end_logp_l{v}']:.2f}" for v in sorted(set(level_of.tolist())))
        name = str(path)[-60:]
        print(f"{name:<60} {'' if step is None else step:>5} {row['probe_auroc']:>11.3f} "
              f"{row['probe_accuracy']:>9.3f} {row['choice_auroc']:>12.3f}  {by_level}", flush=True)  # fmt: skip
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
