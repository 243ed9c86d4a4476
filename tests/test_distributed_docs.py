"""docs/distributed.md, docs/vllm.md and examples/accelerate_configs/: every launch file loads with accelerate's own
reader and says what the docs say, and every command in the two pages parses: accelerate's launch flags with accelerate's parser,
the script's flags into `RPPConfig` and friends with the script's own parser, `vllm serve`'s flags with vLLM's, and
`trl-rpp vllm-serve`'s with its own, then the vLLM command it builds with vLLM's.
Every training command resolves to the one-GPU GSM8K recipe's settings (reward, estimator, chat template, lengths),
and the data preparation command the pages point to (docs/rpp_trainer.md) is the recipe's. Running the files for real, with the trainer, is
tests/test_engines.py (CPU, 2 processes)."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "examples" / "accelerate_configs"
DOC = REPO / "docs" / "distributed.md"
DOCS = (DOC, REPO / "docs" / "vllm.md")
PREPARE_DOC = REPO / "docs" / "rpp_trainer.md"
RECIPE = REPO / "examples" / "run_qwen3_0.6b_1xgpu.sh"
PREPARE = ["python", "-m", "trl_rpp.recipes.gsm8k"]
# What makes a run the recipe's: model, data, reward, estimator, chat template, lengths, per-device batch layout.
RECIPE_KEYS = (
    "model_name_or_path", "dataset_name", "reward_model_name_or_path", "reward_funcs", "advantage_estimator",
    "normalize_advantages", "gamma", "kl_coef", "use_kl_loss", "kl_loss_type", "kl_loss_coef", "num_generations",
    "loss_type", "scale_rewards", "beta", "epsilon", "epsilon_high", "temperature", "learning_rate",
    "chat_template_kwargs", "max_completion_length", "per_device_train_batch_size", "gradient_accumulation_steps",
    "steps_per_generation", "num_iterations", "bf16",
)


def doc_commands(docs=DOCS):
    """Each shell command of the pages' ```bash blocks, continuation lines joined, comments dropped."""
    blocks = [b for doc in docs for b in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S)]
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
    return commands


def test_launch_files_load_and_match_the_docs():
    from accelerate.commands.config.config_args import load_config_from_file

    want = {
        "ddp.yaml": ("MULTI_GPU", None, 1),
        "deepspeed_zero2.yaml": ("DEEPSPEED", 2, 1),
        "deepspeed_zero3.yaml": ("DEEPSPEED", 3, 1),
        "fsdp2.yaml": ("FSDP", None, 1),
        "multi_node_deepspeed_zero3.yaml": ("DEEPSPEED", 3, 2),
    }
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(want)
    for name, (engine, stage, machines) in want.items():
        config = load_config_from_file(str(CONFIGS / name))
        assert str(config.distributed_type).endswith(engine), (name, config.distributed_type)
        assert config.num_machines == machines and config.num_processes == 8 * machines
        assert name in DOC.read_text()
        if stage is not None:
            assert config.deepspeed_config["zero_stage"] == stage
            assert config.deepspeed_config.get("zero3_init_flag", False) == (stage == 3)
            # Trainer.save_model writes ZeRO-3 weights only with the 16-bit gather (tests/test_engines.py loads them).
            assert config.deepspeed_config.get("zero3_save_16bit_model", False) == (stage == 3)
        if engine == "FSDP":
            assert config.fsdp_config["fsdp_version"] == 2
            # ... and FSDP weights only with FULL_STATE_DICT (none at all with SHARDED_STATE_DICT).
            assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    multi = load_config_from_file(str(CONFIGS / "multi_node_deepspeed_zero3.yaml"))
    assert multi.machine_rank == 0 and multi.main_process_ip and multi.main_process_port


@pytest.fixture(scope="module")
def script_parser():
    # examples/rpp.py is the `trl-rpp` command as a script: both parse with `trl_rpp.cli.make_parser`.
    from trl_rpp.cli import make_parser

    return make_parser()


def test_every_command_in_the_docs_parses(script_parser):
    from accelerate.commands.launch import launch_command_parser

    commands = doc_commands()
    launches = [c for c in commands if "accelerate launch" in c]
    engines = {re.search(r"--config_file (\S+)", c).group(1) for c in launches if "--config_file" in c}
    assert engines == {f"examples/accelerate_configs/{n}" for n in ("deepspeed_zero3.yaml",
                                                                    "multi_node_deepspeed_zero3.yaml")}
    # The other launch files are named as drop-in `--config_file` values of the 8-GPU command.
    eight = DOC.read_text().split("**8 GPUs on one node**")[1].split("```")[0]
    for name in ("deepspeed_zero2.yaml", "fsdp2.yaml", "ddp.yaml"):
        assert f"`{name}`" in eight and (CONFIGS / name).is_file(), name
    assert any("--num_processes 1" in c for c in launches), "the 1-GPU command"
    assert sum("--machine_rank 0" in c for c in launches) == 1 and "`--machine_rank 1`" in DOC.read_text()
    assert any("vllm_mode colocate" in c for c in launches) and any("vllm_mode server" in c for c in launches)
    cpu_servers = 0
    for command in commands:
        argv = shlex.split(command)
        while "=" in argv[0]:  # leading VAR=value assignments
            argv = argv[1:]
        if argv[0] == "pip" or argv[:3] == PREPARE:  # the recipe's own command: test_commands_are_the_recipes
            continue
        if argv[:2] == ["trl-rpp", "vllm-serve"]:
            # The CPU server (tests/test_vllm_engine.py starts it as written and trains against it): the launcher's
            # parser, then vLLM's on the command it runs on a machine without CUDA (tests/test_serve.py has more).
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
            from vllm.utils.argparse_utils import FlexibleArgumentParser

            from trl_rpp.serve import parse, server

            opts, extra = parse(argv[2:], cuda=False)
            built = server(opts, extra, cuda=False)
            serve = make_arg_parser(FlexibleArgumentParser()).parse_args(built.argv[3:])
            assert serve.model and serve.tensor_parallel_size == 1 and serve.dtype == "float32", command
            assert serve.logprobs_mode == "processed_logprobs" and serve.max_logprobs == -1, command
            assert serve.weight_transfer_config is None and built.env["VLLM_SERVER_DEV_MODE"] == "1", command
            assert built.settings["vllm_server_weight_sync"] == "disk", command
            cpu_servers += 1
            continue
        if argv[:2] == ["vllm", "serve"]:
            # vLLM's own parser; the flags TRL's clients rely on (what TRL 1.16's deprecated `trl vllm-serve` adds)
            # and the ones score centering needs are all there.
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
            from vllm.utils.argparse_utils import FlexibleArgumentParser

            serve = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
            assert serve.model_tag and serve.tensor_parallel_size >= 1, command
            assert serve.logprobs_mode == "processed_logprobs" and serve.max_logprobs == -1, command
            assert serve.weight_transfer_config.backend == "nccl", command
            assert command.startswith("CUDA_VISIBLE_DEVICES=0,1 VLLM_SERVER_DEV_MODE=1 vllm serve"), command
            continue
        assert argv[:2] == ["accelerate", "launch"], command
        launch = launch_command_parser().parse_args(argv[2:])
        assert (REPO / launch.training_script).is_file(), launch.training_script
        if launch.config_file:
            assert (REPO / launch.config_file).is_file(), launch.config_file
        # `--use_cpu true` only so that `--bf16 true` passes TrainingArguments' device check on this CPU machine.
        _, config, _ = script_parser.parse_args_into_dataclasses([*launch.training_script_args, "--use_cpu", "true"])
        mode = re.search(r"--vllm_mode (\w+)", command)
        assert config.use_vllm == bool(mode) and (not mode or config.vllm_mode == mode.group(1)), command
    assert cpu_servers == 1, "docs/vllm.md's CPU server command"


def without_env(argv):
    """`argv` without its leading VAR=value assignments."""
    while argv and "=" in argv[0] and not argv[0].startswith("-"):
        argv = argv[1:]
    return argv


def recipe_commands(estimator):
    """The recipe's data preparation and training commands for `estimator`, as its dry run prints them (with
    PYTHON=true the dry run stops there, before resolving), split into argv lists."""
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "DATA_DIR", "OUTPUT_DIR", "LEARNING_RATE",
                                                          "MAX_STEPS", "MAX_COMPLETION_LENGTH", "GSM8K_SOURCE")}
    env.update(DRY_RUN="1", PYTHON="true", ESTIMATOR=estimator, THINKING="0")
    proc = subprocess.run(["bash", str(RECIPE)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    prepare, train = (shlex.split(line) for line in proc.stdout.splitlines()[:2])
    return prepare, train


def resolved(argv, parser):
    """The resolved configuration (the CLI's dry run) of an `accelerate launch` command."""
    from accelerate.commands.launch import launch_command_parser

    from trl_rpp.cli import resolved_configuration

    assert argv[:2] == ["accelerate", "launch"], argv
    launch = launch_command_parser().parse_args(argv[2:])
    # `--use_cpu true` only so that `--bf16 true` passes TrainingArguments' device check on this CPU machine.
    return resolved_configuration(*parser.parse_args_into_dataclasses([*launch.training_script_args, "--use_cpu",
                                                                       "true"]))


def test_commands_are_the_recipes(script_parser):
    """Every training command of the doc learns what the one-GPU recipe learns: the same reward, estimator
    settings, chat template arguments and lengths, for its estimator; its data is the recipe's preparation."""
    recipes = {est: recipe_commands(est) for est in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")}
    want = {est: resolved(train, script_parser) for est, (_, train) in recipes.items()}
    assert want["reinforce_plus_plus"]["reward_funcs"] == ["final_answer"]
    assert want["reinforce_plus_plus"]["chat_template_kwargs"] == {"enable_thinking": False}
    commands = [without_env(shlex.split(c)) for c in doc_commands()]
    launches = [argv for argv in commands if argv[:2] == ["accelerate", "launch"]]
    assert len(launches) == sum("examples/rpp.py" in c for c in doc_commands()) >= 5
    seen = set()
    for argv in launches:
        config = resolved(argv, script_parser)
        recipe = want[config["advantage_estimator"]]
        seen.add(config["advantage_estimator"])
        differ = {k: (config[k], recipe[k]) for k in RECIPE_KEYS if config[k] != recipe[k]}
        assert not differ, (shlex.join(argv), differ)
    assert seen == set(want), "both estimators have a command"
    (prepare,) = [argv for argv in (shlex.split(c) for c in doc_commands((PREPARE_DOC,))) if argv[:3] == PREPARE]
    assert "rpp_trainer.md#quick-start" in DOC.read_text()
    assert prepare[1:] == recipes["reinforce_plus_plus"][0][1:]  # the recipe's, with `python` for its PYTHON
