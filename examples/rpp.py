"""Train a causal LM with REINFORCE++ / REINFORCE++-baseline: the `trl-rpp` command, as a script.

    accelerate launch examples/rpp.py --model_name_or_path Qwen/Qwen3-0.6B --dataset_name data/gsm8k \
        --reward_funcs final_answer --advantage_estimator reinforce_plus_plus_baseline --output_dir outputs/qwen3-rpp

Same flags and behaviour as the installed `trl-rpp` command; see `trl_rpp/cli.py` or `python examples/rpp.py --help`.
"""

import sys

from trl_rpp.cli import main

if __name__ == "__main__":
    sys.exit(main())
