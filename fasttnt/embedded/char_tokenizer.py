"""The embedded default's tokenizer: one token per character, a chat template, and ``<think>``/``</think>`` as
single special tokens. Built in memory (no hub), saved and loaded like any Hugging Face fast tokenizer."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ..data import THINK_END, THINK_START

PAD, EOS, USER, ASSISTANT = "<pad>", "<eos>", "<|user|>", "<|assistant|>"
UNK = "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK, USER, ASSISTANT, THINK_START, THINK_END)
ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"

# The generation prompt ends inside an open think block, as DeepSeek-R1's does: the model's first token then
# chooses the mode (</think> = answer directly).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}" + EOS + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + THINK_START + "{% endif %}"
)


def build_char_tokenizer(alphabet: str = ALPHABET, *, vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: special tokens first (ids 0-6), then one id per character. ``vocab_size``:
    the vocabulary padded with entries no text encodes to (``<unused_N>``, which decode as such), to stand in for a
    real model's vocabulary size (Qwen2's 151,936) where the costs that grow with it are measured."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(alphabet):
        vocab.setdefault(ch, len(vocab))
    if vocab_size is not None:
        if vocab_size < len(vocab):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the character vocabulary ({len(vocab)})")
        vocab.update({f"<unused_{i}>": i for i in range(len(vocab), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[USER, ASSISTANT, THINK_START, THINK_END],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
