"""fasttnt/checkpoint.py: restore puts back what save wrote (weights, AdamW state, RNGs, trainer state); a crash
while saving keeps the previous checkpoint; only the newest are kept; a checkpoint without numpy's RNG state is
refused in one line."""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import random

import numpy as np
import pytest
import torch
from support.small import TINY_4_HEADS, run_overrides, short_run, train

from fasttnt.checkpoint import list_checkpoints
from fasttnt.cli import main as cli_main
from fasttnt.config import load_config
from fasttnt.embedded.tiny import TinyModelConfig


def test_restore_puts_back_what_save_wrote(tmp_path):
    # checkpoint.save, then checkpoint.restore into a model and optimizer built afresh (other weights, no AdamW state)
    # while the RNGs moved on: the saved weights, AdamW state, RNG states and trainer state, the weights copied into
    # the model's own parameters (the ones the optimizer steps and the hf engine samples from)
    from fasttnt import checkpoint
    from fasttnt.embedded.char_tokenizer import build_char_tokenizer
    from fasttnt.embedded.tiny import build_tiny_model

    tok = build_char_tokenizer()
    shape = TinyModelConfig(**TINY_4_HEADS)

    def built(seed: int):
        model = build_tiny_model(tok, shape, seed=seed)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optimizer = built(0)
    ids = torch.tensor([tok("12+34", add_special_tokens=False)["input_ids"]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # an AdamW state to save
    state = checkpoint.TrainerState(step=3, data_position=96, world=1, logp_diff_floor=0.25)
    checkpoint.save(tmp_path / "checkpoints", load_config(None, run_overrides(tmp_path)), state, model, optimizer)
    saved_rngs = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())

    fresh, fresh_optimizer = built(1)
    params = list(fresh.parameters())
    assert not torch.equal(params[0], next(model.parameters()))  # precondition: other weights
    torch.manual_seed(99)  # the RNGs move on after the save
    random.seed(99)
    np.random.seed(99)
    folder = checkpoint.checkpoint_paths(tmp_path / "checkpoints", 3)[0]
    assert checkpoint.restore(folder, fresh, fresh_optimizer) == state
    assert all(a is b for a, b in zip(fresh.parameters(), params, strict=True))
    want = model.state_dict()
    assert all(torch.equal(value, want[name]) for name, value in fresh.state_dict().items())
    got_opt, want_opt = fresh_optimizer.state_dict(), optimizer.state_dict()
    assert got_opt["param_groups"] == want_opt["param_groups"] and got_opt["state"].keys() == want_opt["state"].keys()
    for index, per_param in want_opt["state"].items():
        assert all(torch.equal(got_opt["state"][index][key], value) for key, value in per_param.items())
    assert torch.equal(torch.get_rng_state(), saved_rngs[0]) and random.getstate() == saved_rngs[1]
    assert (np.random.get_state()[1] == saved_rngs[2]).all()


def test_a_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import fasttnt.checkpoint as ckpt

    real_save = torch.save
    calls = {"n": 0}

    def dying_save(obj, path, *a, **kw):  # the process dies half-way through the second checkpoint
        calls["n"] += 1
        if calls["n"] == 4:  # 3 files per checkpoint: the 4th write is inside the second one
            raise KeyboardInterrupt("killed during save")
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(ckpt.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, "run", *short_run())
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step-000002"]
    assert (root / "step-000002" / "optimizer.pt").is_file()
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    # resumes from step 2, the half-written folder is discarded
    _, rows = train(tmp_path, "run", *short_run(), resume=True)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [p.name for p in list_checkpoints(root)] == ["step-000002", "step-000004"]
    assert not list(root.glob("*.tmp"))


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    train(tmp_path, "run", *short_run("save_every=1", "keep_checkpoints=2"))  # four saves, two kept
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-000003", "step-000004"]


def test_a_checkpoint_without_numpys_rng_state_is_refused_in_one_line(tmp_path, capsys):
    train(tmp_path, "run", *short_run("steps=2"))
    rng = tmp_path / "run" / "checkpoints" / "step-000002" / "rng.pt"
    state = torch.load(rng, weights_only=True)
    del state["numpy"]
    torch.save(state, rng)
    capsys.readouterr()
    assert (
        cli_main(["train", "--output-dir", str(tmp_path / "run"), "--resume", *run_overrides(tmp_path, "steps=3")]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert "rng.pt holds no numpy RNG state (written by an earlier version)" in err[-1]
    assert err[-1].startswith("fasttnt train: --resume: ")


class _Kill(BaseException):
    """A kill -9 at a filesystem step: nothing after it runs (BaseException: no ``except Exception`` stops it)."""


@contextlib.contextmanager
def _killed_at(n: int):
    """The ``n``-th step that changes the disk (a file written, half of it first; a rename; a deletion; an fsync)
    is where the process dies; ``steps()`` tells how many ran. Deletions and renames are where ``shutil.rmtree`` and
    ``os.replace`` act, so a kill lands inside a folder's removal as well as between whole operations."""
    import io

    count = {"n": 0}

    def step() -> None:
        count["n"] += 1
        if count["n"] == n:
            raise _Kill

    def dying(fn):
        def wrapped(*args, **kwargs):
            step()
            return fn(*args, **kwargs)

        return wrapped

    real_open = io.open

    class HalfWrites:
        def __init__(self, fh) -> None:
            self._fh = fh

        def write(self, data):
            if count["n"] + 1 == n:  # this write is where it dies: half of it reaches the file
                self._fh.write(data[: len(data) // 2])
                self._fh.flush()
            step()
            return self._fh.write(data)

        def __getattr__(self, name):
            return getattr(self._fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._fh.close()

    def opening(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        return HalfWrites(fh) if any(c in mode for c in "wax+") else fh

    with pytest.MonkeyPatch.context() as mp:
        for name in ("replace", "rename", "unlink", "rmdir", "fsync"):
            mp.setattr(os, name, dying(getattr(os, name)))
        mp.setattr(io, "open", opening)
        mp.setattr(builtins, "open", opening)
        yield lambda: count["n"]


def _each_kill(operation) -> int:
    """Run ``operation`` once per step that changes the disk, killed at that step (``_killed_at``), and return the
    number of steps; ``operation(check)`` builds its files, calls ``check`` around the part to kill and asserts."""
    n = 1
    while True:
        killed = {"at": None}

        def under_kill(fn, n=n, killed=killed):
            with _killed_at(n) as steps:
                try:
                    fn()
                except _Kill:
                    killed["at"] = n
                    return
            killed["steps"] = steps()

        operation(under_kill)
        if killed["at"] is None:
            return killed["steps"]
        n += 1


FILES = {"model.safetensors": b"w" * 4096, "optimizer.pt": b"o" * 4096, "trainer_state.json": b"{}"}


def _folder(path, tag: bytes):
    path.mkdir(parents=True)
    for name, data in FILES.items():
        (path / name).write_bytes(tag + data)


def _whole(path) -> bytes | None:
    """The tag of a complete folder (every file, every byte, of one writing), or None."""
    tags = set()
    for name, data in FILES.items():
        content = (path / name).read_bytes() if (path / name).is_file() else b""
        if content[1:] != data:
            return None
        tags.add(content[:1])
    return tags.pop() if len(tags) == 1 else None


def test_a_kill_at_any_point_of_a_checkpoints_commit_leaves_only_whole_checkpoints(tmp_path):
    # step 3 committed with keep=2 (step 1 pruned), killed at each step of the disk: every checkpoint listed is
    # whole, step 2 is always there, and after the clean-up a resume sees steps 2 and 3 or, where the kill came
    # before the commit point, step 2 alone; nothing half-deleted or half-written is listed
    from fasttnt import checkpoint

    outcomes = set()

    def operation(under_kill):
        root = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        _folder(root / "step-000001", b"1")
        _folder(root / "step-000002", b"2")
        final, tmp = checkpoint.checkpoint_paths(root, 3)
        _folder(tmp, b"3")
        under_kill(lambda: checkpoint.commit_checkpoint(root, tmp, final, keep=2))
        for listed in checkpoint.list_checkpoints(root):
            assert _whole(listed) is not None, f"{listed.name} is listed but not whole"
        checkpoint.remove_partial(root)
        names = [p.name for p in checkpoint.list_checkpoints(root)]
        assert names[-2:] in (["step-000001", "step-000002"], ["step-000002", "step-000003"]), names
        assert [p.name for p in root.iterdir() if p.name not in names] == []
        outcomes.add(tuple(names))

    steps = _each_kill(operation)
    assert steps >= 10  # precondition: the kills landed inside the fsyncs, the renames and the pruning's deletions
    assert ("step-000002", "step-000003") in outcomes and ("step-000001", "step-000002", "step-000003") in outcomes


def test_a_kill_at_any_point_of_the_final_export_leaves_the_old_model_or_the_new(tmp_path):
    # final/ replaced by final.tmp/: at every kill, final/ is whole (old or new), or missing with both whole beside it
    # until the next start puts the old one back
    from fasttnt import files

    def operation(under_kill):
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        _folder(out / "final", b"a")
        _folder(out / "final.tmp", b"b")
        under_kill(lambda: files.replace_folder(out / "final.tmp", out / "final"))
        if (out / "final").exists():
            assert _whole(out / "final") in (b"a", b"b")
        else:  # between the renames: the old one aside, whole, and put back at the next start
            assert _whole(out / "final.replaced") == b"a" and _whole(out / "final.tmp") == b"b"
            files.restore_replaced(out / "final")
            assert _whole(out / "final") == b"a"

    assert _each_kill(operation) >= 5


def test_a_kill_while_a_resume_rewrites_the_metrics_leaves_the_old_file_or_the_new(tmp_path):
    from fasttnt.runlog import read_jsonl, truncate_metrics

    rows = [{"step": s, "loss": 0.5 * s} for s in range(1, 41)]
    text = "".join(json.dumps(r) + "\n" for r in rows)

    def operation(under_kill):
        path = tmp_path / f"metrics{len(list(tmp_path.iterdir()))}.jsonl"
        path.write_text(text)
        under_kill(lambda: truncate_metrics(path, 20))
        assert read_jsonl(path) in (rows, rows[:20])

    assert _each_kill(operation) >= 3
