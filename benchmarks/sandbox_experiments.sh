#!/usr/bin/env bash
# Sandbox design experiments, measured against the tree they were written for, in one
# run.
#
#     bash benchmarks/sandbox_experiments.sh [ROUNDS [BASE]]   # default 2 rounds, c49d1b7; ~3 min
#
# Each patch in benchmarks/results/sandbox_experiments/ is applied to a copy of commit BASE
# (the tree before 361a9e1 merged two of them, in their own form: the seccomp filter with one
# network namespace per server, and the mount-namespace holder) and
# `probe_sandbox_cpu.py --humaneval 5` (HumanEval's canonical solutions, two servers, two
# threads: solutions per second and the machine CPU per solution) runs there, alternating with
# the unpatched tree, round after round, in an order that rotates each round. Then the patched
# copies run the hostile-program tests their change puts at risk. Results and what they mean:
# benchmarks/results/sandbox_cpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
base=${2:-c49d1b7}
py=$PWD/.venv/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
variants=(baseline)
mkdir -p "$work/baseline"
git archive "$base" vapo_lightning benchmarks tests pyproject.toml | tar -x -C "$work/baseline"
for patch in benchmarks/results/sandbox_experiments/*.patch; do
    name=$(basename "$patch" .patch)
    cp -r "$work/baseline" "$work/$name"
    (cd "$work/$name" && git apply "$OLDPWD/$patch")
    variants+=("$name")
done
n=${#variants[@]}
for round in $(seq "$rounds"); do
    for i in $(seq 0 $((n - 1))); do  # the order rotates by one each round
        v=${variants[$(((i + round - 1) % n))]}
        dir=$work/$v
        printf '%s round %s: ' "$v" "$round"
        (cd "$dir" && "$py" benchmarks/probe_sandbox_cpu.py --humaneval 5) |
            awk '/per second/ {r=$1} /^\| ms/ {print r " solutions/s; per solution ms: wall " $4 ", machine CPU " $6 ", client " $8 ", server " $10 ", sandboxes " $12 ", kernel threads " $14}'
    done
done
# What each change puts at risk (the zygote prototype covers the happy path only: no tests).
declare -A risk=([early_reply]="" [netns_per_server]="-k test_no_kernel_state_crosses_runs" [mount_ns_holder]="")
for v in "${!risk[@]}"; do
    [[ -d $work/$v ]] || continue
    echo "== $v: pytest tests/test_sandbox_hostile.py ${risk[$v]}"
    # shellcheck disable=SC2086  # (the -k option is two words)
    (cd "$work/$v" && HF_HUB_OFFLINE=1 "$py" -m pytest -q -p no:cacheprovider \
        tests/test_sandbox_hostile.py ${risk[$v]} 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed") || true
done
