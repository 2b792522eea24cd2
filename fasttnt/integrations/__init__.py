"""fasttnt's kernels inside other GRPO codebases: ``fasttnt.integrations.trl`` (TRL's GRPOTrainer) and
``fasttnt.integrations.verl`` (verl's registries). Each imports its peer only when used."""
