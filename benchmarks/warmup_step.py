"""The embedded default's warm-up step (``fasttnt.embedded.tiny``): its packed forward against the padded forward it
replaced, side by side on the same batches, and where a packed step's time goes.

    python benchmarks/warmup_step.py --steps 40 --json benchmarks/warmup-step-cpu-2026-12-07.json

Both train a fresh tiny model of the default shape (``TinyModelConfig()``) on the warm-up's own stream
(``WarmupConfig()``: 128 examples a step), one forward, backward and AdamW step each, alternating step by step; the
first 5 of each are not counted. The padded step is the one before: the batch sorted by length and cut into 4
right-padded buckets, each through the model's own attention with its mask, logits at every position. Reported:
the median step of each, their ratio (the median of the per-step ratios), the tokens a step holds and the padded
one's padding, and one packed step's phases (data, forward, backward, optimizer).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from fasttnt.attention import use_packed_attention
from fasttnt.embedded.char_tokenizer import build_char_tokenizer
from fasttnt.embedded.tiny import TinyModelConfig, WarmupConfig, _examples, _token_mean_loss, build_tiny_model


def padded_loss(model, pairs, pad_id: int, buckets: int = 4) -> tuple[torch.Tensor, int]:
    """The padded step's loss (the warm-up's before its packed forward) and the slots it computed."""
    pairs = sorted(pairs, key=lambda pr: len(pr[0]) + len(pr[1]))
    size, total, slots = -(-len(pairs) // buckets), torch.zeros(()), 0
    for start in range(0, len(pairs), size):
        chunk = pairs[start : start + size]
        width = max(len(p) + len(r) for p, r in chunk)
        ids = torch.full((len(chunk), width), pad_id)  # (B, T)
        labels = torch.full((len(chunk), width), -100)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, (p, r) in enumerate(chunk):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
            mask[i, : len(p) + len(r)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # (B, T-1, V)
        total = total + torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        slots += ids.numel()
    return total / sum(len(r) for _, r in pairs), slots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    tok = build_char_tokenizer()
    stream = _examples(tok, WarmupConfig())
    batches = [list(itertools.islice(stream, WarmupConfig().batch_size)) for _ in range(args.steps + 5)]

    def fresh():
        model = build_tiny_model(tok, TinyModelConfig())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    padded, packed = fresh(), fresh()
    use_packed_attention(packed[0])
    times: dict[str, list[float]] = {"padded": [], "packed": []}
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    slots = 0
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        loss, slots = padded_loss(padded[0], batch, tok.pad_token_id)
        padded[1].zero_grad()
        loss.backward()
        padded[1].step()
        middle = time.perf_counter()
        loss = _token_mean_loss(packed[0], batch)
        forward = time.perf_counter()
        packed[1].zero_grad()
        loss.backward()
        backward = time.perf_counter()
        packed[1].step()
        end = time.perf_counter()
        if i >= 5:
            times["padded"].append(middle - start)
            times["packed"].append(end - middle)
            for name, seconds in zip(phases, (forward - middle, backward - forward, end - backward), strict=True):
                phases[name].append(seconds)
    start = time.perf_counter()
    for _ in range(20):
        list(itertools.islice(stream, WarmupConfig().batch_size))
    data_s = (time.perf_counter() - start) / 20
    tokens = sum(len(p) + len(r) for p, r in batches[-1])
    result = {
        "threads": torch.get_num_threads(),
        "padded_ms": 1000 * statistics.median(times["padded"]),
        "packed_ms": 1000 * statistics.median(times["packed"]),
        "ratio": statistics.median(a / b for a, b in zip(times["padded"], times["packed"], strict=True)),
        "tokens": tokens,
        "padded_slots": slots,
        "packed_phases_ms": {"data": 1000 * data_s, **{k: 1000 * statistics.median(v) for k, v in phases.items()}},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
