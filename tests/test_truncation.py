"""`trl_rpp.truncation`: log-probs renormalized over a sampler's kept support, against a float64 plain-loop
reference, by hand, and with values at masked positions and absent slots that must not matter."""

import math

import pytest
import torch

from trl_rpp.truncation import ABSENT, support_logps, support_logsumexp, token_in_support, truncated_logps


def ref_truncated_logps(logits, token_ids, support_ids, mask, temperature):
    """log pi(y | S) = z_y / tau - log sum_{v in S} exp(z_v / tau), float64, plain loops; 0.0 at masked positions."""
    out = []
    for b, row in enumerate(mask):
        out_row = []
        for t, m in enumerate(row):
            if not m:
                out_row.append(0.0)
                continue
            kept = [v for v in support_ids[b][t] if v != ABSENT]
            top = max(logits[b][t][v] / temperature for v in kept)
            lse = top + math.log(math.fsum(math.exp(logits[b][t][v] / temperature - top) for v in kept))
            out_row.append(logits[b][t][token_ids[b][t]] / temperature - lse)
        out.append(out_row)
    return out


def random_case(seed, B=3, T=5, V=11, K=4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3
    support = torch.full((B, T, K), ABSENT, dtype=torch.long)
    tokens = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            size = int(torch.randint(1, K + 1, (1,), generator=g))
            ids = torch.randperm(V, generator=g)[:size]
            slots = torch.randperm(K, generator=g)[:size]  # kept ids in any slots, holes anywhere
            support[b, t, slots] = ids
            tokens[b, t] = ids[int(torch.randint(0, size, (1,), generator=g))]
    mask = torch.rand(B, T, generator=g) > 0.3
    return logits, tokens, support, mask


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_the_float64_reference(seed, temperature):
    logits, tokens, support, mask = random_case(seed)
    got = truncated_logps(logits, tokens, support, mask, temperature)
    want = ref_truncated_logps(logits.tolist(), tokens.tolist(), support.tolist(), mask.tolist(), temperature)
    assert got.dtype == torch.float64 and got.shape == mask.shape  # float32 for float32 (or lower) logits
    assert truncated_logps(logits.float(), tokens, support, mask, temperature).dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    assert bool(token_in_support(tokens, support, mask).all())


def test_by_hand():
    """Logits (0, ln 2, ln 3, 5): the kept set {0, 1, 2} holds mass 1 + 2 + 3 = 6, so token 2 has log(3/6); a kept
    set of the token alone gives 0; the whole vocabulary gives log_softmax."""
    logits = torch.tensor([[[0.0, math.log(2), math.log(3), 5.0]] * 3])
    tokens = torch.tensor([[2, 2, 2]])
    support = torch.tensor([[[0, 1, 2, ABSENT], [ABSENT, ABSENT, 2, ABSENT], [0, 1, 2, 3]]])
    got = truncated_logps(logits, tokens, support, torch.ones(1, 3, dtype=torch.bool), 1.0)
    want = torch.tensor([[math.log(0.5), 0.0, float(torch.log_softmax(logits[0, 0], -1)[2])]])
    torch.testing.assert_close(got, want)
    # The temperature divides the logits before the renormalization: at tau = 0.5 the masses are 1, 4, 9.
    got = truncated_logps(logits[:, :1], tokens[:, :1], support[:, :1], torch.ones(1, 1), 0.5)
    torch.testing.assert_close(got, torch.tensor([[math.log(9 / 14)]]))


def test_values_at_masked_positions_and_absent_slots_never_change_a_result():
    logits, tokens, support, mask = random_case(7)
    clean = truncated_logps(logits, tokens, support, mask, 1.0)
    dirty_logits = logits.clone()
    dirty_logits[~mask] = float("nan")  # anything at a masked position
    other = torch.arange(logits.size(-1))
    for b, t in zip(*torch.nonzero(mask, as_tuple=True)):  # and at every id outside the kept set of a valid one
        outside = ~torch.isin(other, support[b, t])
        junk = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=logits.dtype).repeat(11)
        dirty_logits[b, t, outside] = junk[: int(outside.sum())]
    dirty_tokens = tokens.masked_fill(~mask, 10**6)  # out of range where masked: never read
    got = truncated_logps(dirty_logits, dirty_tokens.clamp(max=logits.size(-1) - 1), support, mask, 1.0)
    assert torch.equal(got, clean) and bool((got[~mask] == 0).all())


def test_support_logsumexp_of_an_empty_row_is_minus_inf_and_membership_is_checked():
    logits = torch.zeros(1, 2, 3)
    support = torch.tensor([[[0, 1], [ABSENT, ABSENT]]])
    lse = support_logsumexp(logits, support, 1.0)
    assert lse[0, 0] == pytest.approx(math.log(2)) and lse[0, 1] == float("-inf")
    inside = token_in_support(torch.tensor([[2, 0]]), support, torch.tensor([[True, False]]))
    assert inside.tolist() == [[False, True]]  # token 2 was not kept; the masked position is not checked


def test_gradient_flows_to_the_kept_logits_only():
    logits = torch.randn(1, 1, 6, requires_grad=True)
    support = torch.tensor([[[1, 4, ABSENT]]])
    truncated_logps(logits, torch.tensor([[4]]), support, torch.ones(1, 1), 1.0).sum().backward()
    grad = logits.grad[0, 0]
    assert grad[[0, 2, 3, 5]].abs().sum() == 0 and grad[[1, 4]].abs().sum() > 0
    q = torch.softmax(logits.detach()[0, 0, [1, 4]], -1)  # d/dz of z_4 - lse(z_1, z_4) = e_4 - q
    torch.testing.assert_close(grad[[1, 4]], torch.tensor([0.0, 1.0]) - q)


# --- the support a real `generate` kept ---------------------------------------------------------------------------


def kept_bounds(probs, top_k=None, top_p=None, min_p=None, slack=1e-4):
    """(surely kept, possibly kept) id sets of one position, from the definitions, in float64, each stage on what the
    one before kept, renormalized (transformers' order: top-k, top-p, min-p): top-k keeps the k most probable ids;
    top-p the shortest most-probable prefix holding at least top_p of the mass; min-p the ids with p >= min_p * max p.
    `slack` tightens (sure) or loosens (possibly) the top-p and min-p thresholds, so that float32 rounding at a
    boundary cannot flip this check's verdict."""

    def keep(direction):
        ids = sorted(range(len(probs)), key=lambda v: -probs[v])
        if top_k:
            ids = ids[:top_k]
        if top_p:
            mass, bound = math.fsum(probs[v] for v in ids), min(top_p * (1 + direction * slack), 1.0)
            total, prefix = 0.0, []
            for v in ids:
                prefix.append(v)
                total += probs[v] / mass
                if total >= bound:
                    break
            ids = prefix
        if min_p:
            top = max(probs[v] for v in ids)
            ids = [v for v in ids if probs[v] >= min_p * top * (1 - direction * slack)]
        return set(ids)

    return keep(-1), keep(+1)


@pytest.mark.parametrize("settings", [dict(top_k=5), dict(top_k=40, top_p=0.8), dict(top_k=40, min_p=0.1),
                                      dict(top_k=12, top_p=0.9, min_p=0.05, temperature=0.7)],
                         ids=["top_k", "top_p", "min_p", "combined"])
def test_the_capture_holds_what_generate_kept(tiny_model, settings):
    """A real `generate` with the capture last: at each generated position the recorded ids are the set the
    definitions keep from a separate forward pass's logits (up to float32 rounding at a boundary), and hold the
    sampled token."""
    from transformers import AutoModelForCausalLM

    from trl_rpp.records.capture import capturing_generate, SamplerSupportCapture
    from trl_rpp.truncation import support_of

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    temperature = settings.get("temperature", 1.0)
    torch.manual_seed(0)
    prompt = torch.tensor([[3, 4, 5], [6, 7, 8]])
    capture = SamplerSupportCapture(bound=40)
    with capturing_generate(model, capture, last=True):
        out = model.generate(input_ids=prompt, max_new_tokens=6, do_sample=True, pad_token_id=0, eos_token_id=None,
                             **{"top_k": 0, **settings, "temperature": temperature})
    assert "_get_logits_processor" not in model.__dict__ and "generate" not in model.__dict__  # restored
    new = out[:, prompt.size(1):]
    ids, logps, sampled = capture.tensors(new.size(1))
    support = support_of(ids, logps)
    assert support.shape == (2, new.size(1), 40)
    with torch.no_grad():
        logits = model(out).logits[:, prompt.size(1) - 1 : -1].double() / temperature
    probs = torch.softmax(logits, -1)
    mask = torch.ones_like(new, dtype=torch.bool)
    assert bool(token_in_support(new, support, mask).all())
    # The recorded log-probs are log q_S: the full softmax renormalized over the kept set, and the sampled token's
    # is its entry there.
    want = truncated_logps(logits, new, support, mask, 1.0)
    torch.testing.assert_close(sampled.double(), want, rtol=0, atol=1e-5)
    inside = support != ABSENT
    torch.testing.assert_close(logps[inside].double(), support_logps(logits, support, support, 1.0)[inside],
                               rtol=0, atol=1e-5)
    knobs = {k: settings.get(k) for k in ("top_k", "top_p", "min_p")}
    for b in range(new.size(0)):
        for t in range(new.size(1)):
            kept = {v for v in support[b, t].tolist() if v != ABSENT}
            sure, maybe = kept_bounds(probs[b, t].tolist(), **knobs)
            assert sure <= kept <= maybe, (b, t, sorted(kept), sorted(sure), sorted(maybe))
            assert 1 <= len(kept) < probs.size(-1)  # each setting truncated something here


def test_a_kept_set_larger_than_the_record_is_cut_to_it_and_sampled_from_it(tiny_model):
    """top_k=10 keeps 10 ids, a 3-wide record holds 3: the capture, last after the warpers, leaves only the recorded
    ids finite, so every token is drawn from the recorded set and its log q_S is renormalized over those 3 (the
    replay's set), and the positions that overflowed are counted."""
    from transformers import AutoModelForCausalLM

    from trl_rpp.records.capture import capturing_generate, SamplerSupportCapture
    from trl_rpp.truncation import support_of

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompt = torch.tensor([[3, 4]] * 8)
    torch.manual_seed(0)
    capture = SamplerSupportCapture(bound=3)
    with capturing_generate(model, capture, last=True):
        out = model.generate(input_ids=prompt, max_new_tokens=2, do_sample=True, top_k=10, pad_token_id=0,
                             eos_token_id=None)
    new = out[:, 2:]
    ids, logps, sampled = capture.tensors(2)
    support = support_of(ids, logps)
    assert int(capture.overflowed) == 8 * 2
    assert bool(token_in_support(new, support, torch.ones_like(new, dtype=torch.bool)).all())
    with torch.no_grad():
        logits = model(out).logits[:, 1:-1].double()
    top3 = logits.topk(3, dim=-1).indices
    assert torch.equal(support.sort(-1).values, top3.sort(-1).values)  # the 3 most probable of the 10 kept
    want = truncated_logps(logits, new, support, torch.ones_like(new, dtype=torch.bool), 1.0)
    torch.testing.assert_close(sampled.double(), want, rtol=0, atol=1e-5)


def test_ties_at_the_kth_score_fit_in_the_record(tiny_model):
    """`top_k` keeps every token tied with its k-th score: three tied scores at top_k=2 keep three tokens. The record
    (`record_width(2)` = 4 ids) holds them, each at log q_S = log(1/3); a top_k-wide record could not."""
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from trl_rpp.records.settings import record_width
    from trl_rpp.records.capture import capturing_generate, SamplerSupportCapture
    from trl_rpp.truncation import support_of

    class Tied(LogitsProcessor):  # runs before the warpers: ids 5, 6, 7 tie, 8 is next
        def __call__(self, input_ids, scores):
            scores = torch.full_like(scores, -30.0)
            scores[:, [5, 6, 7]], scores[:, 8] = 1.0, 0.5
            return scores

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for bound, fits in ((record_width(2), True), (2, False)):
        torch.manual_seed(0)
        capture = SamplerSupportCapture(bound=bound)
        with capturing_generate(model, capture, last=True):
            out = model.generate(input_ids=torch.tensor([[3, 4]] * 16), max_new_tokens=3, do_sample=True, top_k=2,
                                 pad_token_id=0, eos_token_id=None, logits_processor=LogitsProcessorList([Tied()]))
        ids, logps, sampled = capture.tensors(3)
        kept = support_of(ids, logps)
        sets = {tuple(sorted(v for v in row if v != ABSENT)) for row in kept.flatten(0, 1).tolist()}
        drawn = set(out[:, 2:].flatten().tolist())
        assert int(capture.overflowed) == (0 if fits else 16 * 3)
        if fits:  # the whole tie, each at log q_S = log(1/3)
            assert sets == {(5, 6, 7)} and drawn == {5, 6, 7}
            torch.testing.assert_close(sampled.double(), torch.full((16, 3), math.log(1 / 3), dtype=torch.float64),
                                       rtol=0, atol=1e-6)
        else:  # cut to the 2 recorded ids, drawn from them alone at log(1/2)
            (pair,) = sets
            assert len(pair) == 2 and set(pair) < {5, 6, 7} and drawn == set(pair)
            torch.testing.assert_close(sampled.double(), torch.full((16, 3), math.log(1 / 2), dtype=torch.float64),
                                       rtol=0, atol=1e-6)


def test_the_capture_runs_inside_a_peft_model(tiny_model):
    """`PeftModel.generate` generates with its base model, which builds its logits processors itself: the capture is
    wrapped there, records every step, and both objects are left as they were."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_rpp.records.capture import capturing_generate, SamplerSupportCapture
    from trl_rpp.truncation import support_of

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    capture = SamplerSupportCapture(bound=8)
    torch.manual_seed(0)
    with capturing_generate(model, capture, last=True):
        out = model.generate(input_ids=torch.tensor([[3, 4], [5, 6]]), max_new_tokens=3, do_sample=True, top_k=4,
                             pad_token_id=0, eos_token_id=None)
    for obj in (model, model.get_base_model()):
        assert "_get_logits_processor" not in obj.__dict__ and "generate" not in obj.__dict__
    ids, logps, sampled = capture.tensors(3)
    support = support_of(ids, logps)
    assert ((support != ABSENT).sum(-1) == 4).all()  # top_k=4 kept 4 ids at every step
    assert bool(token_in_support(out[:, 2:], support, torch.ones(2, 3, dtype=torch.bool)).all())
    assert bool(torch.isfinite(sampled).all())


def test_a_generate_that_bypasses_the_capture_is_named(tiny_model):
    """A wrapper whose `generate` runs another object's (as PEFT's does) is caught when generation returns: the error
    names the capture and the wrapper, never a feature that is off."""
    from transformers import AutoModelForCausalLM

    from trl_rpp.records.capture import capturing_generate, SamplerSupportCapture

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self._get_logits_processor = inner._get_logits_processor

        def generate(self, **kwargs):
            return self.inner.generate(**kwargs)

    model = Wrapper(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval())
    capture = SamplerSupportCapture(bound=8)
    with pytest.raises(RuntimeError, match=r"^SamplerSupportCapture: Wrapper\.generate returned without building its "
                                           r"logits processors through Wrapper\._get_logits_processor"):
        with capturing_generate(model, capture, last=True):
            model.generate(input_ids=torch.tensor([[3, 4]]), max_new_tokens=2, do_sample=True, top_k=4, pad_token_id=0)
    with pytest.raises(RuntimeError, match=r"^SamplerSupportCapture \(the kept sets of a truncating sampler, for "
                                           r"replay\) recorded no generation step"):
        capture.tensors(2)


def test_a_models_own_sampling_defaults_are_named_when_the_sampler_does_not_use_them(tmp_path, tiny_model):
    """transformers 5 applies none of a model's sampling defaults once TRL passes its generation config (checked
    here through the processors `generate` builds), and the trainer says so, naming each one."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from trl_rpp.records.settings import overridden_model_sampling

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    model.generation_config.update(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    built = []
    original = model._get_logits_processor
    model._get_logits_processor = lambda *a, **k: built.append(original(*a, **k)) or built[-1]
    trl_like = GenerationConfig(max_new_tokens=1, do_sample=True, pad_token_id=0, temperature=1.0, top_p=1.0, top_k=0,
                                min_p=None, repetition_penalty=1.0)
    model.generate(torch.tensor([[3, 4]]), generation_config=trl_like)
    assert len(built[0]) == 0  # no temperature, top-k or top-p warper: the model's defaults are not applied
    used = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)
    assert overridden_model_sampling(model.generation_config.to_dict(), used) == {
        "temperature": (0.6, 1.0), "top_k": (20, 0), "top_p": (0.95, 1.0)}
    assert overridden_model_sampling(model.generation_config.to_dict(), dict(used, temperature=0.6, top_k=20,
                                                                             top_p=0.95)) == {}
    assert overridden_model_sampling(GenerationConfig().to_dict(), used) == {}

    from trl_rpp import RPPConfig, RPPTrainer
    from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

    path = tmp_path / "qwen3_like"
    model.save_pretrained(path)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    args = RPPConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", max_steps=1, num_generations=4,
                     per_device_train_batch_size=4)
    with pytest.warns(UserWarning, match=r"^The model's generation config sets temperature=0\.6, top_k=20, "
                                         r"top_p=0\.95; the sampler uses RPPConfig's temperature=1\.0, top_k=0, "
                                         r"top_p=1\.0 instead"):
        RPPTrainer(model=str(path), reward_funcs=copy_first_char_reward, args=args,
                   train_dataset=copy_task_dataset(8))
