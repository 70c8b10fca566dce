#!/usr/bin/env bash
# The GPU checks, in one run on a machine with one NVIDIA GPU (a package registry not needed):
#   1. tests/e2e/test_cuda.py (+ the core math tests) on the GPU;
#   2. the quickstart config through the CLI on the GPU in bf16-mixed, 7 rollout steps (5 of value pretraining);
#   3. bench_trl.py on the GPU at the quickstart shape and at a GPT-2-small shape;
#   4. probes/probe_decode_gpu.py: the sampler's time per decoding step, fp32 and bf16;
#   5. bench_engines.py: the native sampler against vLLM at Qwen2.5-1.5B's shape, 512 prompts x 4
#      responses of 1024 tokens (targets: vLLM >= 5x the native tokens/s, weight sync <= 10 % of
#      a step). Needs vLLM on the GPU machine (its CUDA wheel is far over what a run can carry).
#   6. scripts/gpu_ready.py: the GPU-readiness checks (an update's peak memory by a token budget
#      against the memory plan; fsdp + bf16 through the CLI with sharded saves, a resume, an export).
# `bash benchmarks/gpu_check.sh engines` runs part 5 alone (about 6 minutes), `ready` part 6
# alone (a few minutes, the first thing to run on a lent GPU); no argument runs 1-6.
# On a machine with a registry, install the project first (`pip install -e '.[dev]'`, and the
# TRL venvs bench_trl.py names); the script then uses what is installed. On a machine without
# one, the packages it lacks travel as wheels in .whl/ (git-ignored), fetched where a registry
# is reachable, for the GPU machine's Python (here 3.12), and are installed under /tmp:
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
#      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#   pip download $P -d .whl/common datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
#     jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 math-verify==0.9.0 \
#     latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 fsspec==2026.9.0
#   pip download $P -d .whl/trl112 trl==1.12.0;  pip download $P -d .whl/trl116 trl==1.16.0
# (torch, transformers, lightning, torchmetrics, tensorboard, accelerate and pyarrow were on
# the machine.) Results land in $OUT (or ./gpu_out). Each part has its own time limit, so one
# hang cannot take the others.
set -uo pipefail
PART=${1:-all}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" "${@:2}"; }
sites=""
if [[ -d .whl/common ]]; then install /tmp/site .whl/common/*.whl || exit 1; fi
if [[ -d .whl/trl112 ]]; then install /tmp/trl112 .whl/trl112/*.whl || exit 1; sites+=" --trl-site trl_ppo=/tmp/trl112"; fi
if [[ -d .whl/trl116 ]]; then install /tmp/trl116 .whl/trl116/*.whl || exit 1; sites+=" --trl-site trl_grpo=/tmp/trl116"; fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; from benchmarks.stamp import stamp; print(stamp())"
python3 -c "import torch, transformers, lightning, pyarrow, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'pyarrow', pyarrow.__version__, 'datasets', datasets.__version__)"

engines() {
  echo "== 5. bench_engines, GPU, Qwen2.5-1.5B shape, 512 x 4 x 1024 tokens"
  if ! python3 -c "import vllm" 2>/dev/null; then echo "vLLM is not installed on this machine: part 5 skipped"; return; fi
  timeout 420 python3 -m benchmarks.bench_engines --device cuda --shape qwen2.5-1.5b \
    --gpu-memory-utilization 0.4 --out "$OUT/engines_gpu.md" > "$OUT/engines_gpu.log" 2>&1
  echo "exit $?"; cat "$OUT/engines_gpu.md" 2>/dev/null; tail -5 "$OUT/engines_gpu.log"
}
ready() {
  echo "== 6. GPU readiness: token budget against the memory plan; fsdp fit, sharded saves, resume, export"
  timeout 480 python3 scripts/gpu_ready.py 2>&1 | tee "$OUT/gpu_ready.log" | grep -E "^(token_budget|fit):"
}
if [[ "$PART" == engines ]]; then engines; exit; fi
if [[ "$PART" == ready ]]; then ready; exit; fi

echo "== 1. pytest on the GPU"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_cuda.py tests/core/test_core.py 2>&1 | tee "$OUT/pytest.log" | tail -15

echo "== 2. quickstart config, CLI, GPU, bf16-mixed, 7 rollout steps (5 of value pretraining)"
timeout 110 python3 -m vapo_lightning.cli fit -c configs/quickstart.yaml --trainer.accelerator=gpu \
  --trainer.precision=bf16-mixed --trainer.max_steps=7 --trainer.default_root_dir=/tmp/qs \
  --trainer.enable_progress_bar=false --model.hf_export_dir=/tmp/qs/hf > "$OUT/cli_fit.log" 2>&1
echo "exit $?"; grep -E "val/accuracy|Error|error" "$OUT/cli_fit.log" | tail -5
python3 - <<'EOF'
import glob
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
for f in glob.glob("/tmp/qs/**/events.out.tfevents.*", recursive=True):
    acc = EventAccumulator(f); acc.Reload()
    for tag in ("timing_s/step", "timing_s/gen", "timing_s/update_actor", "timing_s/update_critic",
                "actor/pg_loss", "critic/vf_loss", "rollout/accuracy", "val/accuracy"):
        if tag in acc.Tags()["scalars"]:
            print(tag, [round(e.value, 4) for e in acc.Scalars(tag)])
EOF

echo "== 3a. bench_trl, GPU, quickstart shape"
timeout 170 python3 benchmarks/bench_trl.py --device cuda --reps 5 $sites \
  --out "$OUT/trl_gpu_quickstart.md" > "$OUT/trl_gpu_quickstart.log" 2>&1
echo "exit $?"; grep -A6 "^## Results" "$OUT/trl_gpu_quickstart.md"; grep -A3 "^VAPO's phases" "$OUT/trl_gpu_quickstart.md"
tail -3 "$OUT/trl_gpu_quickstart.log"
echo "== 3b. bench_trl, GPU, gpt2-small shape"
timeout 200 python3 benchmarks/bench_trl.py --device cuda --shape gpt2-small --reps 5 $sites \
  --out "$OUT/trl_gpu_gpt2small.md" > "$OUT/trl_gpu_gpt2small.log" 2>&1
echo "exit $?"; grep -A6 "^## Results" "$OUT/trl_gpu_gpt2small.md"; grep -A3 "^VAPO's phases" "$OUT/trl_gpu_gpt2small.md"
tail -3 "$OUT/trl_gpu_gpt2small.log"
echo "== 4. decoding time per step, fp32 and bf16"
timeout 80 python3 benchmarks/probes/probe_decode_gpu.py 2>&1 | grep -v Warning | tee "$OUT/probe_decode.log" | grep "ms/step"
engines
ready
