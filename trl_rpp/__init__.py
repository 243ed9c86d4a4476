"""trl_rpp: REINFORCE++ and REINFORCE++-baseline for TRL, with exact, documented numerics.

The math (`trl_rpp.core`, `trl_rpp.score_centering`) needs torch only. `RPPConfig` and `RPPTrainer` import TRL and
transformers, so they are loaded on first access: `import trl_rpp.core` stays light.
"""

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
)
from .score_centering import (
    sampled_and_head_logps,
    score_centered_ppo_loss,
    score_centering_coefficients,
    score_centering_correction,
)

__version__ = "0.1.0"

_LAZY = {"RPPConfig": ".config", "RPPTrainer": ".trainer"}

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
    "sampled_and_head_logps",
    "score_centered_ppo_loss",
    "score_centering_coefficients",
    "score_centering_correction",
    *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
