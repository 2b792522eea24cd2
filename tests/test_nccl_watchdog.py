"""fasttnt/pipeline/peer.py's watchdog: a weight push over NCCL (stood in by gloo, support/nccl_standin.py) to a
worker that took the header and then stopped answering ends the trainer after ``rollout.worker_timeout`` with one line
naming the worker, its communicator aborted, where the broadcast alone would wait for ever (NCCL) or for the group's
own two minutes (the stand-in)."""

from __future__ import annotations

import os
import subprocess
import sys

from support.small import free_port, kill_job

from fasttnt.pipeline.peer import WATCHDOG_EXIT

TIMEOUT_S = 3  # rollout.worker_timeout of the push: far under the stand-in group's own 120 s
HANG_S = 300

PUSH = f"""
import sys, time
import torch
sys.path.insert(0, {os.path.dirname(__file__)!r})
from support.nccl_standin import GlooAsNccl
from test_pipeline import tiny_model
from fasttnt.pipeline.peer import link, send_to
from fasttnt.pipeline.weights import layout, recv_header, send_weights

rank, port, nccl_port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
group = link("127.0.0.1", port, rank, 2, name="push", timeout=60)
comm = GlooAsNccl("127.0.0.1", nccl_port, rank, 2, torch.device("cpu"))
model = tiny_model(seed=rank)
if rank == 0:
    send_weights(model, 4, dsts=[1], src=0, bucket_bytes=4096, group=group, timeout={TIMEOUT_S}, nccl=comm)
    print("pushed", flush=True)
else:
    version = recv_header(layout(model, 4096), src=0, group=group, timeout=60)
    send_to(torch.ones(1, dtype=torch.int64), 0, peer="the trainer", what="its word", timeout=60, group=group)
    print(f"took the header of version {{version}}", flush=True)
    time.sleep({HANG_S})  # alive, its connections open, and no part in the broadcasts
"""


def test_a_worker_that_stops_during_an_nccl_push_ends_the_trainer_naming_it(tmp_path):
    script = tmp_path / "push.py"
    script.write_text(PUSH)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ports = [str(free_port()), str(free_port())]
    worker = subprocess.Popen([sys.executable, str(script), "1", *ports], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)  # fmt: skip
    try:
        trainer = subprocess.run([sys.executable, str(script), "0", *ports], capture_output=True, text=True, env=env,
                                 timeout=HANG_S)  # fmt: skip
        assert worker.poll() is None, "the worker is alive: its connections stay open, so only a watchdog ends this"
    finally:
        kill_job(worker.pid)
    assert "took the header of version 4" in worker.communicate()[0]  # precondition: the wait is the broadcasts'
    assert "pushed" not in trainer.stdout
    assert trainer.returncode == WATCHDOG_EXIT, trainer.stderr[-3000:]
    lines = trainer.stderr.strip().splitlines()
    said = (f"fasttnt: rollout worker rank 1 took no part in weight version 4's broadcasts for {TIMEOUT_S} s "
            "(rollout.worker_timeout): aborting the NCCL communicator and stopping the run")  # fmt: skip
    assert said in lines
    assert "GlooAsNccl: aborted" in lines[1:]
