"""The test seed; config overrides for a run of seconds (a 1-layer width-32 tiny model, a short warm-up, 4 prompts x
4 samples, seeded from the test seed); a run's logged metrics (all, and the deterministic ones); and a free port for
the launchers."""

import json
import os
import random
import shutil
import socket
import sys

# Fresh random inputs every run; FASTTNT_TEST_SEED=N replays a run (conftest prints the seed at the start and the
# end of every run, and beside every failure). Set here so that the tests and the runs they launch share it.
SEED = int(os.environ.get("FASTTNT_TEST_SEED") or random.SystemRandom().randrange(2**31))
RUN_SEED = SEED % 1000
"""The seed of the runs the tests make (the trainer's and the warm-up's): the tests that train vary with it too."""

SMALL = [
    f"seed={RUN_SEED}",
    f"warmup.seed={RUN_SEED}",
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
    "model.tiny.num_hidden_layers=1",
    "model.tiny.num_attention_heads=2",
    "model.tiny.num_key_value_heads=1",
    "warmup.steps=20",
    "warmup.batch_size=16",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=24",
    "verify_workers=1",
]


LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What a launcher (torchrun, deepspeed) sets for each rank, and vLLM's external launcher reads."""


def metric_rows(out) -> list[dict]:
    """The rows of a run's metrics.jsonl (``out``: its output directory)."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    """A metrics row without its times and rates: what two runs of the same config log alike."""
    return {k: v for k, v in row.items() if not k.startswith("time_") and not k.endswith("_per_s")}


def free_port() -> int:
    """A port no process listens on now (the OS picks it). A fixed port can still be held by an earlier test's
    rendezvous store (TIME_WAIT) or by another job on the machine: the likely cause of a distributed test that
    failed once without explanation."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(launcher: str, module: str, *args: str) -> list[str]:
    """``python -m module args`` in one process (``single``), or in 2 ranks through ``deepspeed`` or ``torchrun``,
    on a free port."""
    if launcher == "single":
        return [sys.executable, "-m", module, *args]
    if launcher == "deepspeed":
        return [shutil.which("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "--module", module,
                *args]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    return [*torchrun, "--master-port", str(free_port()), "-m", module, *args]
