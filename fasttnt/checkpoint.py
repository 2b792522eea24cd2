"""Atomic checkpoints: a step's folder is written under a temporary name and renamed into place, so a run killed
mid-save leaves the previous checkpoint whole. Weights are safetensors; optimizer and RNG states load with
``torch.load(weights_only=True)``, never an unrestricted unpickle (the learning rate is a function of the step).
Distributed runs add DeepSpeed's own checkpoint (each rank's optimizer shard) under ``deepspeed/``."""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_PREFIX = "step-"


@dataclass
class TrainerState:
    step: int  # steps completed
    data_position: int  # problems consumed from the training stream
    world: int = 1  # the ranks that wrote it (a distributed checkpoint holds one optimizer shard per rank)


def seed_rngs(seed: int) -> None:
    """The global RNGs a run starts from: torch's (and CUDA's), Python's and NumPy's."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state() -> dict:
    """The global RNG states as tensors and plain values (``torch.load(weights_only=True)`` reads them back)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_paths(root: Path, step: int) -> tuple[Path, Path]:
    """(final, temporary) folders of the checkpoint of ``step``."""
    final = root / f"{_PREFIX}{step:06d}"
    return final, root / f"{final.name}.tmp"


def save_checkpoint(root: Path, state: TrainerState, model, optimizer, *, keep: int, config_yaml: str) -> Path:
    """Write ``root/step-NNNNNN`` atomically and keep the newest ``keep`` checkpoints (single process)."""
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = checkpoint_paths(root, state.step)
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    write_trainer_files(tmp, state, rank=0, config_yaml=config_yaml)
    commit_checkpoint(root, tmp, final, keep=keep)
    return final


def write_trainer_files(folder: Path, state: TrainerState, *, rank: int, config_yaml: str) -> None:
    """This rank's RNG states, and (rank 0) the step, data position and ranks, and the resolved config that the
    checkpoint means something under (a resume compares its own config with it)."""
    torch.save(rng_state(), folder / f"rng{'' if rank == 0 else f'_rank{rank}'}.pt")
    if rank == 0:
        (folder / "trainer_state.json").write_text(json.dumps(state.__dict__))
        (folder / "config.yaml").write_text(config_yaml)


def commit_checkpoint(root: Path, tmp: Path, final: Path, *, keep: int) -> None:
    """Make a fully written temporary folder the checkpoint (one rename), then drop the oldest."""
    _fsync_tree(tmp)
    if final.exists():  # only when a step is saved twice; never the checkpoint a resume would use
        shutil.rmtree(final)
    os.replace(tmp, final)  # the commit point
    _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    """Make the rename itself durable (POSIX: a directory's entries are flushed by fsync on the directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (half-written ``.tmp`` folders are not checkpoints)."""
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and not p.name.endswith(".tmp")]
    return sorted(done, key=lambda p: int(p.name[len(_PREFIX) :]))


def remove_partial(root: Path) -> None:
    if root.is_dir():
        for p in root.glob(f"{_PREFIX}*.tmp"):
            shutil.rmtree(p, ignore_errors=True)


def read_trainer_state(path: Path) -> TrainerState:
    data = json.loads((path / "trainer_state.json").read_text())
    data.setdefault("world", 1 + len(list(path.glob("rng_rank*.pt"))))  # written before the count was kept
    return TrainerState(**data)


def load_training_state(path: Path, optimizer=None, *, rank: int = 0) -> TrainerState:
    """Restore the optimizer (single process; DeepSpeed restores its own shards) and this rank's RNG states from
    a checkpoint, and return the step and data position. The model is loaded by the caller."""
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    set_rng_state(torch.load(path / f"rng{'' if rank == 0 else f'_rank{rank}'}.pt", weights_only=True))
    return read_trainer_state(path)
