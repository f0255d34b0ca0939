# Sourced by .ci/run: each stage of CI is timed, its time printed when it ends, and a table of every
# stage with the total at the end. CI has a budget (CI_BUDGET_S, 45 minutes, half of CI's hard
# limit): past it every later stage and the table say so, loudly, but CI goes on. A slow machine
# must not fail a change whose tests pass; the warning is for whoever reads the log next
# (docs/DECISIONS.md, "CI's budget").
#
#   ci_stage NAME COMMAND...   runs COMMAND; prints "CI: NAME took M:SS (total M:SS)"; a failing
#                              COMMAND ends CI with its status, after the table
#   ci_summary                 the table and the total, with a warning if it is over the budget
#
# CI_CLOCK (default `date +%s`) gives the time in seconds: tests/project/test_ci_stages.py drives the
# table with a clock of its own.

CI_BUDGET_S=${CI_BUDGET_S:-2700}
CI_CLOCK=${CI_CLOCK:-"date +%s"}
CI_NAMES=()
CI_TIMES=()

ci_now() { $CI_CLOCK; }
CI_START=$(ci_now)

ci_mmss() { printf '%d:%02d' $(( $1 / 60 )) $(( $1 % 60 )); }

ci_table() {
  echo "CI: stage times"
  local i
  for i in "${!CI_NAMES[@]}"; do
    printf '  %-50s %8s\n' "${CI_NAMES[$i]}" "$(ci_mmss "${CI_TIMES[$i]}")"
  done
  printf '  %-50s %8s (budget %s)\n' "total" "$(ci_mmss "$1")" "$(ci_mmss "$CI_BUDGET_S")"
}

ci_over_budget() {  # ci_over_budget TOTAL: the warning
  echo "CI: WARNING: OVER BUDGET: $(ci_mmss "$1") is over the budget of $(ci_mmss "$CI_BUDGET_S") (CI_BUDGET_S=$CI_BUDGET_S)"
}

ci_stage() {
  local name=$1; shift
  local t0 rc=0 t1
  t0=$(ci_now)
  echo "CI: $name ..."
  "$@" || rc=$?
  t1=$(ci_now)
  CI_NAMES+=("$name")
  CI_TIMES+=($(( t1 - t0 )))
  echo "CI: $name took $(ci_mmss $(( t1 - t0 ))) (total $(ci_mmss $(( t1 - CI_START ))))"
  if [ "$rc" -ne 0 ]; then
    ci_table $(( t1 - CI_START ))
    echo "CI: FAILED: $name exited with status $rc"
    exit "$rc"
  fi
  if [ $(( t1 - CI_START )) -gt "$CI_BUDGET_S" ]; then
    ci_over_budget $(( t1 - CI_START ))
  fi
}

ci_summary() {
  local total=$(( $(ci_now) - CI_START ))
  ci_table "$total"
  if [ "$total" -gt "$CI_BUDGET_S" ]; then
    ci_over_budget "$total"
  fi
  echo "CI: finished in $(ci_mmss "$total")"
}
