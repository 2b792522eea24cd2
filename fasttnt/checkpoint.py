"""Checkpoints: ``save``, ``restore`` (a resume) and the final export.

A step's folder is written under a temporary name and renamed into place, so a run killed mid-save leaves the
previous checkpoint whole. It holds the weights (safetensors, Hugging Face layout), the optimizer
(``optimizer.pt``; distributed runs: DeepSpeed's per-rank shards under ``deepspeed/``), each rank's RNG states,
the step and data position (``trainer_state.json``), the resolved config, and the tokenizer (so a checkpoint is a
model folder that ``fasttnt eval --model`` takes). Every pickled file loads with ``torch.load(weights_only=True)``,
DeepSpeed's shards included (``load_deepspeed_state``), never an unrestricted unpickle: a checkpoint folder from
elsewhere runs no code; a file that cannot be read is a ``ResumeError`` naming it. The learning rate is a function
of the step.
"""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from . import distributed, files
from .config import TrainConfig, changed_keys, config_yaml, to_dict

_PREFIX = "step-"


@dataclass
class TrainerState:
    step: int  # steps completed
    data_position: int  # problems consumed from the training stream
    world: int = 1  # the ranks that wrote it (a distributed checkpoint holds one optimizer shard per rank)
    # under bf16: the stale-weight guard's noise floor, step 1's engine-trainer difference over its whole batch
    # (fasttnt.guard)
    logp_diff_floor: float | None = None
    # mode-mixed under loss.mode_token_floor=auto: the log of the settled-choice floor, step 1's smallest
    # log pi_old(</think> | x) (fasttnt.modes)
    mode_token_floor_logp: float | None = None


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


def save_checkpoint(
    root: Path, state: TrainerState, model, optimizer, *, keep: int, config_yaml: str, tokenizer: Path | None = None,
    extra: dict[str, object] | None = None,
) -> Path:  # fmt: skip
    """Write ``root/step-NNNNNN`` atomically and keep the newest ``keep`` checkpoints (single process); ``extra``:
    files of its own (name -> what ``torch.save`` writes there)."""
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = checkpoint_paths(root, state.step)
    shutil.rmtree(tmp, ignore_errors=True)
    write_model_folder(tmp, model, tokenizer)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    write_trainer_files(tmp, state, rank=0, config_yaml=config_yaml, extra=extra)
    commit_checkpoint(root, tmp, final, keep=keep)
    return final


def write_model_folder(folder: Path, model, tokenizer: Path | None = None) -> None:
    """The weights (safetensors) and, given the folder the run saved its tokenizer in once (``out/tokenizer``),
    copies of its files: a checkpoint is a model folder of its own, which `fasttnt eval --model` takes. A copy, not
    another ``save_pretrained``: a real BPE tokenizer takes a second or more to serialise, every checkpoint."""
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer is not None:
        for file in sorted(tokenizer.iterdir()):
            shutil.copy2(file, folder / file.name)


def write_trainer_files(
    folder: Path, state: TrainerState, *, rank: int, config_yaml: str, extra: dict[str, object] | None = None
) -> None:
    """This rank's RNG states, and (rank 0) the step, data position and ranks, the resolved config that the
    checkpoint means something under (a resume compares its own config with it) and the ``extra`` files."""
    torch.save(rng_state(), folder / f"rng{'' if rank == 0 else f'_rank{rank}'}.pt")
    if rank == 0:
        (folder / "trainer_state.json").write_text(json.dumps(state.__dict__))
        (folder / "config.yaml").write_text(config_yaml)
        for name, value in (extra or {}).items():
            torch.save(value, folder / name)


def commit_checkpoint(root: Path, tmp: Path, final: Path, *, keep: int) -> None:
    """Make a fully written temporary folder the checkpoint (its rename), then drop the oldest, each renamed out of
    ``list_checkpoints``' sight before it is deleted."""
    files.replace_folder(tmp, final)
    for old in list_checkpoints(root)[:-keep]:
        files.remove_folder(old)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first: ``step-N`` folders alone (``.tmp``, half written, and ``.old``, half
    deleted, are not checkpoints)."""
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and re.fullmatch(rf"{_PREFIX}\d+", p.name)]
    return sorted(done, key=lambda p: int(p.name[len(_PREFIX) :]))


def remove_partial(root: Path) -> None:
    """What a kill left: half-written and half-deleted checkpoint folders."""
    files.sweep(root, _PREFIX)


def read_trainer_state(path: Path) -> TrainerState:
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))


class ResumeError(ValueError):
    """A checkpoint that the configured run cannot continue."""


def load_tensors(path: Path, map_location=None, *, safe_globals: list | None = None):
    """``torch.load(weights_only=True)`` of a checkpoint's file (tensors, plain containers and the ``safe_globals``
    classes, nothing that runs code), each failure a ``ResumeError`` that names the file and what is wrong."""
    if not path.is_file():
        raise ResumeError(f"--resume: {path} is missing")
    try:
        with torch.serialization.safe_globals(safe_globals or []):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:  # weights_only's refusal: a class or call outside the allowed ones
        raise ResumeError(f"--resume: {path} holds objects a checkpoint of this run never holds, refused unread "
                          f"(weights_only): {str(err).splitlines()[0]}") from err  # fmt: skip
    except Exception as err:  # a damaged file fails anywhere in torch's reader, with any error type
        raise ResumeError(f"--resume: {path} is damaged or truncated ({type(err).__name__}: {err})") from err


def load_training_state(path: Path, optimizer=None, *, rank: int = 0) -> TrainerState:
    """Restore the optimizer (single process; DeepSpeed restores its own shards) and this rank's RNG states from
    a checkpoint, and return the step and data position. The model is loaded by the caller."""
    if optimizer is not None:
        optimizer.load_state_dict(load_tensors(path / "optimizer.pt"))
    rng = path / f"rng{'' if rank == 0 else f'_rank{rank}'}.pt"
    state = load_tensors(rng)
    missing = {"torch", "python", "numpy"} - set(state)
    if missing:
        raise ResumeError(f"--resume: {rng} holds no {', '.join(sorted(missing))} RNG state (written by an earlier "
                          "version): continue it with that version, or start a new run")  # fmt: skip
    set_rng_state(state)
    return read_trainer_state(path)


def check_resume(cfg: TrainConfig, checkpoint: Path, world: int, *, new_config_ok: bool) -> None:
    """Refuse to continue a checkpoint under a config that changes what it means (the model, the group size, the
    reward, ...) or with another number of ranks, naming what differs; keys in ``SAFE_ON_RESUME`` may change."""
    saved = yaml.safe_load((checkpoint / "config.yaml").read_text()) or {}
    differ = changed_keys(saved, to_dict(cfg))
    if differ and not new_config_ok:
        shown = ", ".join(differ[:6]) + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
        raise ResumeError(
            f"--resume: the config differs from {checkpoint.name}'s in {shown}; resume with the same config, or "
            "pass --resume-with-new-config to continue under the new one"
        )
    ranks = read_trainer_state(checkpoint).world
    if ranks != world:
        raise ResumeError(
            f"--resume: {checkpoint.name} was written by {ranks} rank(s) and this run has {world}: resume it with "
            f"{ranks} (each rank restores its own optimizer shard)"
        )


def load_weights(model, folder: Path) -> None:
    """Load a checkpoint's safetensors (one file or shards) into a model built with the same architecture."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            state.update(load_file(file))
        except Exception as err:  # safetensors' own error type names neither the file nor the kind of damage
            raise ValueError(f"{file}: not a readable safetensors file ({type(err).__name__}: {err})") from err
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for name in missing if "lm_head" in name and model.config.tie_word_embeddings}
    if set(missing) - tied or unexpected:
        raise ValueError(f"{folder}: weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()


def save(
    root: Path,
    cfg: TrainConfig,
    state: TrainerState,
    model,
    optimizer,
    ds_engine=None,
    *,
    rank: int = 0,
    tokenizer: Path | None = None,
    extra: dict[str, object] | None = None,
) -> None:
    """The checkpoint of ``state.step``, then the newest ``keep_checkpoints`` kept. Distributed: every rank writes
    its optimizer shard and RNG state into the temporary folder, rank 0 the Hugging Face weights (gathered under
    ZeRO-3) and the ``extra`` files (name -> what ``torch.save`` writes there); once all are done rank 0 renames it
    into place."""
    keep, text = cfg.keep_checkpoints, config_yaml(cfg)
    if ds_engine is None:
        save_checkpoint(root, state, model, optimizer, keep=keep, config_yaml=text, tokenizer=tokenizer, extra=extra)
        return
    final, tmp = checkpoint_paths(root, state.step)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    ds_engine.save_checkpoint(str(tmp), tag="deepspeed")
    with distributed.gathered(list(model.parameters())):
        if rank == 0:
            write_model_folder(tmp, model, tokenizer)
    write_trainer_files(tmp, state, rank=rank, config_yaml=text, extra=extra)
    distributed.barrier()
    if rank == 0:
        commit_checkpoint(root, tmp, final, keep=keep)
    distributed.barrier()


def restore(folder: Path, model, optimizer, ds_engine=None, *, rank: int = 0) -> TrainerState:
    """``save``'s inverse, into a built run: the checkpoint in ``folder``'s weights and optimizer state (single
    process; distributed, DeepSpeed restores its own shards of both), this rank's RNG states, and the step and data
    position, returned. The weights are copied into the model's own parameters, which the optimizer and the rollout
    engine hold. Call it after the engine is built: vLLM reseeds the global RNGs when it starts."""
    if ds_engine is None:
        load_weights(model, folder)
    else:
        load_deepspeed_state(folder, ds_engine)
    return load_training_state(folder, optimizer if ds_engine is None else None, rank=rank)


def deepspeed_safe_globals() -> list[type]:
    """The classes DeepSpeed 0.19's ZeRO-2/3 shards pickle besides tensors and plain containers (read off saved
    shards with ``torch.serialization.get_unsafe_globals_in_checkpoint``): plain data, rebuilt without calling
    anything else."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def load_deepspeed_state(folder: Path, ds_engine) -> None:
    """DeepSpeed's shards of the weights and optimizer, restored by DeepSpeed with every file read through
    ``load_tensors``. Its own torch checkpoint engine unpickles in full (``weights_only=False`` in deepspeed 0.19's
    ``TorchCheckpointEngine.load``): a shard carrying a ``__reduce__`` would run on ``--resume``. Every read of
    ``load_checkpoint`` goes through that engine's ``load`` (universal checkpoints aside, which fasttnt's DeepSpeed
    config never turns on), so it is replaced for the duration."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    if not (folder / "deepspeed").is_dir():
        raise FileExistsError(f"{folder} was written by a single-process run: resume it the same way (no launcher)")
    engine = ds_engine.checkpoint_engine
    if type(engine) is not TorchCheckpointEngine:  # another engine reads files its own way
        raise ResumeError(f"--resume: DeepSpeed's {type(engine).__name__} reads checkpoints outside fasttnt's "
                          "weights-only loads; fasttnt resumes through TorchCheckpointEngine (no checkpoint writer "
                          "in the DeepSpeed config)")  # fmt: skip
    allowed = deepspeed_safe_globals()

    def load(path: str, map_location=None):
        return load_tensors(Path(path), map_location, safe_globals=allowed)

    engine.load = load  # the instance's attribute shadows the class's method
    try:
        load_path, _ = ds_engine.load_checkpoint(str(folder), tag="deepspeed")
    finally:
        del engine.load
    if load_path is None:
        raise ResumeError(f"--resume: DeepSpeed found no checkpoint under {folder / 'deepspeed'}")


def export_final(out: Path, model, tokenizer: Path | None, *, rank: int = 0) -> Path:
    """``out/final``: the trained model and (copied from ``tokenizer``, the run's saved folder) its tokenizer in
    Hugging Face's layout, written under another name and renamed into place (``files.replace_folder``)."""
    final, tmp = out / "final", out / "final.tmp"
    with distributed.gathered(list(model.parameters())):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            write_model_folder(tmp, model, tokenizer)
            files.replace_folder(tmp, final)
    return final
