"""Packed attention on the GPU: the log-probs of a packed micro-batch against one unpadded forward per sequence.

    python benchmarks/packed_attention_check.py [--tokens 16384] [--smoke]

A randomly initialised model of DeepSeek-R1-Distill-Qwen-1.5B's shape (Qwen2, GQA 12/2 heads) in bf16 autocast
over float32 weights, as training runs it; sequences of uneven lengths (1-token responses included) packed into one
row of ``--tokens`` tokens go through fasttnt's packed attention (``fasttnt.attention``: flash-attn's varlen kernel
when installed, else PyTorch's own FlashAttention), each sequence alone through transformers' SDPA. Prints the
kernel used, the largest and the mean |difference| of the log-probs and their gradient norms, and what the same row
gives without the boundaries (plain causal attention across sequences), so a wrong mask cannot pass. Exits 1 when
the packed log-probs differ by more than bf16 noise (``--tol``) or the unbounded row does not differ.
``--smoke``: a tiny model on the CPU in float32, which checks the code path (the suite runs it).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens in the packed row")
    parser.add_argument("--tol", type=float, default=0.05, help="largest |log-prob difference| allowed (bf16)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, float32")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, Qwen2Config

    from fasttnt.attention import varlen_backend
    from fasttnt.engines import RolloutBatch, pack_sequences
    from fasttnt.policy import plan_micro_batches, response_logprobs

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=500)  # fmt: skip
        args.tokens, args.tol = 600, 1e-4
    else:  # DeepSeek-R1-Distill-Qwen-1.5B
        shape = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936)  # fmt: skip
    torch.manual_seed(0)
    config = Qwen2Config(**shape, max_position_embeddings=32768, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)

    # uneven sequences filling the row: 1-token responses, short ones, and a few long ones
    lengths: list[tuple[int, int]] = []
    gen = torch.Generator().manual_seed(1)
    while sum(p + r for p, r in lengths) < args.tokens:
        prompt = int(torch.randint(4, max(5, args.tokens // 64), (1,), generator=gen))
        prompt = lengths[-1][0] if len(lengths) % 3 == 2 else prompt  # shares the previous prompt (below)
        response = 1 if len(lengths) % 5 == 0 else int(torch.randint(2, max(3, args.tokens // 8), (1,), generator=gen))
        lengths.append((prompt, response))
    *lengths, (p_last, _) = lengths
    lengths.append((p_last, max(1, args.tokens - sum(p + r for p, r in lengths) - p_last)))
    vocab = shape["vocab_size"]
    prompts = [torch.randint(0, vocab, (p,), generator=gen).tolist() for p, _ in lengths]
    # every third sequence answers the same prompt as the one before it, as a group's samples do: the row holds
    # that prompt once (fasttnt.policy), and the kernel runs over the gathered prompt + response sequences
    for i in range(2, len(lengths), 3):
        prompts[i] = prompts[i - 1]
    responses = [torch.randint(0, vocab, (r,), generator=gen).tolist() for _, r in lengths]
    ids, cu = pack_sequences(responses, device)
    batch = RolloutBatch(prompts, ids, cu, torch.zeros(len(lengths), dtype=torch.bool, device=device), 1)
    plan = plan_micro_batches(batch, args.tokens)
    assert len(plan) == 1, "the sequences must fill one packed row"
    assert plan[0].expand is not None, "some sequences must share their prompt"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def grad_norm(logp: torch.Tensor) -> float:
        model.zero_grad(set_to_none=True)
        logp.sum().backward()
        return float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None)))

    start = time.perf_counter()
    with autocast:
        packed, _ = response_logprobs(model, batch, plan, temperature=1.0)
    packed_norm = grad_norm(packed)
    packed_s = time.perf_counter() - start
    backend = varlen_backend(torch.empty(1, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                         device=device))  # fmt: skip

    # the truth: each sequence alone, unpadded, through transformers' own SDPA attention (no packing)
    per_seq = []
    for prompt, response in zip(prompts, responses, strict=True):
        with autocast:
            logits = model(input_ids=torch.tensor([prompt + response], device=device)).logits[0, len(prompt) - 1 : -1]
        target = torch.tensor(response, device=device)[:, None]
        per_seq.append(torch.log_softmax(logits.float(), -1).gather(1, target)[:, 0])
    truth = torch.cat(per_seq)
    truth_norm = grad_norm(truth)

    # the same row without its boundaries: every sequence attends to those before it
    mb = plan[0]
    with torch.no_grad(), autocast:
        row = mb.input_ids.to(device)
        logits = model(input_ids=row, attention_mask=torch.ones_like(row), position_ids=mb.position_ids.to(device))
        logits = logits.logits[0]
    mixed = torch.log_softmax(logits[mb.hidden_index.to(device)].float(), -1).gather(1, ids[:, None])[:, 0]

    diff = (packed.detach() - truth.detach()).abs()
    mixed_diff = (mixed - truth.detach()).abs()
    n_seq = len(lengths)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; packed attention {backend}")
    print(
        f"{args.tokens} tokens in {n_seq} sequences, {sum(r == 1 for _, r in lengths)} 1-token responses; "
        f"one row of {mb.input_ids.shape[1]} tokens (shared prompts held once)"
    )
    print(f"packed vs per-sequence log-probs: max |diff| {diff.max():.3g}, mean {diff.mean():.3g} (tol {args.tol})")
    print(f"gradient norm of sum(log-probs): packed {packed_norm:.6g}, per-sequence {truth_norm:.6g}")
    print(f"without boundaries (sequences mixed): max |diff| {mixed_diff.max():.3g}, mean {mixed_diff.mean():.3g}")
    print(f"packed forward + backward {packed_s * 1e3:.0f} ms (first call, includes compilation)")
    if backend != "flash_attn":  # the kernel a GPU run with every extra installed takes went unchecked
        why = "flash-attn is not installed" if device.type == "cuda" else "the CPU runs no FlashAttention"
        print(f"SKIPPED: flash-attn's varlen kernel ({why}); the packed attention checked is {backend}")
    ok = bool(diff.max() <= args.tol) and bool(mixed_diff.max() > 10 * args.tol) and not torch.isnan(packed).any()
    ok = ok and abs(packed_norm - truth_norm) <= 0.05 * truth_norm
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
