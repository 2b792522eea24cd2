"""fasttnt_kernels: Triton kernels for GRPO with the TNT reward.

Every op has a plain-PyTorch ``*_reference`` beside it that defines its semantics. The policy-loss ops take their
settings as one ``PolicyLossConfig`` (and the fused one its tensors as one ``PolicyLossInputs``), validated where
it is made; an out-of-range setting raises ``SettingError``, which names it. The public functions pick the
Triton kernels for CUDA tensors and the reference elsewhere; ``FASTTNT_KERNELS=triton|torch`` forces either
(with ``TRITON_INTERPRET=1`` set before import, the Triton path runs on CPU tensors).
"""

from ._common import SettingError
from ._policy_loss import PolicyLossConfig, PolicyLossInputs, sequence_log_ratios, vespo_weights
from .clipped_policy_loss import STAT_NAMES, clipped_policy_loss, clipped_policy_loss_reference
from .group_advantages import group_advantages, group_advantages_reference
from .linear_policy_loss import LINEAR_STAT_NAMES, linear_policy_loss, linear_policy_loss_reference
from .linear_token_logprobs import linear_token_logprobs, linear_token_logprobs_reference
from .mode_advantages import ModeAdvantages, mode_advantages, mode_advantages_reference
from .rollout_correction_weights import (
    ROLLOUT_CORRECTIONS,
    rollout_correction_weights,
    rollout_correction_weights_reference,
)
from .tnt_rewards import (
    SCHEMES,
    RewardValues,
    TntRewards,
    check_reward_limits,
    tnt_rewards,
    tnt_rewards_reference,
)
from .token_logprobs import token_logprobs, token_logprobs_reference

__version__ = "0.1.0"

__all__ = [
    "LINEAR_STAT_NAMES",
    "ROLLOUT_CORRECTIONS",
    "SCHEMES",
    "STAT_NAMES",
    "ModeAdvantages",
    "PolicyLossConfig",
    "PolicyLossInputs",
    "RewardValues",
    "SettingError",
    "TntRewards",
    "check_reward_limits",
    "clipped_policy_loss",
    "clipped_policy_loss_reference",
    "group_advantages",
    "group_advantages_reference",
    "linear_policy_loss",
    "linear_policy_loss_reference",
    "linear_token_logprobs",
    "linear_token_logprobs_reference",
    "mode_advantages",
    "mode_advantages_reference",
    "rollout_correction_weights",
    "rollout_correction_weights_reference",
    "sequence_log_ratios",
    "tnt_rewards",
    "tnt_rewards_reference",
    "token_logprobs",
    "token_logprobs_reference",
    "vespo_weights",
]
