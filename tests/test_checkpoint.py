"""fasttnt/checkpoint.py: restore puts back what save wrote (weights, AdamW state, RNGs, trainer state); a crash
while saving keeps the previous checkpoint; only the newest are kept; a checkpoint without numpy's RNG state is
refused in one line."""

from __future__ import annotations

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
