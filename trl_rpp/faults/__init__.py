"""Faults: what happens when something a run depends on fails, named truly and raised alike on every process.

- `inputs`: datasets that cannot train, refused before any model is loaded;
- `rewards`: reward functions that return non-finite values, raise or hang;
- `engine`: a vLLM engine or server that fails during generation;
- `gradients`: non-finite gradient norms, whose optimizer step is skipped;
- `checkpoint`: the generation buffer saved and loaded with a checkpoint, and torn or damaged checkpoints;
- `preemption`: SIGTERM or SIGUSR1, answered with a checkpoint and a clean stop.
"""
