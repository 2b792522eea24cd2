"""The embedded default's tokenizer: one token per character, a chat template, and ``<think>``/``</think>`` as
single special tokens. Built in memory (no hub), saved and loaded like any Hugging Face fast tokenizer."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, USER, ASSISTANT = "<pad>", "<eos>", "<|user|>", "<|assistant|>"
THINK_START, THINK_END = "<think>", "</think>"
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


def build_char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: special tokens first (ids 0-6), then one id per character."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(alphabet):
        vocab.setdefault(ch, len(vocab))
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
