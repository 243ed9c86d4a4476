#!/usr/bin/env bash
# REINFORCE++ / REINFORCE++-baseline on GSM8K with Qwen/Qwen3-0.6B on one CUDA GPU. It needs a GPU (bf16, 1024-token
# completions) and the Hub (model and openai/gsm8k): it cannot run on a CPU-only or offline machine. UNTESTED: it has
# never trained. DRY_RUN=1, which tests/test_recipes.py runs, works anywhere: it prints both commands and the resolved
# configuration, and trains nothing.
#
#   bash examples/run_qwen3_0.6b_1xgpu.sh                                        # REINFORCE++
#   ESTIMATOR=reinforce_plus_plus_baseline bash examples/run_qwen3_0.6b_1xgpu.sh  # REINFORCE++-baseline
#   DRY_RUN=1 bash examples/run_qwen3_0.6b_1xgpu.sh                              # print, resolve, train nothing
#   THINKING=1 bash examples/run_qwen3_0.6b_1xgpu.sh                             # Qwen3 thinking mode on
#   bash examples/run_qwen3_0.6b_1xgpu.sh --learning_rate 5e-7                   # extra flags are appended
#
# Step 1 prepares GSM8K (trl_rpp/recipes/gsm8k.py): each `question` becomes a chat prompt asking for a \boxed{}
# answer, and `answer` becomes the number after its `####` line; train.jsonl and test.jsonl land in DATA_DIR (kept
# if already there). Step 2 trains with the `final_answer` reward: 1 when the completion's final answer (the last
# \boxed{}, else the `####` answer, else the last number, after any </think>) equals the reference.
# Thinking mode is set explicitly through the chat template (chat_template_kwargs.enable_thinking): off by default,
# so the 1024-token budget holds the whole solution; THINKING=1 turns it on and raises the budget to 4096.
#
# Each optimizer step uses 4 prompts x 8 generations = 32 completions (8 per micro-batch x 4 accumulation steps,
# one generation batch per step, so the global advantage normalization covers all 32 completions).
set -euo pipefail

ESTIMATOR=${ESTIMATOR:-reinforce_plus_plus}
MODEL=${MODEL:-Qwen/Qwen3-0.6B}
GSM8K_SOURCE=${GSM8K_SOURCE:-openai/gsm8k}
DATA_DIR=${DATA_DIR:-data/gsm8k}
THINKING=${THINKING:-0}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/qwen3-0.6b-${ESTIMATOR}}
LEARNING_RATE=${LEARNING_RATE:-1e-6}
MAX_STEPS=${MAX_STEPS:-500}
DRY_RUN=${DRY_RUN:-0}
PYTHON=${PYTHON:-python}

case "${THINKING}" in
  0) ENABLE_THINKING=false; MAX_COMPLETION_LENGTH=${MAX_COMPLETION_LENGTH:-1024} ;;
  1) ENABLE_THINKING=true; MAX_COMPLETION_LENGTH=${MAX_COMPLETION_LENGTH:-4096} ;;
  *) echo "THINKING must be 0 or 1, got '${THINKING}'." >&2; exit 2 ;;
esac

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
    # k1 KL folded into the token reward, gamma 1, no separate KL loss.
    RECIPE=(--gamma 1.0 --kl_coef 0.01 --use_kl_loss false)
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

PREPARE=("${PYTHON}" -m trl_rpp.recipes.gsm8k --source "${GSM8K_SOURCE}" --output_dir "${DATA_DIR}")

TRAIN_ARGS=(
  --model_name_or_path "${MODEL}"
  --dataset_name "${DATA_DIR}"
  --reward_funcs final_answer
  --chat_template_kwargs "{\"enable_thinking\": ${ENABLE_THINKING}}"
  --output_dir "${OUTPUT_DIR}"
  --advantage_estimator "${ESTIMATOR}"
  "${COMMON[@]}"
  "${RECIPE[@]}"
  --bf16 true
  --max_completion_length "${MAX_COMPLETION_LENGTH}"
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
TRAIN=(accelerate launch --num_processes 1 -m trl_rpp.cli "${TRAIN_ARGS[@]}")

if [[ "${DRY_RUN}" == "1" ]]; then
  printf '%q ' "${PREPARE[@]}"; printf '\n'
  printf '%q ' "${TRAIN[@]}"; printf '\n'
  exec "${PYTHON}" -m trl_rpp.cli "${TRAIN_ARGS[@]}" --dry_run
fi

if ! "${PYTHON}" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "This recipe needs a CUDA GPU (bf16, Qwen3-0.6B with 1024-token completions); none is visible." >&2
  echo "DRY_RUN=1 prints what it would run. For a CPU run, see the README's quick start or 'make demo'." >&2
  exit 1
fi
if [[ ! -f "${DATA_DIR}/train.jsonl" || ! -f "${DATA_DIR}/test.jsonl" ]]; then
  "${PREPARE[@]}"
fi
exec "${TRAIN[@]}"
