#!/usr/bin/env bash
# The GPU lane on an offline GPU node (docs/guides/gpu.md, "An offline GPU node"): install the copied bundle, check
# the GPU, run the device smoke tests (pytest -m gpu), the headline measurements on a GPU nothing else uses, then
# the gpu-smoke profile, each only where the time left allows, and pack what came out into at most 8 files of at
# most 16 MiB under the output folder as it goes (a command killed at its limit still returns what was packed).
#
#   bash benchmarks/gpu_lane.sh [BUNDLE_DIR]         BUNDLE_DIR: dist/bundle (made by `make bundle`)
#
# Resumable: each phase that finished leaves a mark in LANE_STATE (default .lane, git-ignored), and Snakemake keeps
# what its jobs made, so the same command run again on the same node (a second call within its warm window)
# goes on where the first stopped.
# Environment: OUT (default results/gpu-lane-out), LANE_SECONDS (default 570: this call's budget, within a
# 10-minute command), LANE_STATE, PYTHON (default python3), LANE_DEVICE (cuda; cpu rehearses the lane on a CPU with
# the CI's tiny sizes: benchmarks/gpu_lane_rehearsal.yaml), LANE_PHASES (default: all of pytest-gpu finetune-mfu
# attention decode gpu-smoke diagnosis; name fewer to spend a node's minutes on what is still missing), LANE_SMOKE_JOBS (GPU jobs of the smoke at once,
# default 4: the smoke checks code paths, not timings, so its jobs may share the GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
budget=${LANE_SECONDS:-570}
out=${OUT:-results/gpu-lane-out}
py=${PYTHON:-python3}
device=${LANE_DEVICE:-cuda}
bundle=${1:-dist/bundle}
state=${LANE_STATE:-.lane}
mkdir -p "$out" "$state"
state=$(cd "$state" && pwd)
log="$state/lane.log"
left() { echo $(( budget - ($(date +%s) - start) )); }
say() { echo "[lane $(( $(date +%s) - start ))s] $*" | tee -a "$log"; }
phases=" ${LANE_PHASES:-pytest-gpu finetune-mfu attention decode gpu-smoke diagnosis} "
done_before() {  # true (skip it) when the phase finished in an earlier call or LANE_PHASES leaves it out
  [ -f "$state/$1.done" ] && { say "$1: done in an earlier call"; return 0; }
  case "$1" in install) return 1;; esac
  [[ "$phases" == *" ${1#headline-} "* ]] || { say "$1: not in LANE_PHASES"; return 0; }
  return 1
}
mark() { touch "$state/$1.done"; }
skip() { echo "$*" >>"$state/skipped.txt"; say "skipped: $*"; }
pack() {  # results folder -> a tarball under $out (weights and checkpoints left out), and the small files beside
  local name
  for name in headline-results smoke-results; do
    [ -d "$state/$name" ] && tar -C "$state" -czf "$out/$name.tar.gz" --exclude='*.safetensors' --exclude='*.bin' \
      --exclude='*.pt' --exclude='*.gguf' --exclude='checkpoint-*' "$name" 2>/dev/null
  done
  for name in lane.log pytest-gpu.txt skipped.txt headline.log gpu-smoke.log node-freeze.txt; do
    [ -f "$state/$name" ] && cp "$state/$name" "$out/"
  done
}
say "call begins: budget ${budget}s, state $state"

# 1. install the bundle's parts, then pip check (what the bundle left out on purpose is expected missing)
if ! done_before install && [ -f "$bundle/install.sh" ]; then
  "$py" -m pip freeze >"$state/node-freeze.txt" 2>/dev/null  # what the image brings: the next bundle's FREEZE
  parts=$(cd "$bundle" && ls -d part-* 2>/dev/null | tr '\n' ' ')
  [ -n "$parts" ] && PYTHON="$py" bash "$bundle/install.sh" $parts >>"$log" 2>&1 && say "installed: $parts"
  PYTHON="$py" bash "$bundle/install.sh" --check >>"$log" 2>&1 && say "pip check: ok" || say "pip check: FAILED (lane.log)"
  mark install
fi
export PATH="$(dirname "$(command -v "$py")"):$PATH"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this tree's efflab, whatever wheel the bundle brought
export PYTHONUNBUFFERED=1
say "$("$py" -c 'import torch, transformers
gpu = torch.cuda.is_available()
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", gpu,
      torch.cuda.get_device_name(0) if gpu else "", f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB" if gpu else "")' 2>&1 | tail -1)"
[ "$device" = cuda ] && { nvidia-smi >>"$log" 2>&1 || say "nvidia-smi: not found"; }

# The two experiments, each one whole params file: the GPU profile's cut to the headline grid, and the gpu-smoke
# profile's; a CPU rehearsal shrinks both to the CI's tiny sizes
rehearse=(); [ "$device" = cuda ] || rehearse=(benchmarks/gpu_lane_rehearsal.yaml)
headline_params() {  # the headline experiment, with the filled batches once they are known (fill_batches)
  local filled=(); [ -f "$state/fill.yaml" ] && filled=("$state/fill.yaml")
  "$py" benchmarks/lane_params.py "$state/headline.yaml" workflow/profiles/gpu/params.yaml \
    benchmarks/gpu_lane_headline.yaml "${rehearse[@]}" "${filled[@]}"
}
headline_params
"$py" benchmarks/lane_params.py "$state/smoke.yaml" workflow/profiles/gpu-smoke/params.yaml "${rehearse[@]}"
in_results() {  # folder, command...: run the command with results/ pointing at the folder
  local folder=$1; shift
  mkdir -p "$folder"
  [ -e results ] && [ ! -L results ] && mv results results.before-lane
  ln -sfn "$folder" results
  rm -rf .snakemake/locks  # a run this lane's earlier call killed at its limit left its lock; nothing else runs here
  "$@"; local rc=$?
  rm -f results; [ -d results.before-lane ] && mv results.before-lane results
  return $rc
}

# 2. the device smoke tests
if ! done_before pytest-gpu; then
  timeout -k 10 $(( $(left) > 150 ? 150 : $(left) )) "$py" -m pytest -m gpu tests/test_gpu.py -p no:xdist \
    -p no:cacheprovider -o addopts="" -q -rs >"$state/pytest-gpu.txt" 2>&1
  say "pytest -m gpu: $(tail -1 "$state/pytest-gpu.txt")"; mark pytest-gpu; pack
fi

# 3. the headline measurements, most wanted first, each where the time left allows it, on a GPU nothing else uses
headline() {  # name, seconds it needs, targets...
  local name=$1 need=$2; shift 2
  done_before "headline-$name" && return
  if [ "$(left)" -lt $(( need + 30 )) ]; then skip "headline $name (needs ~${need}s, $(left)s left)"; return; fi
  say "headline $name: begins"
  in_results "$state/headline-results" timeout -k 10 $(( $(left) - 40 )) snakemake --configfile "$state/headline.yaml" \
    --cores all --resources gpu=1 --keep-going --rerun-incomplete "$@" >>"$state/headline.log" 2>&1
  local rc=$?; say "headline $name: exit $rc"; [ $rc -eq 0 ] && mark "headline-$name"; pack
}
fill_batches() {  # the headline runs' batch from the memory estimator: the most rows within 80% of the card
  in_results "$state/headline-results" snakemake results/base_model/model results/prepare_data/train.parquet \
    --configfile "$state/headline.yaml" --cores all --resources gpu=1 >>"$state/headline.log" 2>&1 || return 1
  local most=4096; [ "$device" = cuda ] || most=16  # a CPU rehearsal: the plumbing, not a filled CPU
  in_results "$state/headline-results" "$py" -m efflab.estimators.fill --most $most "$state/headline.yaml" results \
    full lora-r8 >"$state/fill.tmp" 2>>"$log" || return 1
  mv "$state/fill.tmp" "$state/fill.yaml" && headline_params
  say "filled batches: $(tail -1 "$log")"
}
[ -f "$state/fill.yaml" ] || done_before headline-finetune-mfu || fill_batches || say "filled batches: failed (lane.log)"
headline finetune-mfu 190 results/finetune/{full,lora-r8}/metrics.json
headline attention 215 results/bench_attention/{eager,sdpa,sdpa_flash,sdpa_efficient,sdpa_cudnn,sdpa_math,flash_attention_2}/metrics.json
headline decode 420 results/bench_inference/{baseline,int8,nf4,torchao-int8,torchao-int4}/metrics.json
# 4. the gpu-smoke profile: every stage and CUDA path once, its GPU jobs sharing the GPU (before the last headline
#    measurement: it checks every code path, the deliverable a lane must not skip)
if ! done_before gpu-smoke; then
  if [ "$(left)" -lt 120 ]; then skip "gpu-smoke (only $(left)s left)"; else
    say "gpu-smoke: begins"
    in_results "$state/smoke-results" timeout -k 10 $(( $(left) - 35 )) snakemake --profile workflow/profiles/gpu-smoke \
      --configfile "$state/smoke.yaml" --cores all --resources gpu="${LANE_SMOKE_JOBS:-4}" >>"$state/gpu-smoke.log" 2>&1
    rc=$?; say "gpu-smoke: exit $rc ($(grep -c 'Finished job' "$state/gpu-smoke.log") jobs finished in all calls)"
    [ $rc -eq 0 ] && mark gpu-smoke
  fi
fi
# 5. the MFU diagnosis, on the GPU alone again: efflab against the plain Trainer + peft script at equal numerics
#    and as shipped, each knob alone (fused AdamW, torch.compile, Liger, FlashAttention-2 over packed rows), a
#    quarter of the filled batch beside it (the batch sweep), and one steady step's profiler trace; fresh processes
if ! done_before diagnosis; then
  if [ "$(left)" -lt 200 ]; then skip "diagnosis (needs ~180s, $(left)s left)"; else
    say "diagnosis: begins"
    repeats=$(( $(left) > 480 ? 2 : 1 ))
    rows=$("$py" -c 'import sys; from efflab.config import load; from efflab.experiment import finetune_run
print(finetune_run(load(sys.argv[1]), "lora-r8").batch_size)' "$state/headline.yaml")
    sweep=""; [ $(( rows / 4 )) -gt 0 ] && sweep=",efflab@$(( rows / 4 ))"
    in_results "$state/headline-results" timeout -k 10 $(( $(left) - 40 )) "$py" benchmarks/finetune_throughput.py \
      --params "$state/headline.yaml" --run lora-r8 --batch-size "$rows" --steps 20 --repeats $repeats \
      --cells "script,efflab,efflab-equal,efflab-loop,efflab-compile,efflab-liger,efflab-fa2$sweep" --trace efflab \
      --out results/benchmarks/finetune_diagnosis >>"$state/headline.log" 2>&1
    rc=$?; say "diagnosis ($repeats repeats): exit $rc"; [ $rc -eq 0 ] && mark diagnosis; pack
  fi
fi

say "call done in $(( $(date +%s) - start ))s"
pack
[ "$(ls "$out" | wc -l)" -le 8 ] || echo "warning: $(ls "$out" | wc -l) files under $out, more than 8"
