"""Training-step throughput of a randomly initialised Qwen2-1.5B-shaped policy on packed micro-batches, through
the update's own path: padding-free packed forward, then ``linear_policy_loss`` (the lm_head, the log-probs and the
clipped policy loss in one chunked pass, at the trainer's chunk size, the gradient formed in its forward), backward.

    python benchmarks/train_throughput.py [--tokens 16384] [--steps 10] [--smoke]

Reports tokens/s and model FLOPs utilisation (6 N per token for N non-embedding parameters plus the lm_head,
with the attention term, against the H200's measured 790 TFLOP/s dense bf16). Meaningful on a GPU only.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

H200_BF16_TFLOPS = 790.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per packed micro-batch")
    parser.add_argument("--seq-len", type=int, default=2048, help="length of each packed sequence")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the code path")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, Qwen2Config

    from fasttnt.attention import varlen_backend
    from fasttnt.engines import RolloutBatch
    from fasttnt.policy import MicroBatchLossInputs, as_head, micro_batch_loss, plan_micro_batches

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        shape = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
        )
        args.tokens, args.seq_len, args.steps = 512, 128, 2
    else:  # DeepSeek-R1-Distill-Qwen-1.5B's shape
        shape = dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
        )
    config = Qwen2Config(**shape, max_position_embeddings=32768, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.train()

    n_seq = args.tokens // args.seq_len
    prompt_len = args.seq_len // 8
    prompts = [torch.randint(0, shape["vocab_size"], (prompt_len,)).tolist() for _ in range(n_seq)]
    responses = torch.randint(0, shape["vocab_size"], (n_seq * (args.seq_len - prompt_len),), device=device)
    cu = torch.arange(n_seq + 1, device=device) * (args.seq_len - prompt_len)
    batch = RolloutBatch(prompts, responses, cu, torch.zeros(n_seq, dtype=torch.bool, device=device), n_seq)
    advantages = torch.randn(n_seq, device=device)
    plan = plan_micro_batches(batch, args.tokens)  # one packed micro-batch
    if len(plan) != 1:
        raise SystemExit(f"{args.tokens} tokens planned as {len(plan)} micro-batches; the step times one")
    # the kernel the packed attention runs (fasttnt.attention): flash-attn, PyTorch's varlen, or SDPA per sequence
    attn = varlen_backend(
        torch.empty(1, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
    )

    head = as_head(model)
    # on-policy (no old log-probs), as the update's single pass over a batch: Actor._micro_batch_loss's inputs
    loss_inputs = MicroBatchLossInputs(advantages=advantages, cu_seqlens=cu)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, stats, _ = micro_batch_loss(head, batch, plan[0], temperature=1.0, loss=loss_inputs)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return stats

    stats = step()  # compile, allocate
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    layers, width = shape["num_hidden_layers"], shape["hidden_size"]
    # 6 N per token, plus causal attention's 6 * layers * seq * width (QK^T and PV, forward + backward, halved)
    flops_per_token = 6 * params + 6 * layers * args.seq_len * width
    tokens_per_s = args.tokens / median
    mfu = flops_per_token * tokens_per_s / (H200_BF16_TFLOPS * 1e12)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    print(
        f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, packed attention {attn}, "
        f"gradient checkpointing on"
    )
    print(f"{args.tokens} tokens per micro-batch ({n_seq} sequences of {args.seq_len}), {params / 1e9:.2f}B params")
    # at random weights the policy is near uniform: its entropy near ln V says the fused loss saw the whole vocabulary
    print(f"the update's loss (linear_policy_loss): token entropy {float(stats['entropy']):.3f} (ln V "
          f"{math.log(shape['vocab_size']):.3f} at uniform)")  # fmt: skip
    print(
        f"step median {median * 1e3:.1f} ms (runs {', '.join(f'{t * 1e3:.0f}' for t in times)}); "
        f"{tokens_per_s:,.0f} tokens/s; MFU {100 * mfu:.1f}% of 790 TFLOP/s; peak memory {peak:.1f} GiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
