"""The test seed; the tiny model shapes the tests build; config overrides for a run of seconds (a 1-layer width-32
tiny model, a short warm-up, 4 prompts x 4 samples, seeded from the test seed) and a run under them; a run's logged
metrics (all, and the deterministic ones); a free port for the launchers, and a launched job that cannot outlive a
test."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fasttnt.trainer import Trainer

# Fresh random inputs every run; FASTTNT_TEST_SEED=N replays a run (conftest prints the seed at the start and the
# end of every run, and beside every failure). Set here so that the tests and the runs they launch share it.
SEED = int(os.environ.get("FASTTNT_TEST_SEED") or random.SystemRandom().randrange(2**31))
RUN_SEED = SEED % 1000
"""The seed of the runs the tests make (the trainer's and the warm-up's): the tests that train vary with it too."""

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1}  # fmt: skip
"""The tiny model of the runs of seconds (``TinyModelConfig(**TINY)``; SMALL's ``model.tiny`` overrides): width 32,
one layer, 2 query heads of 16 dims sharing 1 key/value head."""
TINY_4_HEADS = {**TINY, "num_attention_heads": 4, "num_key_value_heads": 2}
"""TINY's width and layer over TinyModelConfig's default heads (4 query heads of 8 dims sharing 2 key/value heads)."""
TINY_GQA = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}  # fmt: skip
"""Grouped-query attention as the Qwen2 models have it (4 query heads of 16 dims share 2 key/value heads), 2 layers:
the model of tests/test_attention.py and tests/test_hf_engine.py."""

SMALL = [
    f"seed={RUN_SEED}",
    f"warmup.seed={RUN_SEED}",
    *(f"model.tiny.{name}={value}" for name, value in TINY.items()),
    "warmup.steps=20",
    "warmup.batch_size=16",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=24",
    "verify_workers=1",
]


def short_run(*extra: str, steps: int = 4) -> list[str]:
    """SMALL with 3 warm-up steps of 8, responses of up to 16 tokens, ``steps`` steps and a checkpoint every 2,
    then ``extra``."""
    return [*SMALL, "warmup.steps=3", "warmup.batch_size=8", "rollout.max_new_tokens=16", f"steps={steps}",
            "save_every=2", *extra]  # fmt: skip


def warmups(tmp_path: Path) -> Path:
    """The warm-up cache the tests of this process share (``cache_dir``): beside ``tmp_path``, in the folder pytest
    gives this process (one per pytest-xdist worker, whose tests run one at a time), so a recipe's warm-up is
    trained once per worker rather than once per test, and no two processes write one entry at once. A test of
    the cache itself uses a folder of its own."""
    return tmp_path.parent / "warmups"


def run_overrides(tmp_path: Path, *extra: str, steps: int = 4) -> list[str]:
    """short_run's overrides with the shared warm-up cache (``warmups``)."""
    return [f"cache_dir={warmups(tmp_path)}", *short_run(*extra, steps=steps)]


def train(tmp_path: Path, out: str, *overrides: str, resume: bool = False) -> tuple[Trainer, list[dict]]:
    """Train under ``overrides`` into ``tmp_path / out`` (the cache: ``warmups``): ``(trainer, rows)``, the trainer
    after its run and the metrics rows it logged."""
    from fasttnt.config import load_config  # here, not at the top: conftest imports this module
    from fasttnt.trainer import Trainer

    trainer = Trainer(load_config(None, [f"cache_dir={warmups(tmp_path)}", *overrides]), tmp_path / out, resume=resume)
    trainer.run()
    return trainer, metric_rows(tmp_path / out)


LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What a launcher (torchrun, deepspeed) sets for each rank, and vLLM's external launcher reads."""


def metric_rows(out) -> list[dict]:
    """The rows of a run's metrics.jsonl (``out``: its output directory)."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


ROUNDING = ("rollout_logp_diff", "worker_logp_diff")
"""Metrics that measure rounding alone: the mean |difference| per token between two computations of the same log-probs
(the engine's and the trainer's, the worker's and the trainer's), ~1e-7 in float32. Their digits move from one run of
the same config to the next (measured: 1.62e-7 and 1.40e-7 at one step of two runs whose every other value agreed), as
CPU kernels may round differently with the memory alignment of their buffers; tests bound them instead."""


def deterministic(row: dict) -> dict:
    """A metrics row without its times, rates and ``ROUNDING`` measures: what two runs of the same config log alike."""
    timed = ("time_", "worker_time_")
    return {k: v for k, v in row.items() if not k.startswith(timed) and not k.endswith("_per_s") and k not in ROUNDING}


def run_job(cmd: list[str], *, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` of a launcher (deepspeed, torchrun) and its ranks, in a process group of their own: past
    ``timeout`` the whole group is killed, ranks included, and the test fails naming the hang (``subprocess.run``
    kills the launcher alone, and ranks blocked in a collective would outlive the test)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc.pid)
        stdout, stderr = proc.communicate()
        hung = f"the job hung: killed with its ranks after {timeout:g} s: {' '.join(cmd)}"
        raise AssertionError(f"{hung}\n{stdout[-2000:]}{stderr[-3000:]}") from None
    finally:
        if proc.poll() is None or _group_alive(proc.pid):  # a rank the launcher left behind after it exited
            kill_job(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def kill_job(pid: int) -> None:
    """SIGKILL a launched job: the process group of its launcher (``pid``, started in a session of its own) and every
    process under the launcher, found first: torchrun's agent starts each rank in a session of its own, which the
    group does not reach (measured: killed ranks' launchers left them sleeping for the rest of the run)."""
    under, todo = [], [pid]
    while todo:  # the launcher's descendants, through each thread's children (Linux's /proc)
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo += [int(child) for child in children.read_text().split()]
        under.append(parent)
    for target in under:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    """A port no process listens on now (the OS picks it). A fixed port can still be held by an earlier test's
    rendezvous store (TIME_WAIT) or by another job on the machine: the likely cause of a distributed test that
    failed once without explanation."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(launcher: str, module: str, *args: str, ranks: int = 2) -> list[str]:
    """``python -m module args`` in one process (``single``), or in ``ranks`` ranks through ``deepspeed`` or
    ``torchrun``, on a free port."""
    if launcher == "single":
        return [sys.executable, "-m", module, *args]
    if launcher == "deepspeed":
        return [shutil.which("deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()), "--module",
                module, *args]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    return [*torchrun, "--master-port", str(free_port()), "-m", module, *args]


def run_ranks(
    module: str, *args: str, env: dict, timeout: float, world: int = 2, until: int | None = None
) -> list[subprocess.CompletedProcess]:
    """``python -m module args`` as ``world`` ranks started by hand, each its own process with a launcher's variables
    (``LAUNCHER_ENV``) and no launcher to end the others when one stops: what each rank does on its own when a peer
    dies. ``until``: once that rank has exited, the others are killed (a rank made to hang). Past ``timeout`` every
    rank is killed and the test fails naming the hang."""
    port, procs, outputs = free_port(), [], []
    with contextlib.ExitStack() as files:
        for rank in range(world):
            ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                     "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
            out, err = (files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
            outputs.append((out, err))
            procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env={**env, **ranks}, text=True,
                                          stdout=out, stderr=err, start_new_session=True))  # fmt: skip
        deadline, hung = time.monotonic() + timeout, False
        for proc in procs if until is None else procs[until : until + 1]:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = True
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        results = []
        for proc, (out, err) in zip(procs, outputs, strict=True):
            out.seek(0), err.seek(0)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read()))
    if hung:
        tails = "\n".join(f"rank {r}: {res.stderr[-1500:]}" for r, res in enumerate(results))
        raise AssertionError(f"a rank hung: killed after {timeout:g} s: python -m {module}\n{tails}")
    return results


def weights_apart(ours: dict, theirs: dict, start: dict) -> tuple[float, float]:
    """How far apart two runs' weights ended (the L2 norm over every tensor, in float64), and how far ``theirs``
    moved from ``start``: a comparison of two trainings bounds the first relative to the second."""
    moved = sum(((theirs[k].double() - start[k].double()) ** 2).sum() for k in theirs) ** 0.5
    apart = sum(((ours[k].double() - theirs[k].double()) ** 2).sum() for k in theirs) ** 0.5
    return float(apart), float(moved)


def biased_lm_head(model, token_id: int, bias: float = 50.0):
    """Replace ``model``'s lm_head by a copy with a bias of ``bias`` on ``token_id`` (0 elsewhere) and return it: at
    +50 every sampled token is that one, at -50 none is, so an engine's stop or truncation is certain, not drawn.
    Change the bias later through ``head.bias`` (under ``torch.no_grad``)."""
    import torch

    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[token_id] = bias
    model.lm_head = head
    return head


def resident_mib() -> float:
    """This process's resident set now (``VmRSS``), in MiB: Linux."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024


def glibc_on_linux() -> bool:
    """Whether fasttnt.host_memory's calls take effect here and /proc shows the resident set."""
    from fasttnt import host_memory

    return host_memory.available() and Path("/proc/self/status").exists()
