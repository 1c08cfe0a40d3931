#!/usr/bin/env bash
# A/B of two settings of one training job, runs alternating (A B A B ...) so that drifts of
# the machine (clocks, other load) fall on both: prints each run's median tokens/s (steps
# 4 on) and step time, then per setting the median of its runs and B / A. Prints, asserts
# nothing: a measurement for docs/performance.md (give the command with the figure).
#
#   tools/ab_runs.sh ROUNDS 'VAR=a ...' 'VAR=b ...' TRAIN_ARGS...
#   e.g. (on a GPU) tools/ab_runs.sh 3 '' '-- --deterministic true' \
#          --workload gpt-small --device cuda --precision bf16 --microbatches 1 --steps 12
#
# Runs $TROUPE_BUILD_DIR/troupe train (default build/); a setting may also be '' (none)
# or a flag list after '--', e.g. '-- --threads 2'.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rounds=${1:?usage: tools/ab_runs.sh ROUNDS 'SETTING A' 'SETTING B' TRAIN_ARGS...}
settings=("${2?}" "${3?}")
shift 3
exe=${TROUPE_BUILD_DIR:-$root/build}/troupe
work=$(mktemp -d /tmp/troupe-ab-XXXXXX)
py=${PYTHON:-python3}
median_of() {  # median_of METRICS: "tokens/s step_ms" over the steps from the 4th on
  "$py" - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l][3:]
med = lambda xs: sorted(xs)[len(xs) // 2]
print(f"{med([r['tokens_per_s'] for r in rows]):.0f} {med([r['step_seconds'] for r in rows]) * 1e3:.2f}")
PY
}
declare -a results_0 results_1
for ((r = 0; r < rounds; ++r)); do
  for i in 0 1; do
    setting=${settings[$i]}
    envs=() flags=()
    read -r -a words <<<"$setting"
    after=0
    for w in "${words[@]}"; do
      if [ "$w" = -- ]; then after=1; elif [ $after = 1 ]; then flags+=("$w"); else envs+=("$w"); fi
    done
    m=$work/r$r-$i.jsonl
    if ! env "${envs[@]}" "$exe" train "$@" "${flags[@]}" --metrics "$m" >"$work/r$r-$i.log" 2>&1; then
      echo "run $r, setting $((i + 1)) ($setting) failed:"; tail -5 "$work/r$r-$i.log"; exit 1
    fi
    read -r tps ms < <(median_of "$m")
    echo "round $((r + 1)) ${setting:-(none)}: $tps tokens/s, step $ms ms"
    if [ $i = 0 ]; then results_0+=("$tps"); else results_1+=("$tps"); fi
  done
done
"$py" - "${settings[0]:-(none)}" "${settings[1]:-(none)}" "${results_0[*]}" "${results_1[*]}" <<'PY'
import sys
med = lambda xs: sorted(xs)[len(xs) // 2]
a, b = ([float(x) for x in s.split()] for s in sys.argv[3:5])
print(f"A {sys.argv[1]}: median {med(a):,.0f} tokens/s (runs {', '.join(f'{x:,.0f}' for x in a)})")
print(f"B {sys.argv[2]}: median {med(b):,.0f} tokens/s (runs {', '.join(f'{x:,.0f}' for x in b)})")
print(f"B / A = {med(b) / med(a):.3f}")
PY
