#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces joined by a veth pair, one node process
# in each (UCX over TCP on the veth link, CAF between 10.77.x.1 and 10.77.x.2). The job
# trains; then the link is cut and the coordinator must notice the lost node within its
# connection timeout (5 s) and end the job with an error naming it.
# Needs root and `ip netns`: otherwise the test is skipped (exit 77) and says why.
#   tests/integration/netns_test.sh path/to/troupe-node
set -uo pipefail
node_bin=$1
skip() { echo "SKIP: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root to create network namespaces"
command -v ip >/dev/null || skip "no ip command (iproute2)"

tag=$$
ns_a=troupe-a-$tag ns_b=troupe-b-$tag
veth_a=tra$((tag % 100000)) veth_b=trb$((tag % 100000))
net=10.77.$((tag % 200 + 1))
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  wait 2>/dev/null
  ip netns del "$ns_a" 2>/dev/null
  ip netns del "$ns_b" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
ip netns add "$ns_a" 2>"$work/err" || skip "cannot create network namespaces: $(cat "$work/err")"
ip netns add "$ns_b" || skip "cannot create a second network namespace"
ip link add "$veth_a" type veth peer name "$veth_b" || skip "cannot create a veth pair"
ip link set "$veth_a" netns "$ns_a" && ip link set "$veth_b" netns "$ns_b" || skip "cannot move veth ends"
ip -n "$ns_a" addr add "$net.1/24" dev "$veth_a"
ip -n "$ns_b" addr add "$net.2/24" dev "$veth_b"
for ns in "$ns_a" "$ns_b"; do ip -n "$ns" link set lo up; done
ip -n "$ns_a" link set "$veth_a" up
ip -n "$ns_b" link set "$veth_b" up

port=29$((tag % 1000 + 100))
common=(TROUPE_JOB_TOKEN=netns-$tag TROUPE_NODES=2 TROUPE_COORDINATOR=$net.1:$port UCX_TLS=tcp,self OMP_NUM_THREADS=1)
ip netns exec "$ns_a" env "${common[@]}" TROUPE_NODE=0 UCX_NET_DEVICES="$veth_a" \
  "$node_bin" --pipeline 2 --data-parallel 2 --steps 2000 --eval-interval 0 >"$work/node0.log" 2>&1 &
pids+=($!)
ip netns exec "$ns_b" env "${common[@]}" TROUPE_NODE=1 UCX_NET_DEVICES="$veth_b" \
  "$node_bin" >"$work/node1.log" 2>&1 &
pids+=($!)

fail() {
  echo "FAIL: $*"
  echo "--- node 0:"; tail -20 "$work/node0.log"
  echo "--- node 1:"; tail -20 "$work/node1.log"
  exit 1
}
for ((i = 0; i < 600; i++)); do
  grep -q "5/2000 |" "$work/node0.log" 2>/dev/null && break
  kill -0 "${pids[0]}" 2>/dev/null || fail "node 0 ended before training across the namespaces"
  sleep 0.2
done
grep -q "5/2000 |" "$work/node0.log" || fail "no 5 steps across the namespaces within 120 s"
echo "trained 5 steps across two network namespaces; cutting the link"
ip -n "$ns_a" link set "$veth_a" down
cut=$(date +%s%N)
for ((i = 0; i < 900; i++)); do
  kill -0 "${pids[0]}" 2>/dev/null || break
  sleep 0.1
done
took=$(awk -v a="$(date +%s%N)" -v b="$cut" 'BEGIN { printf "%.1f", (a - b) / 1e9 }')
kill -0 "${pids[0]}" 2>/dev/null && fail "node 0 still running 90 s after the link was cut"
wait "${pids[0]}"
status=$?
[ "$status" = 75 ] || fail "node 0 exited with $status, expected 75 (recoverable: the launcher would restart the job)"
grep -q "node 1 is gone" "$work/node0.log" || fail "node 0 did not name the lost node"
echo "node 0 ended the job ${took} s after the cut: $(grep -m1 'node 1 is gone' "$work/node0.log")"
awk -v t="$took" 'BEGIN { exit !(t < 15) }' || fail "took ${took} s (connection timeout is 5 s)"
echo PASS
