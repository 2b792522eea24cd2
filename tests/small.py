"""Config overrides for a run of seconds: a 1-layer width-32 tiny model, a short warm-up, 4 prompts x 4 samples."""

SMALL = [
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
    "model.tiny.num_hidden_layers=1",
    "model.tiny.num_attention_heads=2",
    "model.tiny.num_key_value_heads=1",
    "warmup.steps=20",
    "warmup.batch_size=16",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=24",
    "verify_workers=1",
]
