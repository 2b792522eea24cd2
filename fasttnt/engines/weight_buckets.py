"""A model's parameters in buckets of whole decoder layers: how weights move into a rollout engine, the colocated vLLM
engine's reload (``engines.vllm``) and a push to rollout workers (``fasttnt.pipeline.weights``) alike."""

from __future__ import annotations

import re

import torch

LAYER = re.compile(r"(.*\.layers\.\d+)\.")  # a decoder layer's parameter names: its prefix


def layer_buckets(model: torch.nn.Module, bucket_bytes: int):
    """Named parameters in groups of about ``bucket_bytes`` (at their full, unsharded size) that never split a
    decoder layer."""
    bucket, size, current = [], 0, None
    for name, param in model.named_parameters():
        match = LAYER.match(name)
        layer = match.group(1) if match else name
        if bucket and layer != current and size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, param))
        size += getattr(param, "ds_numel", param.numel()) * param.element_size()
        current = layer
    if bucket:
        yield bucket
