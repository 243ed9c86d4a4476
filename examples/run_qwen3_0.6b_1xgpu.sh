#!/usr/bin/env bash
# REINFORCE++ / REINFORCE++-baseline recipe for Qwen/Qwen3-0.6B on one GPU
# (spec: reinforce_pp_semantics.txt, sections "REINFORCE++" and "REINFORCE++-baseline").
#
#   bash examples/run_qwen3_0.6b_1xgpu.sh                                        # REINFORCE++
#   ESTIMATOR=reinforce_plus_plus_baseline bash examples/run_qwen3_0.6b_1xgpu.sh  # REINFORCE++-baseline
#   DRY_RUN=1 bash examples/run_qwen3_0.6b_1xgpu.sh                              # only print the command
#   bash examples/run_qwen3_0.6b_1xgpu.sh --learning_rate 5e-7                   # extra flags are appended
#
# The dataset must have a `prompt` column (a string or a list of chat messages) and an integer `answer` column
# (scored by the `exact_answer` reward; text after a GSM8K-style "####" is used). openai/gsm8k itself has
# `question`/`answer` columns, so prepare a local file first, e.g. a .jsonl with {"prompt": ..., "answer": ...},
# and pass it as DATASET=path/to/gsm8k_prompts.jsonl.
#
# Each optimizer step uses 4 prompts x 8 generations = 32 completions (8 per micro-batch x 4 accumulation
# steps, one generation batch per step, so the global advantage normalization covers all 32 completions).
set -euo pipefail

ESTIMATOR=${ESTIMATOR:-reinforce_plus_plus}
MODEL=${MODEL:-Qwen/Qwen3-0.6B}
DATASET=${DATASET:-openai/gsm8k}
DATASET_CONFIG=${DATASET_CONFIG:-main}
REWARD_FUNCS=${REWARD_FUNCS:-exact_answer}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/qwen3-0.6b-${ESTIMATOR}}
LEARNING_RATE=${LEARNING_RATE:-1e-6}
MAX_STEPS=${MAX_STEPS:-500}
DRY_RUN=${DRY_RUN:-0}

# Shared by both estimators: global token normalization, response-mean loss, no group-std scaling, no GRPO k3 KL.
COMMON=(
  --normalize_advantages true
  --loss_type grpo
  --scale_rewards none
  --beta 0.0
  --num_generations 8
)

case "${ESTIMATOR}" in
  reinforce_plus_plus)
    # k1 KL folded into the token reward, gamma 1, no separate KL loss (the spec's --kl-loss-type k1 is unused).
    RECIPE=(--gamma 1.0 --kl_coef 0.01 --use_kl_loss false --kl_loss_type k1)
    ;;
  reinforce_plus_plus_baseline)
    # Inclusive group-mean baseline over 8 samples per prompt; KL only as a separate k2 loss.
    RECIPE=(--kl_coef 0.0 --use_kl_loss true --kl_loss_type k2 --kl_loss_coef 0.01)
    ;;
  *)
    echo "ESTIMATOR must be reinforce_plus_plus or reinforce_plus_plus_baseline, got '${ESTIMATOR}'." >&2
    exit 2
    ;;
esac

DATASET_ARGS=(--dataset_name "${DATASET}")
# A Hub dataset may need a config name (gsm8k: "main"); a local file or directory does not.
if [[ ! -e "${DATASET}" && -n "${DATASET_CONFIG}" ]]; then
  DATASET_ARGS+=(--dataset_config "${DATASET_CONFIG}")
fi

CMD=(
  accelerate launch --num_processes 1 "$(dirname "$0")/rpp.py"
  --model_name_or_path "${MODEL}"
  "${DATASET_ARGS[@]}"
  --reward_funcs "${REWARD_FUNCS}"
  --output_dir "${OUTPUT_DIR}"
  --advantage_estimator "${ESTIMATOR}"
  "${COMMON[@]}"
  "${RECIPE[@]}"
  --bf16 true
  --max_completion_length 1024
  --per_device_train_batch_size 8
  --gradient_accumulation_steps 4
  --steps_per_generation 4
  --learning_rate "${LEARNING_RATE}"
  --max_steps "${MAX_STEPS}"
  --gradient_checkpointing true
  --logging_steps 1
  --save_steps 100
  --report_to "${REPORT_TO:-none}"
  "$@"
)

if [[ "${DRY_RUN}" == "1" ]]; then
  printf '%q ' "${CMD[@]}"
  printf '\n'
  exit 0
fi
exec "${CMD[@]}"
