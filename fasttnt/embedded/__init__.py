"""The embedded default, which runs anywhere in minutes without a hub: a tiny Qwen2-architecture model built from a
config and warmed up in both modes (``tiny``), a character-level tokenizer with the think tokens and a chat template
(``char_tokenizer``), and a synthetic arithmetic task whose hard problems need a written-out chain of thought
(``synthetic``)."""
