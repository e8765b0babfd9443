#!/usr/bin/env bash
# The GPU measurements behind the docs pages, run in a queue: each stage is one command of a page,
# its output under OUT, its start and end (with the exit status) appended to OUT/plan.txt.
#
#   bash benchmarks/gpu_plan.sh OUT suite chunkprof paper screen        # runs them in order
#   echo "paper suite2" > OUT/queue                                     # while it runs: the stages left
#
# The queue is read again before each stage, so rewriting OUT/queue (one stage a line, or several
# on a line) reorders or changes what is left; `a+b+c` runs a, b and c side by side on a card of
# over 100 GB (in turn on smaller ones). Run from the repository root with `orthros` importable
# (PYTHONPATH=src). GPU_PLAN_TAG (default: the date and the card) names the result files.
set -u
OUT=${1:?usage: gpu_plan.sh OUT STAGE...}
shift
mkdir -p "$OUT"
echo "$*" | tr ' ' '\n' | grep -v '^$' > "$OUT/queue"
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -q H200 && echo h200 || echo h100)
TAG=${GPU_PLAN_TAG:-$(date -u +%F)-$CARD}
PY=${PYTHON:-python3}
# the whole suite beside other work takes fewer workers
NW=${GPU_PLAN_WORKERS:-14}
CPT="$PY -m orthros experiment cpt --preset smollm2-kd-h200-rqp-curve --steps 160 --device cuda --jobs ${GPU_PLAN_JOBS:-1}"
LORA=orthros-lora-sink-mix-aw-w1024

log() { echo "$(date -u +%T) $*" >> "$OUT/plan.txt"; }
# -v: a run cut short still says which items ended (so which were running); --timeout: a hung item fails with
# its stack instead of holding the stage (the slowest item on an H200 took 116 s)
TIMEOUT=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout 600")  # where the plugin is installed
tests() { $PY -m pytest -n "$NW" -o addopts="" -v -rfEs --durations=25 $TIMEOUT -p no:cacheprovider "$@"; }
serve() { $PY -m orthros bench serve "$@" --out-dir "$OUT/serve" --plot-dir "$OUT/serve"; }
mkdir -p "$OUT/serve" "$OUT/steps" "$OUT/runs" "$OUT/moe"

run() {  # one stage; its output in OUT/<the stage's name as a file name>.log
  local n=${1//[^A-Za-z0-9._-]/-}
  case $1 in
    suite | suite2) tests tests ;;  # the whole suite (docs/notes/2026-12-restructure.md)
    # the suite in two parts, one pass together: tests/ops (the kernels, the longest to compile on a fresh
    # machine; no real model needed) and the rest (the real model's tests among them)
    ops) tests tests/ops ;;
    rest) tests tests --ignore=tests/ops ;;
    servet) tests tests/serve ;;  # the serving tests alone
    chunkprof)  # docs/serving.md: the served chunk against the model's own prefill
      $PY benchmarks/serve_chunk_profile.py --out "$OUT/chunk-profile-$TAG.json" ;;
    mixed8k)  # docs/serving.md: the paper setting's mixed step (a 128K stream's decode beside an 8,192-token
      # chunk of a second 128K prompt) as one eager forward against the decode's graph + the chunk's forward
      $PY benchmarks/serve_step_profile.py --streams 1 --context 126976 --long 131072 --budgets 8192 \
        --variants orthros full --kv-gib 48 --steps 10 --out "$OUT/step-profile-mixed-8192-$TAG.json" ;;
    paper)  # docs/serving.md: 2 x 128K in, against full attention
      serve --scenario paper --variants orthros full --step-log-dir "$OUT/steps" --tag "serve-paper-$TAG" ;;
    paper16k)  # the same at a 16,384-token budget for both servers (one prompt's chunks beside the decodes)
      serve --scenario paper --variants orthros full --budget 16384 --step-log-dir "$OUT/steps" \
        --tag "serve-paper-b16384-$TAG" ;;
    faults)  # docs/serving.md: disconnects, over-capacity requests, a burst of 64 long requests
      serve --scenario faults --tag "serve-faults-$TAG" ;;
    documents)  # docs/serving.md: chats about shared long documents
      serve --scenario documents --tag "serve-documents-$TAG" ;;
    long=*)  # docs/serving.md: one long request through HTTP, e.g. long=int4:1M (one case a stage)
      serve --scenario long --tag "serve-$n-$TAG" --long-cases "${1#long=}" --capacity-dtypes ;;
    cap=*)  # docs/serving.md: how many 128K requests a KV dtype's pool holds, e.g. cap=int4
      serve --scenario long --tag "serve-$n-$TAG" --long-cases --capacity-dtypes "${1#cap=}" ;;
    screen)  # docs/results.md: the light twin against its full-weight row, rank and DoRA
      $CPT --arms $LORA-r16-dora $LORA-r24 $LORA-r32 --out "$OUT/runs/$n" ;;
    screen2)
      $CPT --arms $LORA-r24-dora $LORA-r16-lp4 --out "$OUT/runs/$n" ;;
    screen3)  # the prose gap left at ranks 16-32: rank 64, and rank 24 at twice the LoRA rate
      $CPT --arms $LORA-r64 $LORA-r24-lr2x --out "$OUT/runs/$n" ;;
    screen4)  # the light twin distilled from its full-weight twin (trained first, in the same run)
      $CPT --arms orthros-cpt-sink-mix-aw-w1024 $LORA-r24-kd-full --out "$OUT/runs/$n" ;;
    seed1)  # docs/results.md: the headline pair at a second seed
      $PY -m orthros experiment cpt --preset smollm2-w512-52m --device cuda --jobs 2 \
        --arms orthros-cpt-sink-mix-aw-w1024-s1 full-cpt-mix-aw-s1 --out "$OUT/runs/$n" ;;
    moedec)  # docs/moe.md: decode at 32K, 12 layers of the qwen3-30b-a3b shape, batches 1-64
      $PY -m orthros bench decode --model qwen3-30b-a3b --variants full orthros-bound orthros orthros-base \
        --contexts 32K --batches 1 8 32 64 --layers 12 --steps 50 --out-dir "$OUT/moe" --tag "decode-32k-12layers-$TAG" ;;
    moe)  # docs/moe.md: quality at small scale
      $PY -m orthros experiment recall --preset gpu --device cuda --jobs 3 \
        --archs full-moe orthros-moe orthros-moe-bound --out "$OUT/runs/$n" ;;
    *) echo "unknown stage: $1"; return 2 ;;
  esac > "$OUT/$n.log" 2>&1
}

# side by side needs the H200's memory: on an 80 GB H100 a training run beside a suite half ran both out of
# memory (2026-12-08), so there `a+b` runs a, then b (GPU_PLAN_SIDE_BY_SIDE=1 forces side by side)
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
SIDE=${GPU_PLAN_SIDE_BY_SIDE:-$([ "${MIB:-0}" -gt 100000 ] && echo 1 || echo 0)}
stage() {
  case $1 in
    *+*)
      local pids=() s rc=0
      if [ "$SIDE" = 1 ]; then
        for s in ${1//+/ }; do run "$s" & pids+=($!); done
        for s in "${pids[@]}"; do wait "$s" || rc=$?; done
      else
        log "$1: one after another (${MIB:-?} MiB card)"
        for s in ${1//+/ }; do run "$s" || rc=$?; done
      fi
      return $rc ;;
    *) run "$1" ;;
  esac
}

while next=$(head -1 "$OUT/queue" 2>/dev/null) && [ -n "$next" ]; do
  sed -i 1d "$OUT/queue"
  for s in $next; do
    log "start $s"
    stage "$s"
    log "end $s rc=$?"
  done
done
log "plan done"
