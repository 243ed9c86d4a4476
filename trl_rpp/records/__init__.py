"""The sampler's records: what the sampler kept and how likely it was, captured where it samples and read by the loss.

- `generation`: one generation batch's record, made when the batch is sampled and carried with it;
- `settings`: which generation settings a record describes exactly, and the bound of a truncation's kept sets;
- `capture`: the record inside transformers' `generate` (score centering's top-k, a truncation's kept sets);
- `vllm`: the same record parsed from vLLM's log-prob lists;
- `multi_turn`: the record at the model tokens of multi-turn completions, and their external-token masks checked;
- `replay`: log-probs over the recorded kept sets, read by every forward of the trainer;
- `head`: the LM head read from the final hidden states, with or without a LoRA adapter on it.

They use the pure tensor functions (`trl_rpp.truncation`, `trl_rpp.lm_head`) and reach into transformers, PEFT and
TRL only through `trl_rpp.patches`.
"""
