"""Every two-process trainer case of the tests in one `accelerate launch --multi_gpu --num_processes 2` (gloo on
CPU), run by the session fixture `two_process_runs` (tests/conftest.py): the processes start, import and join the
process group once, where one launch per case would pay that each time. Each part writes what its test reads under
OUTDIR/<part>/; the parts run one after the other in both processes.

    two_process_script.py OUTDIR MODEL EOS_MODEL

- trainer: tests/dist_trainer_script.py's cases (tests/test_trainer_distributed.py);
- grad_guard_skip, grad_guard_stop: tests/grad_guard_script.py (tests/test_grad_guard.py);
- multi_turn: tests/multi_turn_script.py (tests/test_multi_turn.py).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_trainer_script  # noqa: E402
import grad_guard_script  # noqa: E402
import multi_turn_script  # noqa: E402
from trainer_helpers import finish_launched  # noqa: E402

# grad_guard_stop last: its training ends in NonFiniteGradientError on both processes (caught and recorded).
PARTS = {
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
