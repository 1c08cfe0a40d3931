#!/usr/bin/env bash
# A node process that is alive but frozen (SIGSTOP) is fenced: node 0 sees it gone after
# the connection timeout, ends it (SIGKILL: it lives on this machine and carries the job's
# token), the launcher starts its replacement, which rejoins from the buddy copies; the
# step is retried in place. The run ends bit-identical to the fault-free one, no step
# replayed, and no process left.
#   tests/faults/fence_test.sh REPO_ROOT BUILD_DIR
source "$(dirname "$0")/../support/launcher_lib.sh" "$@"
job=(train --nodes 2 --pipeline 2 --data-parallel 2 --steps 24 --eval-interval 0)

"$launcher" "${job[@]}" --metrics "$tmp/ref.jsonl" --save "$tmp/ref.pt" >"$tmp/ref.log" 2>&1 \
  && ok "fault-free run" || bad "fault-free run" "$tmp/ref.log"

"$launcher" "${job[@]}" --metrics "$tmp/frozen.jsonl" --save "$tmp/frozen.pt" >"$tmp/frozen.log" 2>&1 &
pid=$!
for ((i = 0; i < 600; i++)); do grep -q "step  *6/24 |" "$tmp/frozen.log" && break; sleep 0.1; done
node1=$(own_pids | while read -r p; do grep -qzx "TROUPE_NODE=1" "/proc/$p/environ" 2>/dev/null && echo "$p"; done | head -1)
stopped_at=$(date +%s.%N)
kill -STOP "${node1:-0}" && ok "node 1 (pid $node1) stopped (SIGSTOP) after step 6" || bad "no node 1 to stop" "$tmp/frozen.log"
wait $pid
rc=$?
[ $rc = 0 ] && grep -q "node 1 is lost to the job but its process (pid $node1) is stopped: ended it (SIGKILL)" "$tmp/frozen.log" \
  && grep -q "node 1 ended (status 137); starting it again" "$tmp/frozen.log" && grep -q "node 1 rejoined" "$tmp/frozen.log" \
  && ok "the frozen node was fenced and replaced; its replacement rejoined" || bad "not fenced and replaced (exit $rc)" "$tmp/frozen.log"
! grep -q "the job failed" "$tmp/frozen.log" && ok "no job restart" || bad "the job was restarted" "$tmp/frozen.log"
out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/ref" "$tmp/frozen" 0 2>&1) \
  && ok "bit-identical to the fault-free run, no step replayed ($out)" || { echo "$out"; bad "results differ" "$tmp/frozen.log"; }
# From the SIGSTOP to the retried step's start (the log's clock: the same machine).
secs=$(/usr/bin/python3 - "$tmp/frozen.log" "$stopped_at" <<'PY'
import datetime, re, sys
log, stopped = sys.argv[1], float(sys.argv[2])
day = datetime.datetime.fromtimestamp(stopped)
base = day.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
for line in open(log, errors="replace"):
    if "running it again" in line:
        m = re.search(r"\[(\d\d):(\d\d):(\d\d\.\d+)\]", line)
        t = base + int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])
        print(f"{(t - stopped) % 86400:.1f}")
        break
PY
)
[ -n "$secs" ] && /usr/bin/python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < 20 else 1)" "$secs" \
  && ok "the step ran again $secs s after the node froze" || bad "the step ran again after ${secs:-?} s" "$tmp/frozen.log"
kill -0 "$node1" 2>/dev/null && bad "the frozen process (pid $node1) still exists" || ok "the frozen process is gone"
sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left" || bad "$(nodes_left) node(s) left"
exit $fail
