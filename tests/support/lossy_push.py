"""``python -m lossy_push train ...`` (this folder on ``PYTHONPATH``): ``fasttnt train`` with the varied reward scheme
(``varied``) whose rollout worker loses the weight push of version ``LOST``: its version number moves on while its
weights stay as they were, as when a push never reached the engine."""

from __future__ import annotations

import sys

import torch
import varied

import fasttnt.pipeline.worker as worker

LOST = 2


def main() -> int:
    real = worker.recv_weights

    def lossy(model, **kwargs) -> int:
        before = [p.detach().clone() for p in model.parameters()]
        version = real(model, **kwargs)
        if version == LOST:
            with torch.no_grad():
                for param, old in zip(model.parameters(), before, strict=True):
                    param.copy_(old)
        return version

    worker.recv_weights = lossy
    varied.register()
    from fasttnt.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
