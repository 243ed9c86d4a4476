"""trl_rpp: REINFORCE++ and REINFORCE++-baseline for TRL, with exact, documented numerics."""

from .core import (
    global_masked_normalize,
    group_centered_rewards,
    group_mean_advantages,
    kl_k1,
    kl_k2,
    masked_response_mean,
    reinforce_pp_returns,
    response_mean_k2_loss,
    response_mean_ppo_loss,
    score_centered_ppo_loss,
    score_centering_coefficients,
    score_centering_correction,
)

__version__ = "0.1.0"

__all__ = [
    "global_masked_normalize",
    "group_centered_rewards",
    "group_mean_advantages",
    "kl_k1",
    "kl_k2",
    "masked_response_mean",
    "reinforce_pp_returns",
    "response_mean_k2_loss",
    "response_mean_ppo_loss",
    "score_centered_ppo_loss",
    "score_centering_coefficients",
    "score_centering_correction",
]

from .config import RPPConfig  # noqa: E402
from .trainer import RPPTrainer  # noqa: E402

__all__ += ["RPPConfig", "RPPTrainer"]
