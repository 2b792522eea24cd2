"""The suite's helpers, not tests: tiny runs and their overrides (``small``), a reward scheme whose groups vary by
construction (``varied``, also launched as a module), a stand-in for vLLM's engine rules (``vllm_standin``) and the
seed sweep over the whole suite (``sweep_seeds``)."""
