"""The TNT reward inside verl's own trainer (read and tested against verl 0.9.1): a V1 trainer registered as
``fasttnt`` (``trainer.v1.trainer_mode=fasttnt``) that re-scores each step's batch with the TNT reward, grouping the
responses by verl's ``uid``, before verl computes the advantages.

Why a trainer: verl 0.9.1 scores each response alone (its reward loop calls ``RewardManagerBase.run_single`` one row
at a time, ``verl/experimental/reward_loop/reward_loop.py``), while a TNT reward needs a query's K responses together
(the limit of a non-thinking response comes from its group's thinking ones). The batch that reaches
``PPOTrainer._compute_advantage`` (``verl/trainer/ppo/v1/trainer_base.py``) holds whole groups; replacing its
``rm_scores`` in TransferQueue there makes the advantages, the KL-in-reward, the ``critic/score`` metrics and the
rollout dumps all see the TNT reward. verl's padding rows (tag ``is_padding``, their own uid) are left alone.

    python -m verl.trainer.main_ppo trainer.v1.trainer_mode=fasttnt algorithm.adv_estimator=grpo \\
        reward.custom_reward_function.path=pkg://fasttnt.integrations.verl \\
        reward.custom_reward_function.name=compute_score  +reward.fasttnt.omega=2.0 ...

The per-response reward loop still runs during rollout (validation reports its scores): ``compute_score`` gives it
the verifier's verdict, under the trainer's timeout. ``+reward.fasttnt.<field>`` sets the reward
(``fasttnt.rewards.RewardConfig``: the scheme, any registered one, omega, the reward values; ``overlong_buffer``
counts back from ``data.max_response_length``). Not with ``algorithm.filter_groups`` (DAPO): verl filters on the
per-response scores, before this trainer re-scores them.
The sync trainer only.

Importing this module imports verl's V1 trainer (it needs TransferQueue: the ``verl`` extra installs it) and
registers the trainer: verl imports it through the ``verl.plugins`` entry point ``fasttnt_trainer``.
"""

from __future__ import annotations

import numpy as np
import torch
import transfer_queue as tq
from tensordict import TensorDict
from verl import DataProto
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from ..rewards import RewardConfig
from .verl import TNTRewardManager

NAME = "fasttnt"
FIELDS = ["uid", "prompts", "responses", "reward_model"]


def _padded(rows: list[torch.Tensor], value: int, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) rows and their (B, T) mask, T the longest row or ``width`` if wider."""
    lengths = torch.tensor([len(r) for r in rows])
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)
    padded = torch.nn.functional.pad(padded, (0, max(width - padded.shape[1], 0)), value=value)
    return padded, (torch.arange(padded.shape[1])[None, :] < lengths[:, None]).long()


def _objects(items: list) -> np.ndarray:
    """A 1-D object array of the items (``np.array`` would make a 2-D one of a list of lists)."""
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def tnt_rm_scores(
    data: TensorDict, manager: TNTRewardManager, pad_token_id: int, response_budget: int | None = None
) -> tuple[list[torch.Tensor], dict]:
    """The TNT reward of TransferQueue's rows (fields ``uid``, ``prompts``, ``responses``, ``reward_model``; the
    tensors per row, jagged): one float tensor per row as long as its response, the reward at its last token (verl's
    ``rm_scores`` layout), and the manager's per-row extras. The ``DataProto`` is laid out as verl's colocated reward
    path makes it (``_compute_reward_colocate``: prompts and responses right-padded, the attention mask both), the
    responses to ``response_budget`` (``data.max_response_length``), from which the overlong shaping counts back."""
    if manager.config.overlong_buffer > 0 and response_budget is None:
        raise ValueError("reward.fasttnt.overlong_buffer > 0 needs the response budget: set data.max_response_length")
    prompts, prompt_mask = _padded(list(data["prompts"].unbind(0)), pad_token_id)
    responses, response_mask = _padded(list(data["responses"].unbind(0)), pad_token_id, response_budget or 0)
    batch = DataProto(
        batch=TensorDict(
            {"prompts": prompts, "responses": responses, "attention_mask": torch.cat([prompt_mask, response_mask], 1)},
            batch_size=len(prompts),
        ),
        non_tensor_batch={
            "uid": _objects([str(u) for u in list(data["uid"])]),
            "reward_model": _objects(list(data["reward_model"])),
        },
    )
    out = manager(batch, return_dict=True)
    scores, lengths = out["reward_tensor"], response_mask.sum(1).tolist()  # (B, T), (B,)
    return [scores[i, :n].clone() for i, n in enumerate(lengths)], out["reward_extra_info"]


def rescore(
    batch, manager: TNTRewardManager, pad_token_id: int, metrics: dict | None = None, response_budget: int | None = None
) -> None:
    """Replace the ``rm_scores`` of a V1 batch (TransferQueue's ``KVBatchMeta``) with the TNT reward, in place
    (``response_budget``: verl's ``data.max_response_length``, ``tnt_rm_scores``)."""
    keys = [key for key, tag in zip(batch.keys, batch.tags, strict=True) if not tag.get("is_padding", False)]
    if not keys:
        return
    several = [key for key in keys if key.rsplit("_", 1)[-1] != "0"]  # keys are {uid}_{session}_{output}
    if several:
        raise ValueError(f"the TNT reward takes one output per session; the batch has {several[:3]}")
    data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=FIELDS)
    rows, extra = tnt_rm_scores(data, manager, pad_token_id, response_budget)
    scores = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    tq.kv_batch_put(keys=keys, partition_id=batch.partition_id,
                    fields=TensorDict({"rm_scores": scores}, batch_size=len(keys)))  # fmt: skip
    if metrics is not None:
        metrics["fasttnt/correct_mean"] = float(np.mean(extra["correct"]))
        metrics["fasttnt/reward_mean"] = float(torch.stack([r.sum() for r in rows]).mean())


def reward_config(config) -> RewardConfig:
    """``reward.fasttnt`` of verl's config (absent: TNT's defaults) as a ``RewardConfig``."""
    reward = config.get("reward", {}) if hasattr(config, "get") else {}
    options = dict(reward.get("fasttnt", {}) or {})
    unknown = set(options) - set(RewardConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"reward.fasttnt: unknown keys {sorted(unknown)}; fields of fasttnt.rewards.RewardConfig")
    return RewardConfig(**options)


class TNTTrainer(PPOTrainerSync):
    """verl's sync V1 trainer with the TNT reward computed over whole groups (by uid) before the advantages."""

    def _build_replay_buffer(self):
        # verl's PPOTrainer compares its mode with the string "sync" (trainer_base.py): under this trainer's own
        # name it would take the asynchronous replay buffer and checkpointing
        self.trainer_mode = "sync"
        return super()._build_replay_buffer()

    def _compute_advantage(self, batch, metrics):
        if getattr(self, "_tnt", None) is None:
            self._tnt = TNTRewardManager(self.tokenizer, config=reward_config(self.config))
        budget = self.config.get("data", {}).get("max_response_length")
        rescore(batch, self._tnt, self.tokenizer.pad_token_id, metrics, budget)
        return super()._compute_advantage(batch, metrics)


if TRAINER_REGISTRY.get(NAME) is not TNTTrainer:  # verl refuses a second class under one name
    register_trainer(NAME)(TNTTrainer)
