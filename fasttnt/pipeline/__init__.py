"""Generation apart from training: rollout workers (``worker``) that ship scored batches (``wire``) to the trainers
(``remote``), over point-to-point messages whose every wait is bounded (``peer``), in the roles a launch is split into
(``roles``); the bound on how stale a batch's weights may be (``staleness``); and the trainers' weights pushed back
after each update and checked (``push``), in buckets (``weights``), into a vLLM engine through its weight-transfer
calls (``vllm_transfer``)."""
