"""Generation apart from training: rollout workers that ship scored batches to the trainers (``wire``), the bound on
how stale a batch's weights may be (``staleness``), and the trainers' weights pushed to the workers in buckets
(``weights``)."""
