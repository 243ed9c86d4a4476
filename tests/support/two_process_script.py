"""Every two-process trainer case of the tests in one `accelerate launch --multi_gpu --num_processes 2` (gloo on
CPU), run by the session fixture `two_process_runs` (tests/conftest.py): the processes start, import and join the
process group once, where one launch per case would pay that each time. Each part writes what its test reads under
OUTDIR/<part>/; the parts run one after the other in both processes.

    two_process_script.py OUTDIR MODEL EOS_MODEL

- trainer: tests/support/dist_trainer_script.py's cases (tests/test_trainer_distributed.py);
- grad_guard_skip, grad_guard_stop: tests/support/grad_guard_script.py (tests/test_grad_guard.py);
- multi_turn: tests/support/multi_turn_script.py (tests/test_multi_turn.py);
- server_unreachable: `server_unreachable` below (tests/test_server_sync.py).
"""

import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_trainer_script  # noqa: E402
import grad_guard_script  # noqa: E402
import multi_turn_script  # noqa: E402
from trainer_helpers import finish_launched, length_reward, make_args  # noqa: E402


def server_unreachable(outdir, model_path):
    """Each process builds a trainer whose vLLM server (`vllm_server_weight_sync="disk"`) refuses every connection:
    what it raised, and how long after the start of the construction. The port is bound but not listening."""
    from pathlib import Path

    from trl_rpp import RPPTrainer
    from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        args = make_args(Path(outdir), "reinforce_plus_plus", use_vllm=True, vllm_mode="server",
                         vllm_server_base_url=f"http://127.0.0.1:{held.getsockname()[1]}", vllm_server_timeout=1.0,
                         vllm_server_weight_sync="disk", vllm_server_weight_dir=os.path.join(outdir, "weights"))
        start = time.monotonic()
        try:
            RPPTrainer(model=model_path, reward_funcs=[copy_first_char_reward, length_reward], args=args,
                       train_dataset=copy_task_dataset(16))
            result = {"type": None}
        except Exception as err:
            result = {"type": type(err).__name__, "error": str(err), "status": getattr(err, "status", None)}
    result.update(seconds=time.monotonic() - start, processes=args.world_size)
    with open(os.path.join(outdir, f"rank{args.process_index}.json"), "w") as f:
        json.dump(result, f)

# grad_guard_stop last: its training ends in NonFiniteGradientError on both processes (caught and recorded).
PARTS = {
    "server_unreachable": lambda out, model, eos: server_unreachable(out, model),
    "trainer": lambda out, model, eos: dist_trainer_script.main(out, model, eos, *dist_trainer_script.CASES),
    "grad_guard_skip": lambda out, model, eos: grad_guard_script.main(out, model, "skip"),
    "multi_turn": lambda out, model, eos: multi_turn_script.main(out, model),
    "grad_guard_stop": lambda out, model, eos: grad_guard_script.main(out, model, "stop"),
}


def main(outdir, model_path, eos_model_path):
    for name, run in PARTS.items():
        out = os.path.join(outdir, name)
        os.makedirs(out, exist_ok=True)
        run(out, model_path, eos_model_path)
        print(f"part {name} done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
    finish_launched(sys.argv[1])
