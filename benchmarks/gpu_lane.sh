#!/usr/bin/env bash
# The GPU lane in one command on an offline GPU node (docs/guides/gpu.md, "An offline GPU node"): install the
# copied bundle part(s), check the GPU, run the device smoke tests (pytest -m gpu) and the gpu-smoke profile, then
# as many headline measurements as the time left allows, and pack what came out into at most 8 files of at most
# 16 MiB under the output folder.
#
#   bash benchmarks/gpu_lane.sh [BUNDLE_DIR]         BUNDLE_DIR: dist/bundle (made by `make bundle`); parts not
#                                                    present there are taken as installed by an earlier command
# Environment: OUT (default results/gpu-lane-out), LANE_SECONDS (default 570: the whole script's budget, within a
# 10-minute command), PYTHON (default python3), LANE_DEVICE (cuda; cpu rehearses the lane on a CPU with the CI's
# tiny sizes: benchmarks/gpu_lane_rehearsal.yaml).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
budget=${LANE_SECONDS:-570}
out=${OUT:-results/gpu-lane-out}
py=${PYTHON:-python3}
device=${LANE_DEVICE:-cuda}
bundle=${1:-dist/bundle}
work=$(mktemp -d)
mkdir -p "$out"
log="$work/lane.log"
left() { echo $(( budget - ($(date +%s) - start) )); }
say() { echo "[lane $(( $(date +%s) - start ))s] $*" | tee -a "$log"; }
skipped=()

# 1. install: every part of the bundle that is here, then pip check (all parts must be in by now)
if [ -x "$bundle/install.sh" ] || [ -f "$bundle/install.sh" ]; then
  parts=$(cd "$bundle" && ls -d part-* 2>/dev/null | tr '\n' ' ')
  [ -n "$parts" ] && PYTHON="$py" bash "$bundle/install.sh" $parts >>"$log" 2>&1 && say "installed: $parts"
  PYTHON="$py" bash "$bundle/install.sh" --check >>"$log" 2>&1 && say "pip check: ok" || say "pip check: FAILED (see lane.log)"
fi
bin=$(dirname "$(command -v "$py")")
export PATH="$bin:$PATH"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this tree's efflab, whatever wheel the bundle brought
versions=$("$py" - 2>&1 <<'EOF'
import torch, transformers, efflab
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available(), end=" ")
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
EOF
)
say "$(echo "$versions" | tail -1)"
if [ "$device" = cuda ]; then
  nvidia-smi >>"$log" 2>&1 || say "nvidia-smi: not found"
  profile_args=(--profile workflow/profiles/gpu-smoke)
else
  "$py" - "$work/rehearsal.yaml" <<'PY'
import sys, yaml
from efflab.config import _deep_merge  # the merge finetune runs use over their defaults
smoke = yaml.safe_load(open("workflow/profiles/gpu-smoke/params.yaml"))
yaml.safe_dump(_deep_merge(smoke, yaml.safe_load(open("benchmarks/gpu_lane_rehearsal.yaml"))), open(sys.argv[1], "w"))
PY
  profile_args=(--profile workflow/profiles/gpu-smoke --configfile "$work/rehearsal.yaml")
fi

# 2. the device smoke tests
timeout $(( $(left) > 150 ? 150 : $(left) )) "$py" -m pytest -m gpu tests/test_gpu.py -p no:xdist -p no:cacheprovider \
  -o addopts="" -q -rs >"$work/pytest-gpu.txt" 2>&1
say "pytest -m gpu: $(tail -1 "$work/pytest-gpu.txt")"

# 3. the gpu-smoke profile, into its own results folder
rm -rf results.lane && mkdir -p results.lane
[ -d results ] && [ -n "$(ls -A results 2>/dev/null)" ] && mv results results.before-lane
ln -sfn results.lane results
smoke_s=$(( $(left) - 120 ))
if [ "$smoke_s" -gt 60 ]; then
  # EFFLAB_PHASES: each fine-tune also times its steps phase by phase (measure.phases: CUDA events on a GPU)
  EFFLAB_PHASES="$work/finetune-phases.json" timeout "$smoke_s" snakemake "${profile_args[@]}" --cores all \
    >"$work/gpu-smoke.log" 2>&1
  say "gpu-smoke: exit $? ($(grep -c 'Finished job' "$work/gpu-smoke.log") jobs finished)"
else
  skipped+=("gpu-smoke (only ${smoke_s}s left)")
fi
rm results && mv results.lane "$work/smoke-results"
[ -f "$work/finetune-phases.json" ] && mv "$work/finetune-phases.json" "$work/smoke-results/"
[ -d results.before-lane ] && mv results.before-lane results

# 4. the headline measurements, most wanted first, each only where the time left allows it (the GPU profile's
#    sizes: the 1B configuration, 512-8k attention); what does not fit is listed in skipped.txt
headline() {  # name, seconds it needs, targets...
  local name=$1 need=$2; shift 2
  if [ "$(left)" -lt $(( need + 20 )) ]; then skipped+=("$name (needs ~${need}s, $(left)s left)"); return; fi
  timeout $(( $(left) - 20 )) snakemake --profile workflow/profiles/gpu --cores all "$@" >>"$work/headline.log" 2>&1
  say "headline $name: exit $?"
}
if [ "$device" = cuda ]; then
  mkdir -p results.lane && { [ -d results ] && mv results results.before-lane; ln -sfn results.lane results; }
  headline finetune-step-mfu 150 results/finetune/lora-r8/metrics.json results/finetune/full/metrics.json
  headline attention-backends 120 results/bench_attention/{eager,sdpa,sdpa_flash,sdpa_efficient,sdpa_math}/metrics.json
  headline decode-quantized 150 results/bench_inference/{baseline,int8,nf4,torchao-int8,torchao-int4}/metrics.json
  rm results && mv results.lane "$work/headline-results"
  [ -d results.before-lane ] && mv results.before-lane results
else
  skipped+=("headline measurements (LANE_DEVICE=$device: they measure a GPU)")
fi

# 5. pack: at most 8 files of at most 16 MiB
printf '%s\n' "${skipped[@]}" >"$work/skipped.txt"
for s in "${skipped[@]}"; do say "skipped: $s"; done
for part in smoke-results headline-results; do
  [ -d "$work/$part" ] || continue
  tar -C "$work" -czf "$work/$part.tar.gz" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
    --exclude='checkpoint-*' "$part" && rm -rf "${work:?}/$part"
done
say "done in $(( $(date +%s) - start ))s"
for f in "$work"/*; do
  [ -f "$f" ] || continue
  if [ "$(stat -c %s "$f")" -gt $(( 16 * 1024 * 1024 )) ]; then
    split -b 16M -d "$f" "$out/$(basename "$f")." && echo "split $(basename "$f") (cat the pieces to rejoin)"
  else
    cp "$f" "$out/"
  fi
done
n=$(ls "$out" | wc -l)
[ "$n" -le 8 ] || echo "warning: $n files under $out, more than 8"
rm -rf "$work"
