"""Data-parallel training under DeepSpeed ZeRO on CPU processes (gloo): a 2-rank run logs what a 1-process run
of the same global batch logs, with ZeRO-2 and ZeRO-3, through the deepspeed launcher and torchrun; resume with
the same ranks; a failing rank ends the job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import varied
from support.small import SMALL as SMALL_BASE
from support.small import free_port, launch_command, metric_rows, run_job, weights_apart

from fasttnt.step_metrics import RANK_METRICS

pytest.importorskip("deepspeed")

# rewards that vary by construction (support/varied.py, run as the launched module), and the entropy bonus: every step
# has a gradient, so ranks that diverged in the update would show
# tied embeddings (the embedded default unties them): the case ZeRO-2's contiguous gradients got wrong (distributed.py)
SMALL = [*SMALL_BASE, varied.OVERRIDE, "steps=3", "save_every=2", "optim.lr=1e-2", "loss.entropy_coef=0.01",
         "model.tiny.tie_word_embeddings=true"]  # fmt: skip
# A hang guard for every launched job: each takes under a minute on 2 idle cores, and over 240 s was measured beside
# five other jobs on those cores; a job that hangs still fails, after HANG_S, its ranks killed with it (run_job)
HANG_S = 600
# DeepSpeed sees no accelerator here and picks its CPU one; keep its launcher from probing for GPUs
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": varied.PYTHONPATH}


def _launch(
    launcher: str, out: Path, cache: Path, *extra: str, resume: bool = False, ranks: int = 2
) -> subprocess.CompletedProcess:
    args = ["train", "--output-dir", str(out), *(["--resume"] if resume else []), f"cache_dir={cache}", *SMALL, *extra]
    return run_job(launch_command(launcher, varied.MODULE, *args, ranks=ranks), env=ENV, timeout=HANG_S)


KEYS = ("loss", "grad_norm", "reward", "acc", "len", "non_thinking_ratio", "entropy", "kl", "clip_frac")


def _assert_same_run(a: list[dict], b: list[dict]) -> None:
    """Every logged value of each step alike. Ranks sum the same float32 terms in another order (~1e-7 relative per
    reduction, a few reductions deep), and the samples and rewards are the same by construction: 1e-4 relative is
    1000x that rounding, while a rank on other data or weights changes rewards and losses in the leading digits."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        for key in KEYS:
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key, ra[key], rb[key])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    result = _launch("single", root / "single", root / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    return root, metric_rows(root / "single")


# each launcher and each ZeRO stage once: the launchers differ in how a rank learns its place (the deepspeed
# launcher's --local_rank against torchrun's environment), the stages in what the ranks hold, and neither depends on
# the other; the other two pairs match one process below (the deepspeed launcher at ZeRO-3 with uneven micro-batch
# counts, torchrun at ZeRO-2 with mode-mixed groups)
@pytest.mark.parametrize(("launcher", "stage"), [("deepspeed", 2), ("torchrun", 3)])
def test_two_ranks_match_one_process(single, launcher, stage):
    root, expected = single
    out = root / f"{launcher}-zero{stage}"
    result = _launch(launcher, out, root / "cache", f"distributed.zero_stage={stage}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert all(r["grad_norm"] > 0 for r in expected), "a step without a gradient: the comparison would be vacuous"
    _assert_same_run(metric_rows(out), expected)
    _assert_same_weights(out / "final", root / "single" / "final", root / "cache")


def _assert_same_weights(ours: Path, theirs: Path, cache: Path) -> None:
    """The ranks' final weights against one process's, relative to how far training moved them from the warm-up.
    Two ranks sum the same gradients in another order: float32 rounding, ~2^-24 sqrt(terms) of each element's
    magnitude, which AdamW's normalised step passes on as the same relative error of the step (its m / sqrt(v) is
    invariant to the gradient's scale): 7e-7 of the movement after these three steps on a 2-core x86 machine. A rank
    that stepped on its own half of the batch, or averaged wrong, is off by a whole step's worth (~ the movement
    itself). A bound of 1e-4 sits 100x above the rounding and 1000x under a divergence, whatever the machine's
    summation order (an elementwise bound of 1e-5 failed on another CPU at 1.06e-5)."""
    from safetensors.torch import load_file

    (start_dir,) = cache.glob("tiny-warmup-*")  # the warm-up both runs started from
    start, a, b = (load_file(d / "model.safetensors") for d in (start_dir, ours, theirs))
    diff, moved = weights_apart(a, b, start)
    assert moved > 0, "training did not move the weights: the comparison would be vacuous"
    assert diff <= 1e-4 * moved, f"the final weights differ by {diff / moved:.2e} of the distance training moved them"


def test_a_mode_mixed_run_on_two_ranks_matches_one_process(tmp_path):
    # forced rows of both modes, the decoupled choice and the settled-choice floor measured at step 1 as the smallest
    # pi(</think>) over every rank's groups: the ranks log the one process's choice metrics, per level too, and keep
    # its floor
    mixed = ("rollout.forced_non_thinking=0.5", "rollout.forced_thinking=0.25")
    runs = {name: tmp_path / name for name in ("single", "torchrun")}
    for launcher, out in runs.items():
        result = _launch(launcher, out, tmp_path / "cache", *mixed)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    one, two = (metric_rows(out) for out in runs.values())
    _assert_same_run(two, one)
    prefixes = ("think_end_prob", "reward_direct", "reward_thinking", "prefers_direct", "mode_floored",
                "free_non_thinking_ratio")  # fmt: skip
    for ra, rb in zip(two, one, strict=True):
        # the same levels present, the same modes at each; and the ranks' own numbers (docs/metrics.md, Ranks)
        assert set(ra) - set(rb) == {*RANK_METRICS, "rank_tokens_0", "rank_tokens_1"} and set(rb) <= set(ra)
        choice = [k for k in rb if k.startswith(prefixes)]
        assert any(k.startswith("reward_direct_l") for k in choice) and "mode_floored" in choice  # precondition
        assert any(k.startswith("mode_floored_l") for k in choice)
        for key in choice:
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-12), (ra["step"], key)
    states = [out / "checkpoints" / "step-000002" / "trainer_state.json" for out in runs.values()]
    floors = [json.loads(state.read_text())["mode_token_floor_logp"] for state in states]
    assert floors[0] is not None and floors[0] == pytest.approx(floors[1], abs=1e-5)


def test_zero3_trainers_beside_rollout_workers_match_one_process(single):
    # 4 processes, 2 trainers under ZeRO-3 and 2 rollout workers, on-policy: each worker generates 2 of each step's 4
    # prompts (the colocated rank's share, with its seeds) with the weights the trainers gathered bucket by bucket and
    # pushed to both, each trainer trains on 2 prompts' groups, and the run logs what one process generating between
    # its updates logs
    root, expected = single
    out = root / "zero3-workers"
    result = _launch("torchrun", out, root / "cache", "distributed.zero_stage=3", "rollout.workers=2", ranks=4)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = metric_rows(out)
    assert [(r["weight_version"], r["staleness"]) for r in rows] == [(0, 0), (1, 0), (2, 0)], "each push taken"
    assert all(r["rollout_logp_diff"] < 1e-6 for r in rows), "the worker sampled from the trainers' weights"
    # the trainers' shares are the step, each response once (the tokens they count add up to its 16 responses')
    responses = 16
    for r in rows:
        assert r["generated_tokens_per_s"] * r["worker_time_generate"] == pytest.approx(r["len"] * responses, rel=1e-6)
    _assert_same_run(rows, expected)
    _assert_same_weights(out / "final", root / "single" / "final", root / "cache")


def test_resume_with_the_same_ranks(single):
    root, expected = single
    out = root / "resumed"
    first = _launch("deepspeed", out, root / "cache", "steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "checkpoints" / "step-000002" / "deepspeed").is_dir()  # the ranks' optimizer shards
    again = _launch("deepspeed", out, root / "cache", resume=True)
    assert again.returncode == 0, again.stderr[-3000:]
    _assert_same_run(metric_rows(out), expected)


def test_the_rank_helpers_over_a_world_of_one(tmp_path):
    # the collectives themselves (gloo, one rank) and the single-process path (no process group) give the same:
    # over one rank a sum, a maximum and an any are the identity
    import torch
    import torch.distributed as dist

    from fasttnt import distributed

    values = {"tokens": torch.tensor(12.0), "seqs": torch.tensor(3.0)}
    t = torch.tensor([1.5, -2.0])
    assert distributed.sum_over_ranks(None, t) is t
    assert distributed.max_over_ranks(None, 5) == 5
    assert distributed.any_over_ranks(None, True, False) == (True, False)
    assert distributed.sum_named_over_ranks(None, values) == values
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ctx = distributed.DistContext(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
        summed = distributed.sum_over_ranks(ctx, t)
        assert summed is not t and torch.equal(summed, t)  # a copy: the caller's tensor is not reduced in place
        assert distributed.max_over_ranks(ctx, 5) == 5
        assert distributed.any_over_ranks(ctx, True, False) == (True, False)
        assert distributed.any_over_ranks(ctx, False) == (False,)
        named = distributed.sum_named_over_ranks(ctx, values)
        assert list(named) == list(values) and all(torch.equal(named[k], values[k]) for k in values)
    finally:
        dist.destroy_process_group()


RANK_HELPERS = """
import sys
import torch
from fasttnt import distributed

def main():
    ctx = distributed.init("cpu")
    r = ctx.rank  # rank 0 and rank 1 hold different values: a helper that skips its collective returns its own
    got = {
        "max": distributed.max_over_ranks(ctx, 3 + 9 * r),
        "min": distributed.min_over_ranks(ctx, torch.tensor([5.0, 2.0 - r])),
        "any": distributed.any_over_ranks(ctx, r == 1, False),
        "sum": distributed.sum_over_ranks(ctx, torch.tensor([1.0 + r, 10.0 * r])).tolist(),
        "named": {k: float(v) for k, v in distributed.sum_named_over_ranks(
            ctx, {"tokens": torch.tensor(4.0 + r), "seqs": torch.tensor(1.0)}).items()},
    }
    want = {"max": 12, "min": 1.0, "any": (True, False), "sum": [3.0, 10.0], "named": {"tokens": 9.0, "seqs": 2.0}}
    if got != want:
        raise AssertionError(f"rank {r}: {got} != {want}")
    print(f"rank {r} combined both ranks' values", flush=True)
    distributed.shutdown()
    return 0

sys.exit(distributed.fail_fast(main))
"""


def test_the_rank_helpers_combine_both_ranks_values(tmp_path):
    # each rank holds its own values, so a helper that skipped its collective (or reduced the wrong way) is an
    # error in seconds here, not a ZeRO-3 job whose ranks wait for each other's gathers until the hang guard
    script = tmp_path / "helpers.py"
    script.write_text(RANK_HELPERS)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    result = run_job([*torchrun, "--master-port", str(free_port()), str(script)], env=ENV, timeout=HANG_S)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert all(f"rank {r} combined both ranks' values" in result.stdout for r in (0, 1))


FAILING = """
import sys
from fasttnt import distributed

def main():
    ctx = distributed.init("cpu")
    if ctx.rank == 1:
        raise RuntimeError("rank 1 cannot read its shard")
    distributed.barrier()  # rank 0 waits here for a rank that is gone
    return 0

sys.exit(distributed.fail_fast(main))
"""


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_a_failing_rank_ends_the_job(tmp_path, launcher):
    script = tmp_path / "fails.py"
    script.write_text(FAILING)
    if launcher == "deepspeed":
        cmd = [shutil.which("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(script)]
    else:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd = [*torchrun, "--master-port", str(free_port()), str(script)]
    result = run_job(cmd, env=ENV, timeout=HANG_S)  # a hang fails here
    assert result.returncode != 0
    assert "rank 1 cannot read its shard" in result.stdout + result.stderr


UNEVEN_GENERATION = """
import torch, deepspeed
from transformers import Qwen2Config, Qwen2ForCausalLM
from fasttnt import distributed
from fasttnt.config import TrainConfig
from fasttnt.attention import Packing
from fasttnt.policy import PolicyHead

ctx = distributed.init("cpu")
torch.manual_seed(0)
config = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1)
model = Qwen2ForCausalLM(config)
cfg = TrainConfig()
cfg = type(cfg)(**{**cfg.__dict__, "distributed": type(cfg.distributed)(zero_stage=3)})
engine, _, _, _ = deepspeed.initialize(model=PolicyHead(model), optimizer=torch.optim.AdamW(model.parameters()),
                                       config=distributed.deepspeed_config(cfg, ctx.world))
ids = torch.randint(4, 50, (2, 5))
n = 3 if ctx.rank == 0 else 12  # ranks stop after different numbers of tokens, as real responses do
for _ in range(2):
    with distributed.zero3_full_model(engine, model):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0, eos_token_id=2)
    row = ids.reshape(1, 10)  # the two sequences packed back to back
    positions = torch.arange(5).repeat(2)[None]
    loss = engine(row, positions, Packing.of([5, 5], "cpu"), torch.tensor([3, 8]), ids[:, 4], 1.0, False)[0].sum()
    engine.backward(loss)
    engine.step()  # training still works with ZeRO's hooks back
print(f"rank {ctx.rank} generated {out.shape[1] - 5}", flush=True)
distributed.shutdown()
distributed.exit_process(0)  # as the CLI ends a rank: no interpreter teardown of ZeRO-3's native threads
"""


def test_zero3_generation_with_uneven_lengths_does_not_hang(tmp_path):
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN_GENERATION)
    cmd = [shutil.which("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(script)]
    result = run_job(cmd, env=ENV, timeout=HANG_S)  # a hang fails here
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 generated 3" in result.stdout and "rank 1 generated 12" in result.stdout


def test_ranks_dealt_their_groups_by_work_match_one_process(tmp_path):
    # four problems per step, each rank drawing two: a ~200-token prompt (under the tiny model's 256 positions less
    # 24 new tokens) whose 4 samples need a micro-batch of 256 each (two never fit), and three short ones. However
    # the stream orders them, the long group outweighs the three short ones together (4 x 200 tokens against at
    # most 3 x 4 x (10 + 24)), so Karmarkar-Karp deals it to
    # a rank alone and every step moves a group (fasttnt.balance): the ranks then run different micro-batch counts
    # (the one with the long group 4 per pass), and under ZeRO-3 the other pads with dummy forwards; ppo_epochs=2
    # adds the old-log-prob pass and its rows travel too. At ZeRO-2 and ZeRO-3 the run logs what one process logs
    data = tmp_path / "uneven.jsonl"
    long_problem = "Add these two numbers, reading every digit with care before you begin: " + "1" * 120 + " + 1"
    problems = [("1+2", "3"), (long_problem, "2"), ("2+2", "4"), ("3+4", "7")]
    data.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in problems))
    extra = (
        f"data.train={data}", "data.hack_markers=synthetic", "data.instruction=", "micro_batch_tokens=256",
        "loss.ppo_epochs=2", "steps=2", "loss.skip_zero_advantage=false",
    )  # fmt: skip
    single = _launch("single", tmp_path / "single", tmp_path / "cache", *extra)
    assert single.returncode == 0, single.stderr[-3000:]
    expected = metric_rows(tmp_path / "single")
    for stage, balance in ((2, True), (3, True), (3, False)):  # and ZeRO-3 with the deal off: the rows as drawn
        out = tmp_path / f"zero{stage}-{balance}"
        ranks = _launch("deepspeed", out, tmp_path / "cache", *extra, f"distributed.zero_stage={stage}",
                        f"distributed.balance_ranks={str(balance).lower()}")  # fmt: skip
        assert ranks.returncode == 0, ranks.stdout[-2000:] + ranks.stderr[-4000:]
        got = metric_rows(out)
        if balance:
            assert all(r["moved_groups"] >= 1 for r in got), "precondition: the deal moved a group every step"
            assert all(r["rank_tokens_max_over_mean"] < r["rank_tokens_max_over_mean_drawn"] for r in got)
        else:
            assert all(r["moved_groups"] == 0 for r in got)
            assert all(r["rank_tokens_max_over_mean"] == r["rank_tokens_max_over_mean_drawn"] > 1 for r in got)
        assert all(r["time_rank_wait"] >= 0 for r in got)
        _assert_same_run(got, expected)
        _assert_same_weights(out / "final", tmp_path / "single" / "final", tmp_path / "cache")


def test_dynamic_sampling_keeps_the_ranks_in_step(tmp_path):
    # each rank fills its own share of groups whose rewards differ; a rank that has enough draws again while another
    # is short, so both run the same draws (and the same ZeRO collectives after them) and read the same prompts
    from fasttnt.checkpoint import read_trainer_state

    extra = ("rollout.dynamic_sampling=true", "rollout.max_draws=3", "steps=2", "save_every=2")
    result = _launch("torchrun", tmp_path / "ranks", tmp_path / "cache", *extra)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = metric_rows(tmp_path / "ranks")
    # each rank's share of a draw (2 prompts) holds one group whose rewards differ (support/varied.py): both need a
    # second draw, and then have enough
    assert [(r["step"], r["draws"], r["filled_groups"]) for r in rows] == [(1, 2, 0), (2, 2, 0)]
    state = read_trainer_state(tmp_path / "ranks" / "checkpoints" / "step-000002")
    assert state.data_position == 4 * sum(r["draws"] for r in rows)  # 4 prompts a draw (support/small.py)


AUTOCAST_INSIDE_DEEPSPEED = """
import sys, torch, varied
from fasttnt import distributed
from fasttnt.config import load_config
from fasttnt.trainer import Trainer

# DeepSpeed 0.19 asks torch.is_autocast_enabled() with no device, which means CUDA's autocast: on a GPU it sees the
# trainer's outer autocast and (without a torch_autocast section) turns it off inside engine.forward. Here the
# question is put for the device DeepSpeed runs on, the CPU, so the CUDA path of autocast_if_enabled is the one taken
from deepspeed.accelerator import get_accelerator
_enabled = torch.is_autocast_enabled
torch.is_autocast_enabled = lambda device_type=None: _enabled(device_type or get_accelerator().device_name())

def main():
    varied.register()
    out, *overrides = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher's own
    trainer = Trainer(load_config(None, overrides), out, progress=False)
    seen = set()  # the dtypes of the linear layers' outputs in the forwards that train (gradients on)
    def hook(module, args, out):
        if torch.is_grad_enabled():
            seen.add(str(out.dtype))
    for m in trainer.parts.model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(hook)
    trainer.step()
    policy = type(trainer.actor.policy).__name__
    print(f"rank {trainer.parts.rank} trained in {sorted(seen)} through {policy}", flush=True)
    trainer.verifier.close()
    distributed.shutdown()
    return 0

sys.exit(distributed.fail_fast(main))
"""


def test_bf16_autocast_reaches_the_forward_inside_deepspeeds_engine(tmp_path):
    # DeepSpeed 0.19's engine switches an outer autocast off inside its forward unless its config has a torch_autocast
    # section: the update then trained in float32. model.dtype=bfloat16 turns bf16 autocast on here, on the CPU
    script = tmp_path / "autocast.py"
    script.write_text(AUTOCAST_INSIDE_DEEPSPEED)
    args = [str(tmp_path / "run"), f"cache_dir={tmp_path / 'cache'}", *SMALL, "model.dtype=bfloat16"]
    cmd = [shutil.which("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(script), *args]
    result = run_job(cmd, env=ENV, timeout=HANG_S)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} trained in ['torch.bfloat16'] through DeepSpeedEngine" in result.stdout, result.stdout[
            -2000:
        ]


class _Payload:
    """What a hostile shard could carry: unpickling it in full creates ``marker`` (a stand-in for any code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture
def world_of_one(tmp_path_factory):
    """A gloo process group of one rank in this process (DeepSpeed's engine wants one), torn down after the test."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("store") / "store"
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _ds_engine(stage: int, seed: int):
    """A two-layer model under fasttnt's DeepSpeed config at ``stage``, with AdamW state from one step."""
    from types import SimpleNamespace

    import deepspeed
    import torch

    from fasttnt.distributed import deepspeed_config

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zero = SimpleNamespace(zero_stage=stage, bucket_size=10**6)
    cfg = SimpleNamespace(optim=SimpleNamespace(grad_clip=1.0), distributed=zero)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg, 1))
    engine.backward(engine(torch.randn(3, 4)).square().sum())
    engine.step()
    return engine


def _adam_moments(engine) -> list:
    import torch

    state = engine.optimizer.optimizer.state  # the wrapped AdamW's, over this rank's float32 partitions
    return [torch.cat([s["exp_avg"].flatten(), s["exp_avg_sq"].flatten()]) for s in state.values()]


def test_a_deepspeed_resume_reads_every_shard_weights_only(world_of_one, tmp_path):
    # at ZeRO-2 and ZeRO-3 (one test: DeepSpeed keeps its groups for the life of the process group), fasttnt's
    # DeepSpeed load puts back what DeepSpeed saved (the optimizer's moments), every file read weights-only; then
    # each shard in turn given a __reduce__ payload: refused with its name, the payload never run
    import torch

    from fasttnt import checkpoint

    for stage in (2, 3):
        folder = tmp_path / f"zero{stage}"
        saved = _ds_engine(stage, seed=0)
        saved.save_checkpoint(str(folder), tag="deepspeed")
        fresh = _ds_engine(stage, seed=1)
        assert not all(torch.equal(a, b) for a, b in zip(_adam_moments(fresh), _adam_moments(saved), strict=True))
        checkpoint.load_deepspeed_state(folder, fresh)
        assert all(torch.equal(a, b) for a, b in zip(_adam_moments(fresh), _adam_moments(saved), strict=True))
        assert "load" not in vars(fresh.checkpoint_engine)  # DeepSpeed's own load is back once the resume is over

        shards = sorted((folder / "deepspeed").glob("*.pt"))
        assert len(shards) == 2, shards  # the model states and the optimizer states
        for shard in shards:
            marker = tmp_path / f"ran-{stage}-{shard.stem}"
            original = shard.read_bytes()
            content = torch.load(shard, weights_only=False)
            content["extra"] = _Payload(marker)
            torch.save(content, shard)
            torch.load(shard, weights_only=False)  # precondition: a full unpickle runs the payload
            assert marker.exists()
            marker.unlink()
            with pytest.raises(checkpoint.ResumeError, match=f"{shard}.*refused unread"):
                checkpoint.load_deepspeed_state(folder, refusing := _ds_engine(stage, seed=1))
            assert not marker.exists()
            assert "load" not in vars(refusing.checkpoint_engine)  # DeepSpeed's own load back after a refusal too
            shard.write_bytes(original)
