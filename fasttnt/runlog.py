"""What a run writes as it goes: ``metrics.jsonl`` (one row per step, flushed), TensorBoard events when
tensorboard is installed, the W&B run when ``logging.wandb`` is on, and the progress bar."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm.auto import tqdm

from . import files


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a metrics file; a line torn by a kill mid-write (always the last) is dropped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(path: Path, step: int) -> None:
    """A resumed run rewrites history from its checkpoint on: drop the lines of steps after it."""
    if not path.exists():
        return
    kept = [json.dumps(row) for row in read_jsonl(path) if row["step"] <= step]
    files.write_text(path, "".join(line + "\n" for line in kept))  # a kill leaves the old file or the new


class RunLog:
    """Rank 0's record of a run (other ranks get one that writes nothing): the history so far, the JSONL file,
    TensorBoard, the W&B run (``wandb``: a ``fasttnt.wandb_log.WandbRun``, or None), the step bar."""

    def __init__(self, out: Path, *, steps: int, done: int, active: bool, progress: bool, wandb=None) -> None:
        self.active = active
        path = out / "metrics.jsonl"
        self.history = read_jsonl(path) if active and path.exists() else []
        self._file = path.open("a") if active else None
        self._tb = _tensorboard(out) if active else None
        self.wandb = wandb if active else None
        self._bar = tqdm(total=steps, initial=done, desc="GRPO", unit="step", disable=not (active and progress))

    def write(self, values: dict[str, float]) -> None:
        self.history.append(values)
        if self._file is not None:
            self._file.write(json.dumps(values) + "\n")
            self._file.flush()
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, values["step"])
        if self.wandb is not None:
            self.wandb.log_row(values)
        self._bar.set_postfix(
            reward=f"{values['reward']:.2f}",
            acc=f"{values['acc']:.2f}",
            len=f"{values['len']:.0f}",
            nt=f"{values['non_thinking_ratio']:.2f}",
            hack=f"{values['hack_rate']:.2f}",
        )
        self._bar.update(1)

    def close_file(self) -> None:
        self._bar.close()
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Everything, TensorBoard's buffered events included (a launcher's rank ends without interpreter teardown,
        which would otherwise lose them)."""
        self.close_file()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional: JSONL is always written
        return None
    return SummaryWriter(out / "tensorboard")
