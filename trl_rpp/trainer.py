"""`RPPTrainer`: REINFORCE++ and REINFORCE++-baseline as a thin subclass of `trl.GRPOTrainer`."""

from __future__ import annotations

import os
import warnings

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.models.utils import disable_gradient_checkpointing

from .checkpoint import buffer_needed, check_resumable, load_generation_buffer, save_generation_buffer
from .config import RPPConfig
from .core import (
    global_masked_normalize,
    group_centered_rewards,
    kl_k1,
    masked_response_mean,
    reinforce_pp_returns,
    response_mean_k2_loss,
    response_mean_ppo_loss,
    score_centered_ppo_loss,
    score_centering_coefficients,
)
from .distributed import check_normalization_group
from .model_card import REINFORCE_PP_PAPER, build_model_card
from .rewards import check_dataset_not_empty, check_module_rewards, check_prompt_column, guard_reward_func
from .sampling import (
    SamplerTopKCapture,
    capturing_generate,
    check_exact_sampling,
    parse_vllm_topk,
    vllm_max_logprobs,
)


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


# Optional per-batch model inputs (multimodal models) that TRL forwards to `_get_per_token_logps_and_entropies`.
_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


class RPPTrainer(GRPOTrainer):
    """REINFORCE++ / REINFORCE++-baseline trainer (arXiv:2501.03262, v9 main equations).

    Use it exactly like [`~trl.GRPOTrainer`], with an [`RPPConfig`]. Everything GRPO does (generation, reward
    functions, PEFT, accelerate, logging, checkpoints, model cards) is inherited. What differs from `GRPOTrainer`:

    1. **Advantages.** After GRPO generates and scores a generation batch, the raw per-completion rewards (weighted
       sum over reward functions, gathered across processes, before any GRPO normalization) are turned into `[B, T]`
       token advantages by `trl_rpp.core`: k1-shaped KL-to-go returns (`reinforce_plus_plus`) or the inclusive
       group-mean baseline (`reinforce_plus_plus_baseline`), then `global_masked_normalize` over every valid token of
       the whole generation batch on all processes. The mask is TRL's completion mask times its tool mask (tool
       output tokens are internal mask holes). Completions that no reward function could score get zero advantage
       and leave both the group mean and the normalization population.
    2. **Log-probs at generation.** Reference log-probs are computed once per generation batch when the estimator
       needs them (k1 shaping with `kl_coef > 0`, or the KL loss), from the frozen initial model, or with adapters
       disabled under PEFT, through GRPO's own reference code path. Old-policy log-probs are computed at generation
       time when k1 shaping needs them, even where GRPO would skip them; no other forward pass is added. When a
       generation batch is a single micro-batch trained on at once (`steps_per_generation == 1` and
       `num_iterations == 1`, or evaluation), pi_old is exactly the loss forward's log-probs, so REINFORCE++ builds
       its returns and normalizes them inside the loss instead, without that extra forward.
    3. **Loss.** The clipped token surrogate with response-mean reduction (`response_mean_ppo_loss`), plus
       `kl_loss_coef * KL` (`response_mean_k2_loss`, or k1) when `use_kl_loss`. GRPO's k3 `beta` term is never used.
       The loss is divided by the gradient-accumulation steps as in GRPO's `"grpo"` loss type.
    4. **Metrics.** `advantages/*`, `returns/*`, `ref_kl/k1_mean`, `ppo_kl`, `kl_loss`, `policy_loss`, reduced across
       processes (see `docs/metrics.md`), next to GRPO's own.
    5. **Model card.** Names the real base model and records the estimator's settings (`trl_rpp.model_card`).
    6. **vLLM.** With `use_vllm=True`, GRPO's generation and its importance-sampling ratio are kept; the ratio weights
       each token's loss as in GRPO.
    7. **Score centering** (`score_centering=True`, off by default). The top-k ids and log-probs of the sampling
       distribution are recorded inside transformers' `generate` (`trl_rpp.sampling`) or requested from vLLM with
       `logprobs=k` (the sampled token's log-prob then selected by id), and the loss becomes
       `score_centered_ppo_loss`: the same clipped surrogate with every valid token's score centered. The loss
       forward then materializes the completion logits (to read the trainer's log-probs at the sampler's head ids)
       instead of GRPO's fused log-prob head. Extra metrics: `score_centering/*`.
    """

    _tag_names = ["trl", "rpp", "reinforce-plus-plus"]
    _name = "REINFORCE++"
    _paper = REINFORCE_PP_PAPER

    def __init__(
        self, model, reward_funcs=None, args: RPPConfig | None = None, train_dataset=None, eval_dataset=None, **kwargs
    ):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = RPPConfig(f"{str(name).rstrip('/').split('/')[-1] or 'model'}-RPP")
        if not isinstance(args, RPPConfig):
            raise TypeError(f"args must be an RPPConfig, got {type(args).__name__}: use RPPConfig(...) instead.")
        if kwargs.get("environment_factory") is None:
            # Checked before any model is loaded: a missing column would otherwise fail at the first batch.
            check_prompt_column(train_dataset, "train_dataset")
            check_prompt_column(eval_dataset, "eval_dataset")
        check_dataset_not_empty(train_dataset, "train_dataset")
        if reward_funcs is not None:
            reward_funcs = [guard_reward_func(f, args.nonfinite_rewards) for f in _as_list(reward_funcs)]
        kwargs.update(train_dataset=train_dataset, eval_dataset=eval_dataset)
        self._rpp_needs_ref = args.kl_coef != 0.0 or args.use_kl_loss
        # GRPO builds the reference (a frozen copy, or the disabled/"ref" adapter under PEFT) iff beta != 0.
        # Borrow that code path while constructing; beta is never used in the RPP loss.
        args.beta = 1.0 if self._rpp_needs_ref else 0.0
        k = args.score_centering_top_k
        try:
            with vllm_max_logprobs(k + 1 if args.score_centering and args.use_vllm else 0):
                super().__init__(model, reward_funcs, args, **kwargs)
        finally:
            args.beta = 0.0
        check_normalization_group(self.accelerator.parallelism_config)
        if args.score_centering and args.use_vllm:
            self.vllm_generation.logprobs = k  # top-k per token, plus the sampled token when outside them
        self.beta = 0.0
        self._rpp_rewards_per_func = None
        self._rpp_capture = None
        # False forces REINFORCE++ returns to be built at generation, with an old-policy forward; both paths give
        # the same numbers (tests/test_trainer.py compares them).
        self._rpp_allow_deferred_returns = True
        if args.score_centering:
            self._check_score_centering_setup()

    def _check_score_centering_setup(self):
        unsupported = [
            ("tools", bool(self.tools)),
            ("environment_factory", self.environment_factories is not None),
            ("rollout_func", self.rollout_func is not None),
            ("a multimodal processing_class", self._is_vlm),
            ("an MoE router aux loss", self.aux_loss_enabled),
        ]
        for name, present in unsupported:
            if present:
                raise ValueError(
                    f"score_centering=True does not support {name}: the sampler's top-k log-probs are captured "
                    "token by token inside a single text `generate` call."
                )
        if self.use_vllm:
            return  # vLLM samples with the config's settings, already checked by RPPConfig
        # The model's own generation config also shapes q: check what `generate` will actually use.
        model = self.accelerator.unwrap_model(self.model)
        merged = {**model.generation_config.to_dict(), **self.generation_kwargs}
        check_exact_sampling(merged, self.temperature, where="the model's generation config: ")

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card, written by `trl_rpp.model_card`: the real base model (never a `None` link), the dataset, the
        estimator's settings, and the REINFORCE++ (and, when on, score-centering) citations."""
        if self.is_world_process_zero():
            card = build_model_card(self, model_name=model_name, dataset_name=dataset_name, tags=tags)
            card.save(os.path.join(self.args.output_dir, "README.md"))

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints: the buffered generation batch outlives an optimizer step when steps_per_generation or
    # num_iterations > 1. GRPO drops it on resume and samples a new batch; we save it, so a resumed run continues
    # exactly where the interrupted one was. Order and atomicity: see `trl_rpp.checkpoint`.
    # ------------------------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        folder = resume_from_checkpoint
        if folder is True and os.path.isdir(self.args.output_dir):
            folder = get_last_checkpoint(self.args.output_dir)  # what Trainer resolves True to
        if isinstance(folder, (str, os.PathLike)):
            # Before Trainer loads anything: a half-written checkpoint fails here with the file named.
            check_resumable(os.fspath(folder), self.accelerator.process_index, self.args.gradient_accumulation_steps,
                            self.args.steps_per_generation, self.num_iterations)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial):
        if self._buffered_inputs is not None:
            # Before Trainer's files, so that a checkpoint with a trainer_state.json always has its buffer.
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder = os.path.join(self._get_output_dir(trial=trial), name)
            save_generation_buffer(folder, self.accelerator.process_index, self._step, self._buffered_inputs)
            self.accelerator.wait_for_everyone()  # every rank's buffer lands before rank 0 writes trainer_state.json
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        required = buffer_needed(self.state.global_step, self.args.gradient_accumulation_steps,
                                 self.args.steps_per_generation, self.num_iterations)
        loaded = load_generation_buffer(checkpoint, self.accelerator.process_index, required, self.accelerator.device)
        if loaded is not None:
            self._buffered_inputs, self._step = loaded

    # ------------------------------------------------------------------------------------------------------------
    # Generation: raw rewards -> [B, T] advantages
    # ------------------------------------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # Keep the gathered raw rewards [B_global, num_reward_funcs]: GRPO normalizes them per group afterwards.
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # Callable reward functions are guarded where they return (see `guard_reward_func`); reward models here.
        module_columns = [i for i, f in enumerate(self.reward_funcs) if isinstance(f, torch.nn.Module)]
        if module_columns:
            rewards_per_func = check_module_rewards(
                rewards_per_func, module_columns, self.reward_func_names, self.args.nonfinite_rewards
            )
        self._rpp_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        if not self.args.score_centering:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
        if self.use_vllm:
            return self._generate_vllm_with_topk(prompt_ids, images, num_generations)
        capture = SamplerTopKCapture(self.args.score_centering_top_k, self.temperature)
        with capturing_generate(self.accelerator.unwrap_model(self.model_wrapped), capture):
            out = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
        self._rpp_capture = capture
        return out

    def _generate_vllm_with_topk(self, prompt_ids, images, num_generations):
        """GRPO's vLLM branch, keeping the top-k lists and selecting the sampled token's log-prob by id."""
        if self.state.global_step != self._last_loaded_step:
            with profiling_context(self, "sync_weights"):
                self.vllm_generation.sync_weights()
            self._last_loaded_step = self.state.global_step
        _, completion_ids, logprobs, token_ids = self.vllm_generation.generate(
            prompts=prompt_ids, images=images, num_generations=num_generations,
            profiler=profiling_context(self, "vLLM.generate"),
        )
        sampled, self._rpp_capture = parse_vllm_topk(completion_ids, logprobs, token_ids, self.args.score_centering_top_k)
        return completion_ids, sampled

    def _importance_weight_fn(self):
        """TRL's token-level sampler correction as a function of the ratio (None when it is off)."""
        if not (self.use_vllm and self.vllm_importance_sampling_correction):
            return None
        lo = self.vllm_importance_sampling_clip_min if self.vllm_importance_sampling_clip_min is not None else -float("inf")
        hi = self.vllm_importance_sampling_clip_max if self.vllm_importance_sampling_clip_max is not None else float("inf")
        if self.vllm_importance_sampling_mode == "token_truncate":
            return lambda x: x.clamp(min=lo, max=hi)
        return lambda x: torch.where((x >= lo) & (x <= hi), x, torch.zeros_like(x))  # token_mask

    def _forward_logps(self, model, batch, **extra):
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        forward = {k: batch[k] for k in _FORWARD_KEYS if batch.get(k) is not None}
        return self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, batch["completion_ids"].size(1), **forward, **extra
        )

    def _generate_and_score_completions(self, inputs):
        # GRPO computes reference log-probs iff self.beta != 0: switch it on only for this call.
        self.beta = 1.0 if self._rpp_needs_ref else 0.0
        try:
            batch = super()._generate_and_score_completions(inputs)
        finally:
            self.beta = 0.0
        args = self.args
        mode = "train" if self.model.training else "eval"
        device = batch["completion_ids"].device
        mask = batch["completion_mask"].bool()
        if "tool_mask" in batch:
            mask = mask & batch["tool_mask"].bool()
        if args.score_centering:
            capture, self._rpp_capture = self._rpp_capture, None
            ids, head, sampled = capture.tensors(batch["completion_ids"].size(1))
            batch["sampler_head_ids"], batch["sampler_head_logps"] = ids.to(device), head.to(device)
            batch["sampler_per_token_logps"] = sampled.to(device)

        # Raw rewards as GRPO sums them; rows that no reward function scored are "unscorable".
        rewards_per_func = self._rpp_rewards_per_func
        self._rpp_rewards_per_func = None
        scorable = ~torch.isnan(rewards_per_func).all(dim=1)
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        local_B = batch["completion_ids"].size(0)
        local = slice(self.accelerator.process_index * local_B, (self.accelerator.process_index + 1) * local_B)
        mask = mask & scorable[local].unsqueeze(1)

        ref_logps = batch.get("ref_per_token_logps")
        if args.advantage_estimator == "reinforce_plus_plus":
            old_logps = batch.get("old_per_token_logps")
            if args.kl_coef != 0.0 and old_logps is None and self._rpp_defer_returns(mode):
                # pi_old is exactly what the loss forward computes, and it needs the whole batch anyway: the
                # returns and their normalization move into `_compute_loss`, saving one forward pass.
                batch.pop("advantages", None)
                batch["rpp_rewards"], batch["rpp_mask"] = rewards[local], mask
                return batch
            if args.kl_coef != 0.0 and old_logps is None:
                batch_size = args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size
                with torch.no_grad(), disable_gradient_checkpointing(self.model, args.gradient_checkpointing_kwargs):
                    old_logps, _, _ = self._forward_logps(self.model, batch, batch_size=batch_size)
                # The loss then uses these exact log-probs as pi_old, the same ones that shaped the reward.
                batch["old_per_token_logps"] = old_logps
            raw = reinforce_pp_returns(rewards[local], old_logps, ref_logps, mask, args.kl_coef, args.gamma)
        else:
            num_generations = self.num_generations if mode == "train" else self.num_generations_eval
            centered = group_centered_rewards(rewards, num_generations, scorable)[local]
            raw = torch.where(mask, centered.unsqueeze(1), torch.zeros((), dtype=centered.dtype, device=device))

        # A batch with no valid token anywhere becomes a zero-advantage step (see `_warn_empty_batch`).
        advantages, raw_mean, raw_var, count = global_masked_normalize(raw, mask, allow_empty=True)
        batch["advantages"] = advantages
        self._log_advantage_metrics(mode, raw, advantages, mask, raw_mean, raw_var, count, batch)
        return batch

    def _rpp_defer_returns(self, mode):
        """True when each generation batch is one micro-batch trained on right away with unchanged weights
        (`steps_per_generation == 1`, `num_iterations == 1`, or evaluation): then pi_old is the loss forward's own
        log-probs, and REINFORCE++ computes its k1 returns there instead of in an extra forward at generation."""
        return self._rpp_allow_deferred_returns and (
            mode == "eval" or (self.args.steps_per_generation == 1 and self.num_iterations == 1)
        )

    def _log_advantage_metrics(self, mode, raw, advantages, mask, raw_mean, raw_var, count, batch):
        # One gather and one host transfer per generation batch, for logging only (GRPO logs the same way).
        old, ref = batch.get("old_per_token_logps"), batch.get("ref_per_token_logps")
        zero = torch.zeros((), dtype=torch.float32, device=raw.device)
        big = torch.tensor([torch.finfo(torch.float32).max], device=raw.device)
        adv = torch.where(mask, advantages.float(), zero)
        raw = raw.float()
        has_kl = old is not None and ref is not None
        k1_sum = kl_k1(old, ref, mask).float().sum() if has_kl else zero
        local = torch.stack(
            [
                adv.sum(),
                (adv * adv).sum(),
                k1_sum,
                torch.cat([torch.where(mask, raw, -big).flatten(), -big]).max(),
                torch.cat([torch.where(mask, -raw, -big).flatten(), -big]).max(),
            ]
        )
        stats = self.accelerator.gather(local.unsqueeze(0)).view(-1, local.numel())
        totals = torch.cat([stats[:, :3].sum(dim=0), stats[:, 3:].amax(dim=0)])
        moments = torch.stack([raw_mean.float(), raw_var.float(), count.float()])
        adv_sum, adv_sq, k1_total, raw_max, neg_raw_min, mu, var, n = torch.cat([totals, moments]).tolist()
        n_safe = max(n, 1.0)
        norm_mean = adv_sum / n_safe
        m = self._metrics[mode]
        m["advantages/raw_mean"].append(mu)
        m["advantages/raw_std"].append(var**0.5)
        m["advantages/mean"].append(norm_mean)
        m["advantages/std"].append(max(adv_sq / n_safe - norm_mean**2, 0.0) ** 0.5)
        m["advantages/valid_tokens"].append(n)
        m["advantages/zero_variance"].append(float(var <= 1e-8))
        m["advantages/empty_batch"].append(float(n == 0))
        if n == 0:
            raw_max = neg_raw_min = 0.0  # no return to report (not the -/+float32-max sentinels)
            self._warn_empty_batch(mode, batch)
        if self.args.advantage_estimator == "reinforce_plus_plus":
            # For REINFORCE++ the raw advantages are the k1-shaped returns G.
            m["returns/mean"].append(mu)
            m["returns/std"].append(var**0.5)
            m["returns/max"].append(raw_max)
            m["returns/min"].append(-neg_raw_min)
        if has_kl:
            m["ref_kl/k1_mean"].append(k1_total / n_safe)

    def _warn_empty_batch(self, mode, batch):
        """Name the cause of a generation batch without any valid token. Reached only after the metrics' host
        transfer showed a global count of 0, so the extra gather here never runs on the normal path."""
        mask = batch["completion_mask"].bool()
        if "tool_mask" in batch:
            mask = mask & batch["tool_mask"].bool()
        any_token = self.accelerator.gather(mask.any().float().reshape(1)).sum().item() > 0
        if any_token:
            cause = (
                "no completion that has a valid token could be scored: every reward function returned None for "
                "each of them (an unavailable judge or reward server?)"
            )
        else:
            cause = (
                "every completion is masked (with mask_truncated_completions=True: none ended within "
                "max_completion_length)"
            )
        warnings.warn(
            f"RPPTrainer ({mode}, step {self.state.global_step}): the generation batch has no valid token: {cause}. "
            "It is trained on as a zero-advantage step (no policy-gradient signal; a KL loss still applies) and "
            "logged with advantages/empty_batch = 1.",
            RuntimeWarning,
            stacklevel=2,
        )

    # ------------------------------------------------------------------------------------------------------------
    # Loss
    # ------------------------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        args = self.args
        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        if args.score_centering:
            logps, entropies, head_logps = self._forward_with_head(model, inputs)
            aux_loss = None
        else:
            logps, entropies, aux_loss = self._forward_logps(
                model, inputs, compute_entropy=True, compute_aux_loss=self.aux_loss_enabled
            )
        old_logps = inputs.get("old_per_token_logps")
        # Without a stored pi_old, generation and optimisation are aligned and pi_old == pi_theta (as in GRPO).
        old_logps = logps.detach() if old_logps is None else old_logps
        if "rpp_rewards" in inputs:  # REINFORCE++ returns deferred from generation (see `_rpp_defer_returns`)
            rmask = inputs["rpp_mask"]
            raw = reinforce_pp_returns(
                inputs["rpp_rewards"], old_logps, inputs["ref_per_token_logps"], rmask, args.kl_coef, args.gamma
            )
            advantages, raw_mean, raw_var, count = global_masked_normalize(raw, rmask, allow_empty=True)
            self._log_advantage_metrics(
                mode, raw, advantages, rmask, raw_mean, raw_var, count, {**inputs, "old_per_token_logps": old_logps}
            )
            # Recorded in the batch, as the generation-time path records them, for inspection after the step.
            inputs["advantages"], inputs["old_per_token_logps"] = advantages, old_logps
        else:
            advantages = inputs["advantages"]

        # TRL's vLLM sampler correction (when on) weights each token's loss, as in GRPO.
        is_weights = inputs.get("importance_sampling_ratio")
        if args.score_centering:
            policy_loss = score_centered_ppo_loss(
                logps, old_logps, advantages, mask, head_logps, inputs["sampler_head_logps"],
                self.epsilon_low, self.epsilon_high, importance_weights=is_weights,
                weight_fn=self._importance_weight_fn() if is_weights is not None else None,
            )
        else:
            policy_loss = response_mean_ppo_loss(
                logps, old_logps, advantages, mask, self.epsilon_low, self.epsilon_high, importance_weights=is_weights
            )
        loss = policy_loss
        kl_loss = None
        if args.use_kl_loss:
            ref_logps = inputs["ref_per_token_logps"]
            if args.kl_loss_type == "k2":
                kl_loss = response_mean_k2_loss(logps, ref_logps, mask)
            else:
                kl_loss = masked_response_mean(kl_k1(logps, ref_logps, mask), mask)
            loss = loss + args.kl_loss_coef * kl_loss

        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss / normalizer
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer

        with torch.no_grad():
            zero = torch.zeros((), dtype=logps.dtype, device=logps.device)
            ratio = torch.exp(torch.where(mask, logps.detach() - old_logps, zero))
            low = mask & (ratio < 1 - self.epsilon_low) & (advantages < 0)
            high = mask & (ratio > 1 + self.epsilon_high) & (advantages > 0)
            local = [
                mask.sum().float(),
                torch.where(mask, entropies.detach(), zero).sum().float(),
                low.sum().float(),
                high.sum().float(),
                (low | high).sum().float(),
                masked_response_mean(old_logps - logps.detach(), mask).float(),
                policy_loss.detach().float(),
                (kl_loss.detach().float() if kl_loss is not None else torch.zeros((), device=logps.device)),
            ]
            if self.aux_loss_enabled:
                local.append(aux_loss.detach().float())
            if args.score_centering:
                local.extend(self._score_centering_stats(logps, head_logps, inputs, mask))
            stats = self.accelerator.gather(torch.stack(local).unsqueeze(0)).view(-1, len(local))
            sums = stats[:, :5].sum(dim=0)
            means = stats[:, 5:8 + int(self.aux_loss_enabled)].mean(dim=0)  # equal B per process: global mean
            extra = stats[:, 8 + int(self.aux_loss_enabled):].sum(dim=0)
            values = torch.cat([sums, means, extra]).tolist()
        n = max(values[0], 1.0)
        m = self._metrics[mode]
        m["entropy"].append(values[1] / n)
        m["clip_ratio/low_mean"].append(values[2] / n)
        m["clip_ratio/high_mean"].append(values[3] / n)
        m["clip_ratio/region_mean"].append(values[4] / n)
        m["ppo_kl"].append(values[5])
        m["policy_loss"].append(values[6])
        if kl_loss is not None:
            m["kl_loss"].append(values[7])
        if self.aux_loss_enabled:
            m["aux_loss"].append(values[8])
        if args.score_centering:
            q_mass, p_mass, coeff_l1, diff, n_sampled = values[-5:]
            m["score_centering/sampler_head_mass"].append(q_mass / n)
            m["score_centering/trainer_head_mass"].append(p_mass / n)
            m["score_centering/coeff_l1"].append(coeff_l1 / n)
            m["score_centering/sampler_logp_abs_diff"].append(diff / max(n_sampled, 1.0))
        return loss

    def _forward_with_head(self, model, inputs):
        """Log-probs of the sampled tokens, entropies, and log-probs at the sampler's head ids, ``[B, T]``, ``[B, T]``,
        ``[B, T, k]``, at the sampling temperature, from one forward that keeps the completion logits."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        T = inputs["completion_ids"].size(1)
        with self.accelerator.autocast():
            logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=T + 1).logits
        logp_all = torch.log_softmax(logits[:, -T - 1 : -1].float() / self.temperature, dim=-1)
        logps = logp_all.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
        head_logps = logp_all.gather(-1, inputs["sampler_head_ids"])
        probs = logp_all.exp()
        entropies = -torch.where(probs > 0, probs * logp_all, torch.zeros((), device=probs.device)).sum(-1)
        return logps, entropies, head_logps

    @staticmethod
    def _score_centering_stats(logps, head_logps, inputs, mask):
        coeff, q_mass, p_mass = score_centering_coefficients(head_logps, inputs["sampler_head_logps"], mask)
        sampled = inputs["sampler_per_token_logps"]
        has = mask & torch.isfinite(sampled)
        diff = torch.where(has, (sampled - logps.detach()).abs(), torch.zeros((), device=logps.device))
        return [
            q_mass.sum().float(),
            p_mass.sum().float(),
            coeff.abs().sum().float(),
            diff.sum().float(),
            has.sum().float(),
        ]
