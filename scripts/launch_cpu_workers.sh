#!/usr/bin/env bash
# Data-parallel fairseq training on CPU only: starts N worker processes on this machine.
#
# fairseq's own launcher spawns one process per GPU, so it refuses
# --distributed-world-size 2 without GPUs, and torchrun fails without CUDA. This script starts
# the N ranks itself, each as
#
#   COMMAND ARGS... --cpu --distributed-backend gloo \
#       --distributed-init-method tcp://127.0.0.1:PORT --distributed-world-size N \
#       --distributed-rank R --distributed-no-spawn
#
# with OMP_NUM_THREADS=1 (unless set) so the ranks do not fight over cores. The log of
# rank 0 then says "training on N devices".
#
# The data-parallel backend is the command's: a --ddp-backend in ARGS is kept, and without
# one fairseq's default applies, pytorch_ddp (torch's DistributedDataParallel; alias c10d).
# On CPU, pytorch_ddp needs the plugin (--user-dir acl_fairseq), which builds torch's DDP
# without the GPU device ids stock fairseq 0.12 passes; stock fairseq on CPU needs
# --ddp-backend legacy_ddp (fairseq's own all-reduce after backward). RoBERTa's unused LM
# head makes pytorch_ddp need --find-unused-parameters (as in fairseq's GLUE recipes). Each worker gets the per-worker --batch-size,
# so N workers x --batch-size B update like 1 worker with --batch-size B --update-freq N
# (same examples per update, same gradient up to float rounding; ACL-Grad takes one
# decision per update on the all-reduced gradients, the same on every worker).
#
# Usage:
#   scripts/launch_cpu_workers.sh N [--port PORT] [--log-dir DIR] -- COMMAND [ARGS...]
#
#   N            number of worker processes (ranks 0..N-1)
#   --port PORT  TCP port of the rendezvous on 127.0.0.1 (default: a free port)
#   --log-dir D  also write each rank's full output to D/rank{R}.log
#   COMMAND      fairseq-train (or any fairseq entry point that takes the distributed flags)
#
# Output: every line of rank R's stdout and stderr is printed with the prefix "[rank R] ".
# Exit status: 0 when every rank succeeded; otherwise the status of the first rank that
# failed, after the other ranks are stopped (they would otherwise wait in a collective).
#
# Example (2 workers, tiny run):
#   scripts/launch_cpu_workers.sh 2 --log-dir logs -- fairseq-train data-bin/RTE \
#       --user-dir acl_fairseq --task acl_sentence_prediction --criterion acl_embed \
#       --find-unused-parameters ...
#
# Tip: --acl-grad-log 'angles.{rank}.tsv' writes one ACL-Grad log per rank.
set -uo pipefail

usage() {
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
}

[[ $# -ge 1 ]] || usage
case "$1" in -h | --help) usage ;; esac
N="$1"
shift
[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "launch_cpu_workers: N must be a positive integer, got '$N'" >&2; exit 2; }

PORT=""
LOG_DIR=""
while [[ $# -gt 0 && "$1" != "--" ]]; do
    case "$1" in
        --port) PORT="${2:?--port needs a value}"; shift 2 ;;
        --log-dir) LOG_DIR="${2:?--log-dir needs a value}"; shift 2 ;;
        -h | --help) usage ;;
        *) echo "launch_cpu_workers: unknown option '$1' (the command goes after --)" >&2; exit 2 ;;
    esac
done
[[ "${1:-}" == "--" ]] || { echo "launch_cpu_workers: missing '--' before the command" >&2; exit 2; }
shift
[[ $# -ge 1 ]] || { echo "launch_cpu_workers: no command after --" >&2; exit 2; }

PYTHON="${PYTHON:-python3}"
if [[ -z "$PORT" ]]; then
    PORT="$("$PYTHON" -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')" || { echo "launch_cpu_workers: could not pick a free port; pass --port" >&2; exit 2; }
fi
if [[ -n "$LOG_DIR" ]]; then
    mkdir -p "$LOG_DIR" || exit 2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# Job control: every rank runs in its own process group, so stopping a rank also stops
# whatever it started (data-loader workers), and Ctrl-C reaches this script, which stops all.
set -m
PIDS=()
stop_all() {
    local pid
    for pid in "${PIDS[@]}"; do
        kill -TERM -- "-$pid" 2>/dev/null
    done
}
trap 'stop_all; wait; exit 130' INT
trap 'stop_all; wait; exit 143' TERM

for ((r = 0; r < N; r++)); do
    if [[ -n "$LOG_DIR" ]]; then
        sink=(tee "$LOG_DIR/rank$r.log")
    else
        sink=(cat)
    fi
    # the job's status is the command's (pipefail); it ends after its log lines are printed
    {
        "$@" --cpu --distributed-backend gloo \
            --distributed-init-method "tcp://127.0.0.1:$PORT" --distributed-world-size "$N" \
            --distributed-rank "$r" --distributed-no-spawn 2>&1 |
            "${sink[@]}" | awk -v p="[rank $r] " '{ print p $0; fflush() }'
    } &
    PIDS+=("$!")
done

# Wait for all ranks; on the first failure stop the others and return its status.
status=0
remaining=$N
declare -A finished
while ((remaining > 0)); do
    for r in "${!PIDS[@]}"; do
        [[ -n "${finished[$r]:-}" ]] && continue
        pid="${PIDS[$r]}"
        if ! kill -0 "$pid" 2>/dev/null; then
            wait "$pid"
            rc=$?
            finished[$r]=1
            remaining=$((remaining - 1))
            if ((rc != 0 && status == 0)); then
                status=$rc
                echo "launch_cpu_workers: rank $r exited with status $rc; stopping the other ranks" >&2
                stop_all
            fi
        fi
    done
    ((remaining > 0)) && sleep 0.5
done
exit "$status"
