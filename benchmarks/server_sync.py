"""The weight sync's share of a step: a vLLM server synced through a directory (`vllm_server_weight_sync="disk"`)
side by side with a colocated engine (synced by `reload_weights` in the process), in one run.

    python benchmarks/server_sync.py --model SmolLM2        # the offline SmolLM2-135M-Instruct, float32
    python benchmarks/server_sync.py                        # a tiny Llama

The benchmark starts the server with docs/vllm.md's CPU command, `trl-rpp vllm-serve` (dev mode, float32). Both arms
train REINFORCE++ on the same batch with a negligible learning rate and alternate round by round (`--rounds` x
`--steps`, the first step of every round dropped as warm-up), so machine noise hits them alike. Step time:
`on_step_begin` to `on_step_end` (generation, scoring, loss, optimizer step, and the sync). Sync time: TRL's
`sync_weights` call, every process's gather included; for the server the probe, the write, its reload and the
prefix-cache reset.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time import StepTimer  # noqa: E402  (sets the offline environment)

import torch  # noqa: E402

from trl_rpp import RPPConfig, RPPTrainer  # noqa: E402
from trl_rpp.testing.tiny import build_tiny_model, copy_first_char_reward, copy_task_dataset  # noqa: E402
from trl_rpp.testing.vllm_server import free_port, server_command, start_server, stop_server  # noqa: E402


def make_trainer(arm, model, opts, outdir, url):
    mode = dict(vllm_mode="colocate", vllm_dtype="float32", vllm_gpu_memory_utilization=0.1,
                vllm_max_model_length=opts.max_len) if arm == "colocate" else dict(
        vllm_mode="server", vllm_server_base_url=url, vllm_server_weight_sync="disk",
        vllm_server_weight_dir=os.path.join(outdir, "weights"))
    args = RPPConfig(output_dir=os.path.join(outdir, arm), report_to="none", use_cpu=True, bf16=False,
                     per_device_train_batch_size=opts.batch, num_generations=opts.num_generations,
                     max_completion_length=opts.completion_length, max_steps=opts.steps, learning_rate=1e-7,
                     save_strategy="no", logging_steps=1, disable_dropout=True, seed=0, use_vllm=True,
                     vllm_importance_sampling_mode="token_truncate", **mode)
    timer = StepTimer()
    trainer = RPPTrainer(model=model, reward_funcs=copy_first_char_reward, args=args,
                         train_dataset=copy_task_dataset(100000), callbacks=[timer])
    sync, timer.syncs = trainer.vllm_generation.sync_weights, []

    def timed_sync():
        start = time.perf_counter()
        sync()
        timer.syncs.append(time.perf_counter() - start)

    trainer.vllm_generation.sync_weights = timed_sync
    return trainer, timer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="a model folder, or SmolLM2 (the offline SmolLM2-135M-Instruct)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--completion_length", type=int, default=32)
    p.add_argument("--max_len", type=int, default=128, help="the server's context, within the model's positions (the "
                   "default tiny Llama has 128)")
    p.add_argument("--threads", type=int, default=1)
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    if opts.model == "SmolLM2":
        from trl_rpp.testing.assets import smollm2_path

        opts.model = str(smollm2_path())
    with tempfile.TemporaryDirectory() as tmp:
        model = opts.model or build_tiny_model(os.path.join(tmp, "model"), hidden_size=256, num_layers=4, num_heads=4)
        port = free_port()
        log = open(os.path.join(tmp, "server.log"), "w")
        cmd = server_command(model, port, max_model_len=opts.max_len, weight_dir=os.path.join(tmp, "weights"))
        server = start_server(cmd, f"http://127.0.0.1:{port}", log)
        try:
            arms = {arm: make_trainer(arm, model, opts, tmp, f"http://127.0.0.1:{port}")
                    for arm in ("colocate", "server_disk")}
            for _ in range(opts.rounds):
                for trainer, timer in arms.values():
                    before = len(timer.times), len(timer.syncs)
                    trainer.train()
                    del timer.times[before[0]], timer.syncs[before[1]]  # this round's warm-up step
            size = os.path.getsize(os.path.join(tmp, "weights", "weights", "model.safetensors"))
        finally:
            stop_server(server)
    print(f"{opts.model or 'tiny Llama hidden=256 x4 layers'}, float32, batch {opts.batch} = "
          f"{opts.batch // opts.num_generations} prompts x {opts.num_generations}, completion <= "
          f"{opts.completion_length}, threads {opts.threads}, {opts.rounds} rounds x {opts.steps - 1} timed steps per "
          f"arm; weights file {size / 2**20:.0f} MiB\n")
    print("| arm | median step (s) | median sync (s) | sync / step |")
    print("|---|---|---|---|")
    for arm, (_, timer) in arms.items():
        step, sync = statistics.median(timer.times), statistics.median(timer.syncs)
        print(f"| {arm} | {step:.3f} | {sync:.3f} | {sync / step:.2f} |")


if __name__ == "__main__":
    main()
