"""fasttnt: GRPO training of hybrid reasoning models with the TNT reward."""

__version__ = "0.1.0"
