#!/usr/bin/env bash
# Launch a pipedream plan with torchrun: one process per worker of the plan.
#
#   ./launch.sh PLAN [options]
#
# torchrun's own options (--nnodes, --node-rank, --nproc-per-node, --rdzv-backend,
# --rdzv-endpoint, --rdzv-id, --rdzv-conf, --max-restarts, --master-addr, --master-port,
# --monitor-interval, --standalone; as torchrun, also --opt=value and --node_rank etc.) go to
# torchrun; all others go to `pipedream train`.
# --nproc-per-node defaults to the plan's world_size divided by --nnodes (default 1).
# A single-node launch without rendezvous options uses torchrun --standalone (loopback only).
# Set PYTHON to choose the interpreter (default: python, else python3).
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  exit $([[ $# -lt 1 ]] && echo 2 || echo 0)
fi

plan="$1"
shift
python_bin="${PYTHON:-$(command -v python || command -v python3 || true)}"
# pipedream.runtime, not pipedream: in the checkout's root a Python without pipedream installed
# finds the pipedream folder, but not the runtime, which the install maps into it
if [[ -z "$python_bin" ]] || ! "$python_bin" -c 'import pipedream.runtime' 2>/dev/null; then
  echo "launch.sh: error: ${python_bin:-no python on PATH}: cannot import pipedream; activate" \
    "the virtualenv it is installed in (. .venv/bin/activate) or name its Python" \
    "(PYTHON=.venv/bin/python ./launch.sh ...)" >&2
  exit 2
fi

torchrun_args=()
train_args=()
nnodes=()  # the option and its value, where given (an empty value is refused below)
nproc=()
rendezvous=0
while [[ $# -gt 0 ]]; do
  arg="$1"
  case "$arg" in
    --standalone)
      torchrun_args+=("$arg"); rendezvous=1; shift ;;
    --nnodes|--node-rank|--node_rank|--nproc-per-node|--nproc_per_node|--rdzv-backend|--rdzv_backend|\
    --rdzv-endpoint|--rdzv_endpoint|--rdzv-id|--rdzv_id|--rdzv-conf|--rdzv_conf|--max-restarts|\
    --max_restarts|--master-addr|--master_addr|--master-port|--master_port|--monitor-interval|\
    --monitor_interval)
      if [[ $# -lt 2 ]]; then echo "launch.sh: error: $arg needs a value" >&2; exit 2; fi
      value="$2"; shift 2
      name="${arg//_/-}"
      case "$name" in
        --nnodes) nnodes=(--nnodes "$value") ;;
        --nproc-per-node) nproc=(--nproc-per-node "$value"); continue ;;
        --rdzv-*|--master-*) rendezvous=1 ;;
      esac
      torchrun_args+=("$name" "$value") ;;
    --nnodes=*|--node-rank=*|--node_rank=*|--nproc-per-node=*|--nproc_per_node=*|\
    --rdzv-backend=*|--rdzv_backend=*|--rdzv-endpoint=*|--rdzv_endpoint=*|--rdzv-id=*|\
    --rdzv_id=*|--rdzv-conf=*|--rdzv_conf=*|--max-restarts=*|--max_restarts=*|--master-addr=*|\
    --master_addr=*|--master-port=*|--master_port=*|--monitor-interval=*|--monitor_interval=*)
      name="${arg%%=*}"; value="${arg#*=}"; shift
      name="${name//_/-}"
      case "$name" in
        --nnodes) nnodes=(--nnodes "$value") ;;
        --nproc-per-node) nproc=(--nproc-per-node "$value"); continue ;;
        --rdzv-*|--master-*) rendezvous=1 ;;
      esac
      torchrun_args+=("$name" "$value") ;;
    *)
      train_args+=("$arg"); shift ;;
  esac
done

for arg in "${train_args[@]+"${train_args[@]}"}"; do
  if [[ "$arg" == -h || "$arg" == --help ]]; then
    exec "$python_bin" -m pipedream.cli train --help
  fi
done

# Validate the plan and the options for `pipedream train`, and work out processes per node,
# before starting anything: a bad plan, a bad option or a world size that does not match gives
# one line and exit code 2, not one per rank and a torchrun error report.
# It prints the processes per node and the number of nodes (--nnodes 1:1 is 1).
checked=$("$python_bin" -m pipedream.runtime.launch_check "$plan" "${nnodes[@]+"${nnodes[@]}"}" \
          "${nproc[@]+"${nproc[@]}"}" -- "${train_args[@]+"${train_args[@]}"}")
read -r processes nodes <<<"$checked"

# Pin the run directory here, so that workers restarted by torchrun (--max-restarts) find the
# checkpoints of the run they continue.
has_run_dir=0
for arg in "${train_args[@]+"${train_args[@]}"}"; do
  [[ "$arg" == --run-dir || "$arg" == --run-dir=* ]] && has_run_dir=1
done
if [[ $has_run_dir -eq 0 ]]; then
  train_args+=(--run-dir "runs/$(date +%Y%m%d-%H%M%S)")
fi

if [[ $rendezvous -eq 0 && "$nodes" == "1" ]]; then
  torchrun_args+=(--standalone)
fi

exec "$python_bin" -m pipedream.runtime.torchrun "${torchrun_args[@]}" --nproc-per-node "$processes" \
  -m pipedream.cli train "$plan" "${train_args[@]+"${train_args[@]}"}"
