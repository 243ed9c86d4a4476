"""The head read through a model's own forward (`trl_rpp.records.head.install_head_reader`, `trl_rpp.records.replay.head_logps`) equals today's
full-logits path on that model: `support_logps` (replay) and the full-vocabulary `log_softmax` (score centering) of the
logits its unpatched forward returns, in value and in the gradient of every parameter, to 1e-10 in float64.

Tiny models built locally, one per way a head is read: tied embeddings, a head with a bias (Phi), Cohere's
`logit_scale`, Gemma 2's `final_logit_softcapping`, Granite's `logits_scaling`, LoRA (the head not targeted, and
targeted: the adapter's state read as PEFT's forward reads it, disabled, merged, several adapters, dropout), gradient
checkpointing. Heads that cannot be read so (DoRA and the other LoRA variants included) are refused, naming the model
type."""

import math

import pytest
import torch

from trl_rpp.records.replay import head_logps
from trl_rpp.records.head import head_transform, install_head_reader
from reference import ref_sampled_and_head_logps
from trl_rpp.truncation import ABSENT, support_logps

V, HID, B, S, T, K, TEMP = 37, 16, 2, 9, 4, 5, 0.8
SMALL = dict(vocab_size=V, hidden_size=HID, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build(kind):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama_tied":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, tie_word_embeddings=True))
    elif kind == "phi_head_bias":
        model = tf.PhiForCausalLM(tf.PhiConfig(**SMALL))
        torch.nn.init.normal_(model.lm_head.bias)  # zero at init: make the bias count
    elif kind == "cohere_logit_scale":
        model = tf.CohereForCausalLM(tf.CohereConfig(**SMALL, logit_scale=0.5))
    elif kind == "gemma2_softcapping":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=1.5,
                                                     attn_implementation="eager"))
    elif kind == "granite_logits_scaling":
        model = tf.GraniteForCausalLM(tf.GraniteConfig(**SMALL, logits_scaling=0.5))
    elif kind == "lora_head_bias":  # LoRA on a head with a bias (Phi), next to attention
        from peft import LoraConfig, get_peft_model

        model = tf.PhiForCausalLM(tf.PhiConfig(**SMALL))
        torch.nn.init.normal_(model.lm_head.bias)
        model = get_peft_model(model, LoraConfig(r=3, target_modules=["lm_head", "q_proj"], init_lora_weights=False))
    elif kind == "lora_head_tied":  # LoRA on a head tied to the embeddings
        from peft import LoraConfig, get_peft_model

        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, tie_word_embeddings=True))
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["lm_head", "v_proj"], init_lora_weights=False,
                                                 lora_alpha=8))
    elif kind in ("lora", "lora_gradient_checkpointing", "gradient_checkpointing"):
        from peft import LoraConfig, get_peft_model

        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, tie_word_embeddings=False))
        if kind != "gradient_checkpointing":
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        if kind != "lora":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = model.double()
    model.train()
    return model


def batch(seed=0, pad=True):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, V, (B, S), generator=g)
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[1, :2] = int(not pad)  # a left-padded prompt
    support = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * T)]).view(B, T, K)
    support[0, 1, 3:] = ABSENT
    support[1, 3] = ABSENT  # a position without a kept id (a tool token)
    input_ids[:, -T:] = support[..., 0].clamp(min=3)  # the sampled token is kept (or, where nothing is, any id)
    support[..., 0] = torch.where(support[..., 0] == ABSENT, ABSENT, input_ids[:, -T:])
    ids = torch.cat([input_ids[:, -T:].unsqueeze(-1), support[..., :2].clamp(min=0)], -1)
    weights = torch.randn(B, T, ids.size(-1), generator=g, dtype=torch.float64)
    return input_ids, attention_mask, support, ids, weights


def param_grads(model, loss):
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return dict(zip([n for n, _ in params], torch.autograd.grad(loss, [p for _, p in params])))


KINDS = ["llama_tied", "phi_head_bias", "cohere_logit_scale", "gemma2_softcapping", "granite_logits_scaling", "lora",
         "gradient_checkpointing", "lora_gradient_checkpointing", "lora_head_bias", "lora_head_tied"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("replay", [True, False])
def test_read_head_equals_todays_full_logits_path(kind, replay):
    model = build(kind)
    # Gemma 2's eager attention gives NaN gradients from a left-padded row, through its own logits too.
    compare_with_full_logits(model, replay, pad=kind != "gemma2_softcapping")


def compare_with_full_logits(model, replay, pad=True, seed=None, trainable=True):
    """`head_logps` through the patched forward against the unpatched forward's logits (`support_logps` or
    `reference.ref_sampled_and_head_logps`): values and every trainable parameter's gradient, float64, 1e-10 (values only with
    `trainable` False: PEFT freezes disabled adapters). With `seed`, both forwards start from that RNG state (dropout
    draws the same masks). Returns the read log-probs."""
    input_ids, attention_mask, support, ids, weights = batch(pad=pad)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3] = False
    if seed is not None:
        torch.manual_seed(seed)
    if replay:  # the reference first: the unpatched forward
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -T - 1 : -1]
        ref = support_logps(logits, ids, support, TEMP)
        ref = torch.where((support != ABSENT).any(-1, keepdim=True), ref, torch.zeros_like(ref))
    else:
        # With a seed, every position's logits: the head's dropout then draws its mask over the same [B, S, H].
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       logits_to_keep=T + 1 if seed is None else 0).logits[:, -T - 1 :]
        logps, head, _ = ref_sampled_and_head_logps(logits, ids[..., 0], ids[..., 1:], TEMP)
        ref = torch.where(mask.unsqueeze(-1), torch.cat([logps.unsqueeze(-1), head], -1), 0.0)
    want = param_grads(model, (ref * weights).sum()) if trainable else {}

    if not getattr(model, "rpp_reader", False):
        install_head_reader(model)
        model.rpp_reader = True
    if seed is not None:
        torch.manual_seed(seed)
    out, ent = head_logps(model, input_ids, attention_mask, ids, support if replay else None, TEMP,
                          valid=None if replay else mask)
    got = param_grads(model, (out * weights).sum()) if trainable else {}
    torch.testing.assert_close(out, ref.detach(), rtol=1e-10, atol=1e-10)
    assert set(got) == set(want) and len(got) == (len(got) if trainable else 0) and (len(got) > 0) == trainable
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-10, msg=name)
    assert ent.shape == (B, T) and torch.isfinite(ent).all()
    # The unpatched forward is unchanged (generation uses it): the same call gives the same logits, to the bit. (The
    # same call: a head over fewer positions is another matrix product, whose last bit can differ on some CPUs.)
    if seed is not None:
        torch.manual_seed(seed)
    keep = {} if replay else {"logits_to_keep": T + 1 if seed is None else 0}
    again = model(input_ids=input_ids, attention_mask=attention_mask, **keep).logits[:, -T - 1 :]
    torch.testing.assert_close(again[:, :-1] if replay else again, logits if replay else logits, rtol=0, atol=0)
    return out.detach()


def lora_grads_of_head(model):
    return [n for n, p in model.named_parameters() if p.requires_grad and "lm_head.lora_" in n]


@pytest.mark.parametrize("replay", [True, False])
def test_a_lora_heads_state_is_read_as_peft_reads_it(replay):
    """Disabled adapters (the reference model), a merged adapter, two active adapters (their terms summed) and a
    second adapter switched to alone: each read equals PEFT's own forward, and each state reads differently."""
    from peft import LoraConfig

    model = build("lora_head_bias")
    assert lora_grads_of_head(model) == ["base_model.model.lm_head.lora_A.default.weight",
                                         "base_model.model.lm_head.lora_B.default.weight"]
    enabled = compare_with_full_logits(model, replay)
    with model.disable_adapter():
        assert not any(p.requires_grad for p in model.parameters())
        disabled = compare_with_full_logits(model, replay, trainable=False)
    assert (enabled - disabled).abs().max() > 1e-3
    model.add_adapter("other", LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False))
    model.base_model.set_adapter(["default", "other"])
    model.double()
    both = compare_with_full_logits(model, replay)
    assert (both - enabled).abs().max() > 1e-3
    model.base_model.set_adapter("other")
    other = compare_with_full_logits(model, replay)
    assert (other - both).abs().max() > 1e-3
    model.base_model.set_adapter("default")
    model.merge_adapter()
    assert model.base_model.model.lm_head.merged
    with torch.no_grad():  # merged weights are not trainable through the adapter: values only
        torch.testing.assert_close(compare_values_only(model, replay), enabled, rtol=1e-10, atol=1e-10)
    model.unmerge_adapter()


@pytest.mark.parametrize("replay", [True, False])
def test_a_lora_head_whose_class_fsdp2_swapped_is_read_as_peft_reads_it(replay):
    """accelerate's FSDP2 shards the head with the final norm once training starts, and `fully_shard` turns the
    head's class into `FSDPLinear(FSDPModule, lora.Linear)`: the reader, installed before, still reads the adapter (it
    was silently dropped once, its `lora_B` never trained; tests/test_engines.py runs the real FSDP2)."""
    from peft.tuners.lora import Linear
    from torch.distributed.fsdp import FSDPModule

    model = build("lora_head_bias")
    install_head_reader(model)  # at construction, as the trainer does
    model.rpp_reader = True
    head = model.base_model.model.lm_head
    head.__class__ = type("FSDPLinear", (FSDPModule, Linear), {})  # the class fully_shard gives the head
    compare_with_full_logits(model, replay)


def compare_values_only(model, replay):
    input_ids, attention_mask, support, ids, _ = batch()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3] = False
    out, _ = head_logps(model, input_ids, attention_mask, ids, support if replay else None, TEMP,
                        valid=None if replay else mask)
    return out


def test_a_lora_heads_dropout_is_applied():
    """lora_dropout = 0.5: under the same seed the read equals PEFT's forward exactly (the same masks); in train mode
    two reads differ, in eval mode they are equal."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, tie_word_embeddings=False))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False,
                                             lora_dropout=0.5)).double()
    model.train()
    compare_with_full_logits(model, replay=False, seed=1)
    first, second = compare_values_only(model, False), compare_values_only(model, False)
    assert (first - second).abs().max() > 1e-3
    model.eval()
    torch.testing.assert_close(compare_values_only(model, False), compare_values_only(model, False), rtol=0, atol=0)


def test_each_models_transform_is_read_from_its_config():
    assert head_transform(build("cohere_logit_scale").config).scale == 0.5
    assert head_transform(build("granite_logits_scaling").config).divisor == 0.5
    assert head_transform(build("gemma2_softcapping").config).softcap == 1.5
    t = head_transform(build("llama_tied").config)
    assert (t.scale, t.divisor, t.softcap) == (None, None, None)


class ScaledHead(torch.nn.Module):
    """A head that is not a plain linear map of the hidden states."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return 2 * self.linear(x)


def test_a_head_that_cannot_be_read_is_refused_naming_the_model_type():
    from peft import LoraConfig, get_peft_model

    model = build("llama_tied")
    model.lm_head = ScaledHead(model.lm_head)
    with pytest.raises(ValueError, match=r"^model type 'llama' is not supported with a replayed truncating sampler or "
                                         r"score centering: its output embeddings are a ScaledHead"):
        install_head_reader(model)
    dora = get_peft_model(build("phi_head_bias"), LoraConfig(r=2, target_modules=["lm_head", "q_proj"], use_dora=True))
    with pytest.raises(ValueError, match=r"^model type 'phi' is not supported with a LoRA adapter on its head set with "
                                         r"use_dora \(adapter 'default'\)"):
        install_head_reader(dora)
    lora_bias = get_peft_model(build("phi_head_bias"), LoraConfig(r=2, target_modules=["lm_head"], lora_bias=True))
    with pytest.raises(ValueError, match=r"^model type 'phi' .* set with lora_bias=True"):
        install_head_reader(lora_bias)


def test_the_trainer_refuses_such_a_head_at_construction(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM

    from trainer_helpers import length_reward, make_args
    from trl_rpp import RPPTrainer
    from trl_rpp.testing.tiny import copy_task_dataset

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.lm_head = ScaledHead(model.lm_head)
    for kw in (dict(top_k=5), dict(score_centering=True)):
        args = make_args(tmp_path, "reinforce_plus_plus_baseline", max_steps=1, **kw)
        with pytest.raises(ValueError, match=r"^model type 'llama' is not supported"):
            RPPTrainer(model=model, reward_funcs=[length_reward, length_reward], args=args,
                       train_dataset=copy_task_dataset(8))


# --- no forward of the trainer holds a [B, T, V] tensor -------------------------------------------------------------


class VocabWide:
    """Records the shape of every tensor an op allocates (a `TorchDispatchMode`) that has a dimension of the
    vocabulary's size `V`, other than the head's and embedding's own `[V, H]` (or its transpose) and `[V]`: parameters, their gradients."""

    def __init__(self, vocab, hidden):
        self.vocab, self.parameter_shapes, self.shapes, self.parameter_seen = vocab, {(vocab, hidden), (hidden, vocab), (vocab,)}, [], 0

    def __call__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        record = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and record.vocab in t.shape:
                        if tuple(t.shape) in record.parameter_shapes:
                            record.parameter_seen += 1
                        else:
                            record.shapes.append(tuple(t.shape))
                return out

        return Mode()

    def largest_rows(self):
        return max((math.prod(s) // self.vocab for s in self.shapes), default=0)


def recording_trainer(record, replay):
    from trl_rpp import RPPTrainer

    class Recording(RPPTrainer):
        """Records what the loss forward and its backward allocate, and, with replay, GRPO's old and reference
        forwards (without replay they are GRPO's own fused head, not this path)."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            backward = self.accelerator.backward

            def recorded_backward(loss, **kw):
                with record():
                    return backward(loss, **kw)

            self.accelerator.backward = recorded_backward

        def compute_loss(self, *a, **kw):
            with record():
                return super().compute_loss(*a, **kw)

        def _get_per_token_logps_and_entropies(self, *a, **kw):
            if not replay:
                return super()._get_per_token_logps_and_entropies(*a, **kw)
            self.old_or_ref_forwards = getattr(self, "old_or_ref_forwards", 0) + 1
            with record():
                return super()._get_per_token_logps_and_entropies(*a, **kw)

    return Recording


@pytest.mark.parametrize("replay,score_centering", [(True, False), (False, True), (True, True)])
def test_no_forward_of_the_trainer_holds_a_vocabulary_wide_batch_tensor(tmp_path, tiny_model, monkeypatch, replay,
                                                                        score_centering):
    """One step (two micro-batches of 4 completions of 6 tokens; pi_old and the reference computed at generation)
    with replay (`top_k=5`), score centering, or both. With replay no tensor of the forwards (old policy, reference,
    loss and its backward) has a vocabulary-wide dimension at all; score centering's full softmax holds at most one
    tile of 3 positions' logits (`TILE_ELEMENTS` set so), where the batch has up to 24. The recorder sees the plain
    forward's `[B, S, V]` logits, and the head's `[V, H]` gradient in the backward."""
    from transformers import AutoModelForCausalLM

    from trainer_helpers import length_reward, make_args
    from trl_rpp import lm_head
    from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    record = VocabWide(vocab, hidden)
    with record():  # the recorder's teeth: the plain forward's logits
        model(input_ids=torch.ones(2, 5, dtype=torch.long)).logits.sum()
    assert (2, 5, vocab) in record.shapes and record.largest_rows() == 10
    record.shapes.clear()

    tile = 3
    monkeypatch.setattr(lm_head, "TILE_ELEMENTS", tile * vocab)
    args = make_args(tmp_path, "reinforce_plus_plus", max_steps=1, max_completion_length=6, num_iterations=2,
                     kl_coef=0.05, top_k=5 if replay else 0,
                     score_centering=score_centering,
                     score_centering_top_k=(5 if replay else 8) if score_centering else 32)
    trainer = recording_trainer(record, replay)(model=model, reward_funcs=[copy_first_char_reward, length_reward],
                                                args=args, train_dataset=copy_task_dataset(16))
    trainer.train()
    assert record.parameter_seen > 0  # the backward was recorded
    if replay:
        assert trainer.old_or_ref_forwards >= 2
        assert record.shapes == []
    else:
        assert record.shapes and record.largest_rows() == tile, sorted(set(record.shapes))


def test_the_trl_helpers_the_tiled_head_calls_keep_their_signatures():
    """`trl_rpp.lm_head` and `install_head_reader` call these TRL helpers (ZeRO-3's gather of the head, the entropy
    GRPO logs); a TRL that changes them fails here, naming its version."""
    import inspect

    import trl
    from trl.trainer import utils

    for fn, params in ((utils.maybe_gather_lm_head_ctx, ["params"]), (utils.entropy_from_logits, ["logits", "chunk_size"])):
        assert list(inspect.signature(fn).parameters) == params, f"TRL {trl.__version__} changed {fn.__name__}"


# --- a LoRA adapter on the head, trained by RPPTrainer ----------------------------------------------------------------

LORA_HEAD_PATHS = {"neither": {}, "replay": dict(top_k=5), "score_centering": dict(score_centering=True,
                   score_centering_top_k=8), "both": dict(top_k=5, score_centering=True, score_centering_top_k=5)}


def full_logits_reference(trainer, model, inputs):
    """The loss forward's log-probs from the `[B, T, V]` logits of PEFT's own forward (the adapter applied by
    `lora.Linear.forward`): `support_logps` over the kept sets with replay, else the full softmax; with score
    centering also at the sampler's head ids."""
    from trl_rpp.batch import PolicyForward

    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    T = inputs["completion_ids"].size(1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=T + 1).logits
    ids = inputs["completion_ids"].unsqueeze(-1)
    if trainer.args.score_centering:
        ids = torch.cat([ids, inputs["sampler_head_ids"]], -1)
    if trainer._rpp_bound is not None:
        support = inputs["sampler_support_ids"]
        ref = support_logps(logits[:, :-1], ids, support, trainer.temperature)
        ref = torch.where((support != ABSENT).any(-1, keepdim=True), ref, torch.zeros_like(ref))
    elif trainer.args.score_centering:
        logps, head, _ = ref_sampled_and_head_logps(logits, ids[..., 0], ids[..., 1:], trainer.temperature)
        ref = torch.cat([logps.unsqueeze(-1), head], -1)
    else:
        ref = torch.log_softmax(logits[:, :-1] / trainer.temperature, -1).gather(-1, ids)
    return PolicyForward(ref[..., 0], torch.zeros_like(ref[..., 0]),
                         head_logps=ref[..., 1:] if trainer.args.score_centering else None)


@pytest.mark.parametrize("path", list(LORA_HEAD_PATHS))
def test_a_lora_adapter_on_the_head_is_trained_exactly_on_every_path(tmp_path, tiny_model, path):
    """LoRA on lm_head, q_proj and v_proj (float64), 2 steps of REINFORCE++-baseline with its k2 KL loss, whose
    reference is the disabled adapter: the replay, score centering, both, or neither (where GRPO's fused head would
    ignore the adapter). At each step the loss and the gradients of the head's adapter equal those
    of the same loss on PEFT's full logits (1e-10), and so do the reference log-probs taken at generation; losses are
    finite and the head's adapter moves."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from trainer_helpers import make_args
    from trl_rpp import RPPTrainer
    from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

    class Checked(RPPTrainer):
        checks, moving, losses = 0, 0, []

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            if not self.model.training:
                return loss
            self.losses.append(loss.item())
            params = [p for n, p in model.named_parameters() if "lm_head.lora_" in n]
            assert len(params) == 2
            got = torch.autograd.grad(loss, params, retain_graph=True)
            self._policy_forward = lambda m, i: full_logits_reference(self, m, i)
            try:
                want_loss = super()._compute_loss(model, inputs)
            finally:
                del self._policy_forward
            want = torch.autograd.grad(want_loss, params)
            torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
            self.moving += bool(got[1].abs().max() > 0)  # lora_B of the head gets a gradient
            with torch.no_grad(), model.disable_adapter():  # the reference: PEFT's forward without the adapter
                ref = full_logits_reference(self, model, inputs).logps
            mask = inputs["completion_mask"].bool()
            torch.testing.assert_close(inputs["ref_per_token_logps"][mask], ref[mask], rtol=1e-10, atol=1e-10)
            self.checks += 1
            return loss

    def varied_reward(completions, **kwargs):  # differs inside a group: every step has nonzero advantages
        return [float(sum(map(ord, c)) % 7) for c in completions]

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    args = make_args(tmp_path, "reinforce_plus_plus_baseline", max_steps=2, gradient_accumulation_steps=1,
                     steps_per_generation=1, **LORA_HEAD_PATHS[path])
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0)
    trainer = Checked(model=model, reward_funcs=[copy_first_char_reward, varied_reward], args=args,
                      train_dataset=copy_task_dataset(16), peft_config=lora)
    assert trainer._rpp_lora_head
    head = trainer.model.base_model.model.lm_head
    before = head.lora_B["default"].weight.detach().clone()
    trainer.train()
    assert trainer.checks == trainer.moving == 2 and all(math.isfinite(x) for x in trainer.losses)
    assert (head.lora_B["default"].weight - before).abs().max() > 1e-4


def test_lm_head_adapters_the_trainer_cannot_train_exactly_are_refused_at_construction(tmp_path, tiny_model,
                                                                                     monkeypatch):
    """cast_lm_head_to_fp32 with a LoRA head (before any model is loaded, and with a PeftModel), vLLM with a LoRA head
    tied to the input embeddings (before any engine is built), DoRA on the head
    (naming use_dora), an adapter type other than LoRA on the head (TRL's own refusal, still in force), and a TRL whose
    refusal is no longer the one `trl_rpp.patches.lm_head_lora_allowed` was written against (naming the TRL version)."""
    from peft import IA3Config, LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl.trainer import grpo_trainer

    from trainer_helpers import length_reward, make_args
    from trl_rpp import RPPTrainer, patches
    from trl_rpp.testing.tiny import copy_task_dataset

    def build_trainer(model, peft_config=None, **kw):
        args = make_args(tmp_path, "reinforce_plus_plus_baseline", max_steps=1, **kw)
        return RPPTrainer(model=model, reward_funcs=[length_reward, length_reward], args=args,
                          train_dataset=copy_task_dataset(8), peft_config=peft_config)

    lora = LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    cast = r"^cast_lm_head_to_fp32=True is not supported with a LoRA adapter on lm_head"
    with pytest.raises(ValueError, match=cast):
        build_trainer(str(tmp_path / "no-such-model"), lora, cast_lm_head_to_fp32=True)
    with pytest.raises(ValueError, match=cast):
        build_trainer(get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), lora), cast_lm_head_to_fp32=True)
    tied = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model, tie_word_embeddings=True))
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    tied.save_pretrained(tmp_path / "tied")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "tied")
    refused_vllm = r"^use_vllm=True is not supported with a LoRA adapter on a head tied to the input embeddings"
    for model in (str(tmp_path / "tied"), get_peft_model(tied, lora)):
        with pytest.raises(ValueError, match=refused_vllm):
            build_trainer(model, lora, use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ValueError, match=r"^model type 'llama' is not supported with a LoRA adapter on its head set "
                                         r"with use_dora"):
        build_trainer(tiny_model, LoraConfig(r=4, target_modules=["lm_head"], use_dora=True))
    with pytest.raises(ValueError, match=r"Applying a PEFT adapter to `lm_head` is not supported"):
        build_trainer(tiny_model, IA3Config(target_modules=["lm_head", "down_proj"], feedforward_modules=["down_proj"]))
    real = grpo_trainer.BaseTunerLayer
    monkeypatch.setattr(patches, "TRL_LM_HEAD_REFUSAL", "a check this TRL does not have")
    with pytest.raises(RuntimeError, match=r"as written in TRL 1\.16; TRL \S+ no longer checks it the same way"):
        build_trainer(tiny_model, lora)
    assert grpo_trainer.BaseTunerLayer is real  # restored after each construction
