#!/usr/bin/env bash
# Fine-tune on one GLUE task with one method, with fairseq's published RoBERTa GLUE
# hyper-parameters (examples/roberta/README.glue.md and config/finetuning/*.yaml).
#
# Usage: scripts/glue/train.sh TASK METHOD [extra fairseq-train args...] [--dry-run]
#
#   TASK    CoLA SST-2 MRPC STS-B QQP MNLI QNLI RTE (case, '-' and '_' do not matter)
#   METHOD  ce                fairseq's sentence_prediction criterion (the baseline), run by
#                             --task acl_sentence_prediction: fairseq's own training step,
#                             plus the plugin's checks of --num-classes, data and checkpoint
#           ce_scl            CE + supervised contrastive loss (Gunel et al.)
#           acl               CE + ACL-Embed, ACL-Grad on (--criterion acl_embed)
#           multi_exit_joint  two stages: ce (SAVE_DIR/stage1), then the multi-exit model
#                             restored from stage 1's best checkpoint trained with joint
#                             weighted CE over the exits (--criterion multi_exit_ce,
#                             SAVE_DIR/stage2)
#           acl_cl            two stages: acl (SAVE_DIR/stage1), then the multi-exit model
#                             restored from stage 1's best checkpoint trained with
#                             --criterion acl_cross_layer (SAVE_DIR/stage2)
#         The two multi-exit methods get equal budgets: the same stage 1 recipe (ce or acl,
#         on the multi-exit model with --exit-layers none) and the same number of updates in
#         stage 2.
#
# Extra arguments go to fairseq-train after the recipe's own (so they override them), e.g.
# --contrastive-lambda 0.3 --temperature 0.1 --update-freq 2 --exit-layers 4,8. In the two-stage
# methods they go to both stages; STAGE2_ARGS adds arguments to stage 2 only (e.g.
# --freeze-backbone).
# --dry-run (or DRY_RUN=1) prints the fairseq-train command(s) and runs nothing.
#
# Environment:
#   DATA_DIR      folder with TASK-bin/ from acl-fairseq-prepare (default: glue-bin)
#   PRETRAINED    fairseq RoBERTa model.pt (roberta.base, or OUTDIR/model.pt of
#                 acl-fairseq-convert-bert); required. 'none' trains from scratch (tests).
#   ARCH_ARGS     model flags (default: --arch roberta_base); for a converted BERT the contents
#                 of OUTDIR/fairseq_args.txt. Multi-exit methods switch the --arch value
#                 roberta -> multi_exit_roberta, roberta_base -> multi_exit_roberta_base,
#                 roberta_large -> multi_exit_roberta_large.
#   SAVE_DIR      checkpoint folder (default: checkpoints/TASK-METHOD)
#   SEED          random seed (default: 1)
#   FP16          1: --fp16 --fp16-init-scale 4 --threshold-loss-scale 1 --fp16-scale-window 128
#                 0: fp32. Default: 1 when a CUDA GPU is visible and --cpu is not given.
#                 For bf16 mixed precision (GPU or CPU): FP16=0 and the extra argument
#                 --autocast bf16 (fairseq's own --bf16 means TPU).
#   USER_DIR      the plugin (default: this repository's acl_fairseq)
#   STAGE2_ARGS   extra arguments for stage 2 of multi_exit_joint and acl_cl only
#   FAIRSEQ_TRAIN the fairseq-train executable (default: fairseq-train on PATH)
#   PYTHON        Python used to look for a GPU (default: the one next to fairseq-train)
set -euo pipefail

PROG=${0##*/}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

die() {
  echo "$PROG: error: $*" >&2
  exit 2
}

warn() {
  echo "$PROG: warning: $*" >&2
}

if [[ $# -ge 1 && ($1 == -h || $1 == --help) ]]; then
  usage
  exit 0
fi
if [[ $# -lt 2 ]]; then
  usage >&2
  die "expected TASK and METHOD"
fi
TASK_ARG=$1
METHOD=$2
shift 2

# ------------------------------------------------------------------ per-task settings
# lr / batch size / total updates / warmup updates: fairseq's RoBERTa GLUE table
# (acl_fairseq.experiment.recipe.GLUE_RECIPES).
METRIC_FLAGS=()
BEST_METRIC=accuracy
MAXIMIZE=1
REGRESSION=0
VALID_SUBSET=valid
task_key=$(printf '%s' "$TASK_ARG" | tr '[:upper:]' '[:lower:]' | tr -d '_-')
case $task_key in
  mnli) TASK=MNLI LR=1e-05 BSZ=32 UPDATES=123873 WARMUP=7432 NUM_CLASSES=3
    VALID_SUBSET=valid,valid1 ;; # valid = matched, valid1 = mismatched
  qnli) TASK=QNLI LR=1e-05 BSZ=32 UPDATES=33112 WARMUP=1986 NUM_CLASSES=2 ;;
  qqp) TASK=QQP LR=1e-05 BSZ=32 UPDATES=113272 WARMUP=28318 NUM_CLASSES=2
    METRIC_FLAGS=(--report-acc-and-f1) BEST_METRIC=acc_and_f1 ;;
  rte) TASK=RTE LR=2e-05 BSZ=16 UPDATES=2036 WARMUP=122 NUM_CLASSES=2 ;;
  sst2) TASK=SST-2 LR=1e-05 BSZ=32 UPDATES=20935 WARMUP=1256 NUM_CLASSES=2 ;;
  mrpc) TASK=MRPC LR=1e-05 BSZ=16 UPDATES=2296 WARMUP=137 NUM_CLASSES=2
    METRIC_FLAGS=(--report-acc-and-f1) BEST_METRIC=acc_and_f1 ;;
  cola) TASK=CoLA LR=1e-05 BSZ=16 UPDATES=5336 WARMUP=320 NUM_CLASSES=2
    METRIC_FLAGS=(--report-mcc) BEST_METRIC=mcc ;;
  stsb) TASK=STS-B LR=2e-05 BSZ=16 UPDATES=3598 WARMUP=214 NUM_CLASSES=1
    METRIC_FLAGS=(--regression-target --report-pearson-and-spearman) BEST_METRIC=loss
    MAXIMIZE=0 REGRESSION=1 ;;
  *) die "unknown task '$TASK_ARG'; expected one of CoLA SST-2 MRPC STS-B QQP MNLI QNLI RTE" ;;
esac

# ------------------------------------------------------------------ per-method settings
# FS_TASK, CRITERION: the (first) stage; STAGE2_CRITERION: the multi-exit stage 2, if any
STAGE2_CRITERION=
case $METHOD in
  ce) FS_TASK=acl_sentence_prediction CRITERION=sentence_prediction ;;
  ce_scl) FS_TASK=acl_sentence_prediction CRITERION=ce_scl ;;
  acl) FS_TASK=acl_sentence_prediction CRITERION=acl_embed ;;
  multi_exit_joint)
    FS_TASK=acl_sentence_prediction CRITERION=sentence_prediction STAGE2_CRITERION=multi_exit_ce
    ;;
  acl_cl) FS_TASK=acl_sentence_prediction CRITERION=acl_embed STAGE2_CRITERION=acl_cross_layer ;;
  *) die "unknown method '$METHOD'; expected one of ce ce_scl acl multi_exit_joint acl_cl" ;;
esac
if [[ $REGRESSION == 1 && $METHOD != ce ]]; then
  die "$TASK is a regression task (--regression-target) and method '$METHOD' uses a" \
    "classification criterion (contrastive losses and per-exit CE need class labels); use" \
    "method 'ce' for $TASK"
fi

# ------------------------------------------------------------------ arguments
DRY_RUN=${DRY_RUN:-0}
[[ $DRY_RUN == 0 || $DRY_RUN == 1 ]] || die "DRY_RUN must be 0 or 1, got '$DRY_RUN'"
EXTRA=()
CPU=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY_RUN=1 ;;
    --cpu) CPU=1 EXTRA+=("$arg") ;;
    *) EXTRA+=("$arg") ;;
  esac
done
STAGE2_EXTRA=()
read -r -a STAGE2_EXTRA <<<"${STAGE2_ARGS:-}"
ARCH=()
read -r -a ARCH <<<"${ARCH_ARGS:---arch roberta_base}"

# problems with files: errors, except in a dry run, which only warns
problem() {
  if [[ $DRY_RUN == 1 ]]; then
    warn "$* (dry run: continuing)"
  else
    die "$*"
  fi
}

DATA_DIR=${DATA_DIR:-glue-bin}
DATA="$DATA_DIR/$TASK-bin"
if [[ ! -d $DATA ]]; then
  problem "$DATA not found: set DATA_DIR to the --out-dir of acl-fairseq-prepare" \
    "(it holds $TASK-bin/)"
elif [[ ! -d $DATA/input0 ]]; then
  problem "$DATA has no input0/: not binarized data from acl-fairseq-prepare"
else
  meta="$DATA/prepare_glue.json"
  if [[ -f $meta ]]; then
    n=$(sed -n 's/.*"num_classes": *\([0-9][0-9]*\).*/\1/p' "$meta" | head -n 1)
    if [[ -n $n && $n != "$NUM_CLASSES" ]]; then
      die "$meta says num_classes $n but $TASK has $NUM_CLASSES: is $DATA really $TASK?"
    fi
  fi
  if [[ $TASK == MNLI && ! -f $DATA/input0/valid1.idx ]]; then
    warn "$DATA/input0/valid1.* (MNLI mismatched) not found: validating on valid only"
    VALID_SUBSET=valid
  fi
fi

[[ -n ${PRETRAINED:-} ]] || die "PRETRAINED is not set: point it to a fairseq RoBERTa" \
  "model.pt (roberta.base/model.pt, or OUTDIR/model.pt written by" \
  "acl-fairseq-convert-bert); PRETRAINED=none trains from scratch (for tests only)"
RESTORE=()
if [[ $PRETRAINED == none ]]; then
  warn "PRETRAINED=none: training from randomly initialised weights (for tests only)"
else
  [[ -f $PRETRAINED ]] || problem "PRETRAINED=$PRETRAINED: no such file (expected a" \
    "fairseq model.pt)"
  RESTORE=(--restore-file "$PRETRAINED")
fi

USER_DIR=${USER_DIR:-$REPO/acl_fairseq}
[[ -d $USER_DIR ]] || die "USER_DIR=$USER_DIR is not a directory (the acl_fairseq package)"
SAVE_DIR=${SAVE_DIR:-checkpoints/$TASK-$METHOD}
SEED=${SEED:-1}
FAIRSEQ_TRAIN=${FAIRSEQ_TRAIN:-fairseq-train}

if [[ -z ${FP16:-} ]]; then
  FP16=0
  if [[ $CPU == 0 ]]; then
    fairseq_bin=$(command -v "$FAIRSEQ_TRAIN" || true)
    python=${PYTHON:-}
    if [[ -z $python && -n $fairseq_bin && -x $(dirname "$fairseq_bin")/python ]]; then
      python=$(dirname "$fairseq_bin")/python
    fi
    if "${python:-python3}" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' \
      2>/dev/null; then
      FP16=1
    else
      warn "no CUDA GPU visible: training in fp32 (FP16=1 forces fp16)"
    fi
  fi
fi
FP16_FLAGS=()
case $FP16 in
  1) FP16_FLAGS=(--fp16 --fp16-init-scale 4 --threshold-loss-scale 1 --fp16-scale-window 128) ;;
  0) ;;
  *) die "FP16 must be 0 or 1, got '$FP16'" ;;
esac
if [[ $FP16 == 1 && $CPU == 1 ]]; then
  die "--cpu with FP16=1: fp16 training needs a GPU"
fi

MAXIMIZE_FLAGS=()
if [[ $MAXIMIZE == 1 ]]; then
  MAXIMIZE_FLAGS=(--maximize-best-checkpoint-metric)
fi

# multi_exit_arch ARGS...: prints ARGS (one per line) with the --arch value made multi-exit
multi_exit_arch() {
  local prev="" arg value
  for arg in "$@"; do
    value=""
    if [[ $prev == --arch || $prev == -a ]]; then
      value=$arg
    elif [[ $arg == --arch=* ]]; then
      value=${arg#--arch=}
    fi
    if [[ -n $value ]]; then
      case $value in
        roberta | roberta_base | roberta_large) value=multi_exit_$value ;;
        multi_exit_roberta*) ;;
        *) die "--arch $value has no multi-exit variant (use roberta, roberta_base or" \
          "roberta_large, or a multi_exit_roberta* arch)" ;;
      esac
      [[ $arg == --arch=* ]] && value=--arch=$value
      printf '%s\n' "$value"
    else
      printf '%s\n' "$arg"
    fi
    prev=$arg
  done
}

has_arch() {
  local arg
  for arg in "$@"; do
    [[ $arg == --arch || $arg == --arch=* || $arg == -a ]] && return 0
  done
  return 1
}
if ! has_arch "${ARCH[@]}" "${EXTRA[@]}"; then
  die "no --arch in ARCH_ARGS='${ARCH_ARGS:-}' nor in the extra arguments"
fi

PLAIN_ARCH=("${ARCH[@]}")
PLAIN_EXTRA=("${EXTRA[@]}")
ME_ARCH=()
ME_EXTRA=()
if [[ -n $STAGE2_CRITERION ]]; then
  multi_exit_arch "${ARCH[@]}" "${EXTRA[@]}" >/dev/null # dies here on an unknown --arch
  mapfile -t ME_ARCH < <(multi_exit_arch "${ARCH[@]}")
  if [[ ${#EXTRA[@]} -gt 0 ]]; then
    mapfile -t ME_EXTRA < <(multi_exit_arch "${EXTRA[@]}")
  fi
fi

# ------------------------------------------------------------------ commands
# The recipe's flags in the order of acl_fairseq.experiment.recipe.train_command / glue_commands, which
# this script mirrors (tests/test_recipes.py checks that both give the same commands).
# build_cmd SAVE_DIR TASK CRITERION MULTI_EXIT(0|1) RESTORE... -- LAST...: sets CMD
build_cmd() {
  local save_dir=$1 fs_task=$2 criterion=$3 multi_exit=$4
  shift 4
  local restore=()
  while [[ $# -gt 0 && $1 != -- ]]; do
    restore+=("$1")
    shift
  done
  shift # --
  if [[ ${#restore[@]} -gt 0 ]]; then
    restore+=(--reset-optimizer --reset-dataloader --reset-meters)
  fi
  local arch=("${PLAIN_ARCH[@]}") extra=("${PLAIN_EXTRA[@]}")
  if [[ $multi_exit == 1 ]]; then
    arch=("${ME_ARCH[@]}")
    extra=("${ME_EXTRA[@]}")
  fi
  CMD=(
    "$FAIRSEQ_TRAIN" "$DATA"
    --user-dir "$USER_DIR"
    --task "$fs_task"
    "${arch[@]}"
    --criterion "$criterion"
    "${restore[@]}"
    --num-classes "$NUM_CLASSES" --init-token 0 --separator-token 2
    --batch-size "$BSZ" --required-batch-size-multiple 1
    --max-epoch 10 --max-update "$UPDATES"
    --optimizer adam --adam-betas "(0.9,0.98)" --adam-eps 1e-6 --weight-decay 0.1
    --lr "$LR" --lr-scheduler polynomial_decay
    --total-num-update "$UPDATES" --warmup-updates "$WARMUP"
    --valid-subset "$VALID_SUBSET"
    --best-checkpoint-metric "$BEST_METRIC" "${MAXIMIZE_FLAGS[@]}"
    --no-epoch-checkpoints --no-last-checkpoints --no-save-optimizer-state
    --save-dir "$save_dir"
    --seed "$SEED"
    --log-format json --log-interval 200
    --max-positions 512 --max-tokens 4400 --dropout 0.1 --attention-dropout 0.1
    --clip-norm 0.0 --find-unused-parameters
    "${METRIC_FLAGS[@]}"
    "${FP16_FLAGS[@]}"
    "${extra[@]}"
    "$@"
  )
}

# quote ARGS...: one shell-quoted line
quote() {
  local out=() arg
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then
      out+=("$arg")
    else
      out+=("'${arg//\'/\'\\\'\'}'")
    fi
  done
  printf '%s\n' "${out[*]}"
}

run_cmd() {
  if [[ $DRY_RUN == 1 ]]; then
    quote "${CMD[@]}"
  else
    echo "+ $(quote "${CMD[@]}")" >&2
    "${CMD[@]}"
  fi
}

if [[ -n $STAGE2_CRITERION ]]; then
  STAGE1_DIR=$SAVE_DIR/stage1
  STAGE2_DIR=$SAVE_DIR/stage2
  STAGE1_BEST=$STAGE1_DIR/checkpoint_best.pt
  if [[ $DRY_RUN == 1 ]]; then
    echo "# stage 1: $CRITERION ($TASK) -> $STAGE1_DIR"
  fi
  # stage 1 is the multi-exit model without shallow exits (exactly the plain model for
  # --exit-pooling first): the multi-exit flags mean the same in both stages
  build_cmd "$STAGE1_DIR" "$FS_TASK" "$CRITERION" 1 "${RESTORE[@]}" -- --exit-layers none
  run_cmd
  if [[ $DRY_RUN == 0 && ! -f $STAGE1_BEST ]]; then
    die "stage 1 finished without writing $STAGE1_BEST"
  fi
  if [[ $DRY_RUN == 1 ]]; then
    echo "# stage 2: $STAGE2_CRITERION on the multi-exit model -> $STAGE2_DIR"
  fi
  build_cmd "$STAGE2_DIR" acl_sentence_prediction "$STAGE2_CRITERION" 1 \
    --restore-file "$STAGE1_BEST" -- "${STAGE2_EXTRA[@]}"
  run_cmd
else
  if [[ ${#STAGE2_EXTRA[@]} -gt 0 ]]; then
    warn "STAGE2_ARGS is ignored: method $METHOD has one stage"
  fi
  build_cmd "$SAVE_DIR" "$FS_TASK" "$CRITERION" 0 "${RESTORE[@]}" --
  run_cmd
fi
