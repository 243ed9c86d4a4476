"""trl_rpp: REINFORCE++ and REINFORCE++-baseline for TRL, with exact, documented numerics.

The layout, by layer; a module imports only its own layer and those under it (tests/test_layout.py):

1. pure tensor functions, torch only: `core` (REINFORCE++), `score_centering`, `truncation`, `lm_head`;
2. `patches`: every touch of another library's internals, with the versions it was written against;
3. `records`: the sampler's records (the capture inside `generate`, vLLM's log-probs, multi-turn alignment, the
   replay and the head reader);
4. `faults` (rewards, checkpoints, preemption, gradients, the engine, inputs) and `engines` (vLLM weight sync);
5. on top: `config`, `trainer` (the hook map), `batch`, `metrics`, `distributed`, `cli`, `model_card`.

The math needs torch only; `RPPConfig` and `RPPTrainer` import TRL and transformers. Each name is loaded on first
access, so `import trl_rpp` imports none of them (`trl-rpp --help` does not wait for torch) and `import trl_rpp.core`
stays light.
"""

__version__ = "0.1.0"

_CORE = ("global_masked_normalize", "group_centered_rewards", "group_mean_advantages", "kl_k1", "kl_k2",
         "masked_response_mean", "reinforce_pp_returns", "response_mean_k2_loss", "response_mean_ppo_loss")
_SCORE_CENTERING = ("score_centered_ppo_loss", "score_centering_coefficients", "score_centering_correction")
_LAZY = {**dict.fromkeys(_CORE, ".core"), **dict.fromkeys(_SCORE_CENTERING, ".score_centering"),
         "RPPConfig": ".config", "RPPTrainer": ".trainer"}

__all__ = [*_LAZY]


def __getattr__(name):
    import importlib

    if name in ("core", "score_centering"):  # `trl_rpp.core`'s names work after a bare `import trl_rpp`
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
