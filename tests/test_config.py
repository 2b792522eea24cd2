"""fasttnt/config.py: loading (the shipped configs, YAML errors), overrides and validation, every error one line
named by its key; one type per concept from the config to the kernel: the loss settings a user writes under
``loss.*`` become the kernel's own ``PolicyLossConfig`` (the very object the fused loss receives), the reward table
under ``reward.*`` the kernel's own ``RewardValues``, each validated once, by the kernel type; what a resume may
change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fasttnt import policy, rewards
from fasttnt.cli import main as cli_main
from fasttnt.config import (
    ConfigError,
    TrainConfig,
    load_config,
    read_config_file,
    to_dict,
    with_overrides,
)
from fasttnt.engines.batch import RolloutBatch
from fasttnt.policy import MicroBatchLossInputs
from fasttnt.rewards import RewardConfig, compute_rewards
from fasttnt_kernels import PolicyLossConfig, PolicyLossInputs, RewardValues, SettingError

ROOT = Path(__file__).resolve().parents[1]


def test_the_loss_section_builds_the_kernels_config():
    cfg = load_config(None, ["loss.clip_high=0.3", "loss.entropy_coef=0.01", "loss.dual_clip=3"])
    settings = PolicyLossConfig.of(cfg.loss)  # how the actor builds it, once per run (fasttnt.actor)
    assert type(settings) is PolicyLossConfig
    assert (settings.clip_high, settings.entropy_coef, settings.dual_clip) == (0.3, 0.01, 3.0)
    assert settings.clip_low == cfg.loss.clip_low and settings.agg == cfg.loss.agg


def test_the_kernel_receives_that_very_object(monkeypatch):
    settings = PolicyLossConfig.of(load_config(None, ["loss.clip_high=0.3"]).loss)
    seen = {}
    real = policy.linear_policy_loss

    def spy(hidden, weight, ids, inputs, **kw):
        seen.update(inputs=inputs, **kw)
        return real(hidden, weight, ids, inputs, **kw)

    monkeypatch.setattr(policy, "linear_policy_loss", spy)
    loss_inputs = MicroBatchLossInputs(advantages=torch.ones(2), cu_seqlens=torch.tensor([0, 1, 3]), settings=settings)
    loss, stats, logp = loss_inputs(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 4, 2]), 1.0)
    assert seen["config"] is settings and seen["inputs"] is loss_inputs
    assert isinstance(loss_inputs, PolicyLossInputs)  # the micro-batch's tensors are the kernel's inputs type
    assert torch.isfinite(loss) and logp.shape == (3,) and set(stats) >= {"clip_frac_high", "entropy"}


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("loss.clip_high=-1", "clip_high"),
        ("loss.clip_low=1", "clip_low"),
        ("loss.dual_clip=0.5", "dual_clip"),
        ("loss.kl_coef=.inf", "kl_coef"),
        ("loss.entropy_coef=-0.1", "entropy_coef"),
        ("loss.agg=seq-mean-token-sum-norm", "norm_length"),
    ],
)
def test_a_bad_loss_setting_is_the_kernels_error_named_by_its_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    # the kernel type's own check and reason, under the key the user wrote
    with pytest.raises(SettingError) as kernel:
        PolicyLossConfig.of(with_overrides(TrainConfig(), [override]).loss)  # parsed, not validated
    assert kernel.value.key == key
    assert str(err.value) == f"loss.{key}: {kernel.value.why}"


def test_the_reward_section_builds_the_kernels_table(monkeypatch):
    cfg = load_config(None, ["reward.over_limit=-3", "reward.direct_margin=0.1"]).reward
    table = cfg.values
    assert type(table) is RewardValues
    assert (table.over_limit, table.direct_correct, table.direct_wrong) == (-3.0, 1.1, 0.1)
    assert RewardConfig().values == RewardValues()  # the table's defaults are the kernel's, declared once
    seen = {}
    real = rewards.tnt_rewards

    def spy(*args, **kw):
        seen.update(kw)
        return real(*args, **kw)

    monkeypatch.setattr(rewards, "tnt_rewards", spy)
    # a 4-token direct answer (</think> = 7 first) and a thinking one with 1 token of solution: limit 2 x 1 = 2
    batch = RolloutBatch.of_packed(torch.tensor([7, 5, 5, 5, 1, 7, 2]), torch.tensor([0, 4, 7]), group_size=2)
    out = compute_rewards(batch, torch.tensor([True, True]), 7, cfg)
    assert type(seen["values"]) is RewardValues and seen["values"] == table
    assert out.rewards.tolist() == [-3.0, 1.0]  # over the limit: the table's over_limit; thinking and right: 1


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["reward.omega=0"], "omega"),
        (["reward.omega=.inf"], "omega"),
        (["reward.fallback_limit=-1"], "fallback_limit"),
        (["reward.scheme=uniform-limit"], "uniform_limit"),
    ],
)
def test_a_bad_reward_limit_is_the_kernels_error_named_by_its_key(overrides, key):
    with pytest.raises(ConfigError, match=f"^reward\\.{key}: must be ") as err:
        load_config(None, overrides)
    assert "got" in str(err.value)  # the kernel's reason, with the value


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["rollout.group_size=eight"], "rollout.group_size: expected an int, got 'eight'"),
        (["rollout.gruop_size=4"], "rollout.gruop_size: unknown key"),
        (["rollout.group_size=1"], "rollout.group_size: 1 sample per prompt has no group std"),
        (["loss.mini_batches=3"], "loss.mini_batches: 3 mini-batches do not divide rollout.prompts_per_step=32"),
        (["data.train=/no/such/file.jsonl"], "data.train: /no/such/file.jsonl does not exist"),
        (["reward.scheme=adaptive"], "reward.scheme: unknown"),
        # VESPO folds per-token weights into each sequence's: no sequence-level correction (TRL's rule), no mode mix
        (
            ["loss.policy_loss=vespo", "loss.rollout_correction=sequence-mask"],
            "loss.policy_loss: vespo takes token-level rollout corrections only, not loss.rollout_correction=sequence-",
        ),
        (
            ["loss.policy_loss=vespo", "rollout.forced_non_thinking=0.5"],
            "loss.policy_loss: vespo folds per-token weights into each sequence's weight, and mode-mixed rollouts",
        ),
        (["--config", "/no/such.yaml"], "--config: /no/such.yaml does not exist"),
        (["steps"], "steps: overrides are key=value"),
        (["model.name=/no/such/model"], "model.name: /no/such/model is not a folder"),
        (["loss.rollout_correction=tokens"], "loss.rollout_correction: 'tokens' is not one of"),
    ],
)
def test_config_errors_name_the_key_and_exit_2(capsys, tmp_path, args, message):
    assert cli_main(["train", "--output-dir", str(tmp_path / "never"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "never").exists(), "nothing may start before the config is valid"


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\nrollout:\n  group_size: [1, 2\n")
    assert cli_main(["train", "--config", str(bad), "--output-dir", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert f"--config: {bad}:4:1: not valid YAML: while parsing a flow sequence" in err and err.count("\n") == 1


def test_shipped_configs_load_and_validate():
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert {p.name for p in configs} >= {
        "tiny.yaml",
        "r1-distill-qwen-1.5b.yaml",
        "deepscaler-1.5b.yaml",
        "r1-distill-qwen-7b.yaml",
    }
    for path in configs:
        load_config(path)
    assert load_config(ROOT / "configs" / "tiny.yaml") == TrainConfig(), "tiny.yaml must be the embedded default"
    real = load_config(ROOT / "configs" / "r1-distill-qwen-1.5b.yaml")
    assert real.rollout.prompts_per_step == 128 and real.optim.lr == 1e-6 and real.loss.kl_coef == 0.0


def test_the_real_configs_name_their_base_and_differ_from_it_only_where_they_say():
    recipe = to_dict(load_config(ROOT / "configs" / "r1-distill-qwen-1.5b.yaml"))
    assert recipe["rollout"]["forced_non_thinking"] == 0.5 and recipe["reward"]["direct_margin"] == 0.05
    for name, differ in {
        "deepscaler-1.5b.yaml": ["model.name"],
        "r1-distill-qwen-7b.yaml": ["distributed.zero_stage", "micro_batch_tokens", "model.name",
                                    "rollout.gpu_memory_utilization"],
    }.items():  # fmt: skip
        assert "base: r1-distill-qwen-1.5b.yaml" in (ROOT / "configs" / name).read_text()
        assert _differing_keys(recipe, to_dict(load_config(ROOT / "configs" / name))) == differ, name


def test_the_rollout_worker_layouts_hold_in_the_worlds_they_name():
    from fasttnt.pipeline.roles import PipelineRanks

    layouts = [("r1-distill-qwen-1.5b-workers.yaml", "r1-distill-qwen-1.5b.yaml", 8, 4),
               ("r1-distill-qwen-7b-workers.yaml", "r1-distill-qwen-7b.yaml", 16, 8)]  # fmt: skip
    for name, base, world, workers in layouts:
        cfg = load_config(ROOT / "configs" / name)
        assert f"base: {base}" in (ROOT / "configs" / name).read_text()
        assert _differing_keys(to_dict(load_config(ROOT / "configs" / base)), to_dict(cfg)) == [
            "rollout.gpu_memory_utilization", "rollout.max_staleness", "rollout.workers"]  # fmt: skip
        # the roles' arithmetic, here where vLLM may not be installed (which PipelineRanks.of refuses, naming the key)
        cfg = load_config(ROOT / "configs" / name, ["rollout.engine=hf"])
        ranks = PipelineRanks.of(cfg, world)
        assert (len(ranks.trainer_ranks), len(ranks.worker_ranks)) == (world - workers, workers)
        assert cfg.rollout.prompts_per_step % (len(ranks.trainer_ranks) * cfg.loss.mini_batches) == 0
    # the 2 + 6 split of one node cannot hold the recipe's batch: refused, naming why
    six = load_config(ROOT / "configs" / layouts[0][0], ["rollout.workers=2", "rollout.engine=hf"])
    with pytest.raises(ConfigError, match=r"leaves 6 trainers, and 6 trainers x loss.mini_batches=4 do not divide"):
        PipelineRanks.of(six, 8)


def _differing_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two configs of the same sections, sorted."""
    keys = []
    for key, value in a.items():
        if isinstance(value, dict):
            keys += _differing_keys(value, b[key], f"{prefix}{key}.")
        elif value != b[key]:
            keys.append(prefix + key)
    return sorted(keys)


def test_a_config_is_laid_over_its_base_section_by_section(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "root.yaml").write_text("steps: 7\nrollout: {group_size: 4, temperature: 0.7}\n")
    (tmp_path / "sub" / "middle.yaml").write_text("base: ../root.yaml\nrollout: {group_size: 6}\nseed: 3\n")
    (tmp_path / "top.yaml").write_text("base: sub/middle.yaml\nrollout: {temperature: 0.9}\n")
    cfg = load_config(tmp_path / "top.yaml", ["seed=5"])
    # each file's own keys over its base's, a section merged key by key; the command line's last
    assert (cfg.steps, cfg.seed, cfg.rollout.group_size, cfg.rollout.temperature) == (7, 5, 6, 0.9)
    assert cfg.rollout.max_new_tokens == TrainConfig().rollout.max_new_tokens  # neither file sets it: the default
    assert "base" not in read_config_file(tmp_path / "top.yaml")


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, r"base: a cycle \(a.yaml -> b.yaml -> a.yaml\)"),
        ({"a.yaml": "base: a.yaml\n"}, r"base: a cycle \(a.yaml -> a.yaml\)"),
        ({"a.yaml": "base: missing.yaml\n"}, r"base: missing.yaml does not exist \(read relative to the file"),
        ({"a.yaml": "base: [b.yaml]\n"}, r"base: must be a file name"),
    ],
)
def test_a_bad_base_is_one_line_naming_the_file(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "a.yaml")


def test_changed_keys_names_what_differs_and_what_only_one_config_has():
    from fasttnt.config import TrainConfig, changed_keys, to_dict

    old, new = to_dict(TrainConfig()), to_dict(TrainConfig())
    assert changed_keys(old, new) == []
    old["rollout"]["group_size"] = 16
    old["steps"] = 7  # safe on resume
    del old["loss"]["rollout_correction_cap"]  # a key the checkpoint's config does not have
    assert changed_keys(old, new) == ["loss.rollout_correction_cap", "rollout.group_size"]


def test_level_weights_need_one_weight_per_level():
    assert load_config(None, ["data.level_weights=[0.7,0.1,0.1,0.1]"]).data.level_weights == (0.7, 0.1, 0.1, 0.1)
    for bad in ("[1,1]", "[1,-1,1,1]", "[0,0,0,0]"):
        with pytest.raises(ConfigError, match=r"data\.level_weights: one weight >= 0 per level of data\.levels"):
            load_config(None, [f"data.level_weights={bad}"])
    with pytest.raises(ConfigError, match=r"warmup\.level_weights: one weight >= 0 per level of warmup\.levels"):
        load_config(None, ["warmup.level_weights=[1]"])
