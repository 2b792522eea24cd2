"""fasttnt's kernels inside other GRPO codebases: ``fasttnt.integrations.trl`` (TRL's GRPOTrainer) and
``fasttnt.integrations.verl`` (verl's registries and trainer). Importing this package imports neither peer; each
module imports its own at its top."""
