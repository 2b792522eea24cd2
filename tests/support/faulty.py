"""``python -m faulty train ...`` (this folder on ``PYTHONPATH``): ``fasttnt train`` with the varied reward scheme
(``varied``) and one fault of a run with a rollout worker, named by the environment's ``FAULT`` at step ``STEP``:

- ``worker-dies``: the worker's process ends (``os._exit``) instead of shipping step STEP's batch;
- ``worker-hangs``: the worker stops answering instead of shipping it (it sleeps until killed);
- ``trainer-dies``: the trainer's process ends instead of pushing step STEP's weights;
- ``trainer-pauses``: the trainer stops there until killed, after creating the file the environment's
  ``FAULT_FILE`` names (a test kills the job then, at a known point);
- ``trainer-slow``: the trainer sleeps ``SLOW_S`` before every push, so that a worker free to run ahead would;
- ``worker-signalled``: the worker gets SIGTERM (sent to itself: a signal to it alone) after it shipped step STEP - 1's
  batch, so that step STEP's says so.

With several workers or trainers, the environment's ``FAULT_RANK`` (a launched rank) names the one process at fault;
without it every worker (or trainer) is.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import varied

import fasttnt.pipeline.push as push_module
import fasttnt.pipeline.worker as worker
from fasttnt.distributed import launch_rank

STEP = 2
SLOW_S = 1.0
FAULTS = ("worker-dies", "worker-hangs", "trainer-dies", "trainer-pauses", "trainer-slow", "worker-signalled")


def main() -> int:
    fault = os.environ["FAULT"]
    assert fault in FAULTS, fault
    ship, push = worker.send_shipment, push_module.WeightPush.sync
    only = os.environ.get("FAULT_RANK")
    if only is not None and launch_rank() != only:
        fault = "none"  # another process is at fault

    def faulty_ship(shipment, dst, **kwargs) -> None:
        if shipment.step == STEP and fault == "worker-dies":
            os._exit(9)
        if shipment.step == STEP and fault == "worker-hangs":
            time.sleep(3600)
        ship(shipment, dst, **kwargs)
        if shipment.step == STEP - 1 and fault == "worker-signalled":
            os.kill(os.getpid(), signal.SIGTERM)

    def faulty_push(self, model, step, *args) -> None:
        if step == STEP and fault == "trainer-dies":
            os._exit(9)
        if fault == "trainer-slow":
            time.sleep(SLOW_S)
        if step == STEP and fault == "trainer-pauses":
            Path(os.environ["FAULT_FILE"]).touch()
            time.sleep(3600)
        push(self, model, step, *args)

    worker.send_shipment, push_module.WeightPush.sync = faulty_ship, faulty_push
    varied.register()
    from fasttnt.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
