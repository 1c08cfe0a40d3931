#!/usr/bin/env bash
# The launcher's --hostfile path over a real ssh: an sshd on a free port of this machine
# (the system's, or Debian's openssh-server unpacked into the build folder: nothing is
# installed, no service started) and a hostfile naming 127.0.0.1 and localhost. Checks:
# a short job runs in the launcher's folder (relative paths, an argument with a space);
# the token is in the nodes' environment and on no command line; TROUPE_* and UCX_*
# variables reach the nodes; a node killed in the middle of a job is started again over
# ssh and rejoins, bit-identical to a fault-free run on this machine; SIGINT stops every
# node (exit 130); a launcher killed with SIGKILL leaves no node behind (the nodes' ssh
# input ends, a watcher on the host stops them). Then a second network host: node 1 in a
# network namespace of its own (own address, a veth link, an sshd there), UCX over TCP
# between the two: bit-identical to the local run (skipped where no namespace can be made);
# then that host goes silent (its processes stopped) and, with --min-nodes 1, the job goes
# on on the first host alone, bit-identical too.
#   tests/integration/ssh_test.sh REPO_ROOT BUILD_DIR      (exit 77: no sshd to be had, or not root)
source "$(dirname "$0")/../support/launcher_lib.sh" "$@"
skip() { echo "skip: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root (an sshd that logs in as this user)"
command -v ssh >/dev/null && command -v ssh-keygen >/dev/null || skip "no ssh client"

# --- an sshd --------------------------------------------------------------------------
sshd=/usr/sbin/sshd libs=""
if [ ! -x $sshd ]; then
  deps=$TROUPE_BUILD_DIR/test-deps/openssh
  if [ ! -x "$deps/usr/sbin/sshd" ]; then
    unpack_debs "$deps" "$tmp/apt.log" openssh-server libwrap0 ||
      skip "no sshd, and apt-get download openssh-server failed"
  fi
  sshd=$deps/usr/sbin/sshd libs=$deps/usr/lib/x86_64-linux-gnu:$deps/lib/x86_64-linux-gnu
fi
s=$tmp/ssh port=$(free_port)
mkdir -p "$s" /run/sshd
ssh-keygen -q -t ed25519 -N '' -f "$s/host" && ssh-keygen -q -t ed25519 -N '' -f "$s/user" && cp "$s/user.pub" "$s/auth"
cat >"$s/sshd_config" <<EOF
Port $port
ListenAddress 127.0.0.1
HostKey $s/host
AuthorizedKeysFile $s/auth
PidFile $s/sshd.pid
StrictModes no
UsePAM no
PasswordAuthentication no
PermitRootLogin prohibit-password
EOF
cat >"$s/config" <<EOF
Host 127.0.0.1 localhost
  Port $port
  IdentityFile $s/user
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
EOF
# sshd wants its privilege separation user; where there is none (the package was not
# installed), it sees a passwd with one in a mount namespace of its own.
[ -n "$(id -u sshd 2>/dev/null)" ] || { cp /etc/passwd "$s/passwd" && echo 'sshd:x:65534:65534:sshd:/run/sshd:/usr/sbin/nologin' >>"$s/passwd"; }
sshd_pids=()
start_sshd() {  # start_sshd CONFIG LOG [PREFIX...]: PREFIX e.g. `ip netns exec NS`
  local config=$1 log=$2
  shift 2
  if [ ! -f "$s/passwd" ]; then
    "$@" env LD_LIBRARY_PATH="$libs" "$sshd" -f "$config" -D -e 2>"$log" &
  else
    "$@" unshare --mount sh -c "mount --bind '$s/passwd' /etc/passwd && exec env LD_LIBRARY_PATH='$libs' '$sshd' -f '$config' -D -e" \
      2>"$log" &
  fi
  sshd_pids+=($!)
}
ns=""
stop_all() {
  [ ${#sshd_pids[@]} -gt 0 ] && kill "${sshd_pids[@]}" 2>/dev/null
  [ -n "$ns" ] && ip netns del "$ns" 2>/dev/null
  cleanup
}
trap stop_all EXIT
start_sshd "$s/sshd_config" "$tmp/sshd.log"
export TROUPE_SSH="ssh -F $s/config"
for ((i = 0; i < 50; i++)); do $TROUPE_SSH -o BatchMode=yes localhost true 2>/dev/null && break; sleep 0.2; done
$TROUPE_SSH -o BatchMode=yes localhost true 2>"$tmp/ssh.err" || { cat "$tmp/ssh.err" "$tmp/sshd.log"; skip "the test's sshd does not let us in"; }
ok "sshd on port $port"

work=$tmp/work
mkdir -p "$work"
printf '# the job'"'"'s hosts\n127.0.0.1\nlocalhost   # node 1\n' >"$work/hosts"
cd "$work"

# --- a short job in the launcher's folder ----------------------------------------------
"$launcher" train "${small[@]}" --hostfile hosts --data-parallel 2 --steps 3 --eval-interval 0 --checkpoint-dir ckpt \
  --trace "t r.json" >short.log 2>&1
rc=$?
[ $rc = 0 ] && ok "2 nodes over ssh: exit 0" || bad "2 nodes over ssh: exit $rc" short.log
grep -q "node 0 of 2: 127.0.0.1 (ssh pid" short.log && grep -q "node 1 of 2: localhost (ssh pid" short.log \
  && ok "prints where each node runs" || bad "no node lines" short.log
grep -q "3/3 |" short.log && ok "progress lines" || bad "no progress line" short.log
ls ckpt/*/ >/dev/null 2>&1 && [ -s "t r.json" ] && ok "relative paths (and a space) are the launcher's folder's" \
  || bad "no checkpoint in ./ckpt or no './t r.json'" short.log
sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left after the job" || bad "$(nodes_left) node(s) left after the job"

# --- a long job: environment and command lines; SIGINT --------------------------------
node_pid() { own_pids | while read -r p; do
  tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "TROUPE_NODE=$1" && echo "$p"; done | head -1; }
long() {  # log: a long job started in the background (job control: SIGINT reaches it)
  UCX_TLS=tcp,sm,self TROUPE_TEST_MARK=a\ b "$launcher" train "${small[@]}" --hostfile hosts --data-parallel 2 --steps 5000 \
    --eval-interval 0 --global-batch 16 >"$1" 2>&1 &
  pid=$!
  for ((i = 0; i < 600; i++)); do grep -q "2/5000 |" "$1" 2>/dev/null && break; sleep 0.2; done
  grep -q "2/5000 |" "$1" || bad "the long job did not start" "$1"
}
set -m
long int.log
p1=$(node_pid 1)
env1=$(tr '\0' '\n' <"/proc/${p1:-0}/environ" 2>/dev/null)
token=$(echo "$env1" | sed -n 's/^TROUPE_JOB_TOKEN=//p')
[ ${#token} = 32 ] && ok "node 1 has the job's token in its environment" || bad "node 1 (pid ${p1:-none}): no token"
found=$(for c in /proc/[0-9]*/cmdline; do tr '\0' ' ' 2>/dev/null <"$c" | grep -l -F -- "${token:-none}" >/dev/null && echo "$c"; done)
[ -z "$found" ] && ok "the token is on no command line" || bad "the token is on a command line: $found"
echo "$env1" | grep -qx "UCX_TLS=tcp,sm,self" && echo "$env1" | grep -qx "TROUPE_TEST_MARK=a b" \
  && ok "UCX_* and TROUPE_* variables reach the nodes" || bad "UCX_TLS or TROUPE_TEST_MARK not on node 1"
# 127.0.0.1 and localhost are two host names: node 1 is the first node process of its host.
echo "$env1" | grep -qx "TROUPE_LOCAL_NODE=0" && echo "$env1" | grep -qx "TROUPE_NODES_PER_HOST=1" \
  && ok "node 1 is its host's only node process" || bad "TROUPE_LOCAL_NODE / TROUPE_NODES_PER_HOST on node 1"
kill -INT $pid
wait $pid
rc=$?
[ $rc = 130 ] && ok "SIGINT: launcher exits 130" || bad "SIGINT: launcher exit $rc" int.log
# The launcher asked node 0 (through the watcher beside it on its host) to end the job
# after its step.
grep -q "stopped by SIGTERM after step .* of 5000: nothing saved" int.log \
  && ok "SIGINT: node 0 over ssh ended the job after its step" || bad "SIGINT: node 0 was not stopped after its step" int.log
sleep 1
[ "$(nodes_left)" = 0 ] && ok "SIGINT: no node left" || bad "SIGINT: $(nodes_left) node(s) left"

# --- the launcher killed (SIGKILL): its nodes' ssh input ends, they stop ----------------
long kill.log
kill -KILL $pid
wait $pid 2>/dev/null
for ((i = 0; i < 50; i++)); do [ "$(nodes_left)" = 0 ] && break; sleep 0.2; done
[ "$(nodes_left)" = 0 ] && ok "launcher SIGKILLed: every node stopped within $((i / 5)) s" \
  || bad "launcher SIGKILLed: $(nodes_left) node(s) left after 10 s"
own_pids ssh | xargs -r kill -KILL 2>/dev/null
set +m

# --- node 1 lost: started again over ssh, rejoins; the same result as on this machine --
# --global-batch 16 (here, in job30 and in long above): half the default batch in as many
# micro-batches, the same messages in about 60 % of the CPU time (the suite is CPU-bound).
job=(train "${small[@]}" --pipeline 2 --data-parallel 2 --steps 10 --eval-interval 0 --global-batch 16)
"$launcher" "${job[@]}" --nodes 2 --metrics ref.jsonl --save ref.pt >ref.log 2>&1 \
  && ok "fault-free reference (local node processes)" || bad "fault-free reference" ref.log
"$launcher" "${job[@]}" --hostfile hosts --kill-node 1:4 --metrics got.jsonl --save got.pt >got.log 2>&1
rc=$?
[ $rc = 0 ] && grep -q "node 1 ended (status 137); starting it again" got.log && grep -q "node 1 of 2: localhost (ssh pid .*), rejoining" got.log \
  && grep -q "node 1 rejoined .* rebuilding its actors" got.log && ! grep -q "the job failed" got.log \
  && ok "node 1 killed: started again over ssh, rejoined, no job restart" || bad "node 1 killed: exit $rc, no rejoin" got.log
out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" "$work/ref" "$work/got" 0 2>&1) \
  && ok "ssh run with a rejoin bit-identical to the local run ($out)" || { echo "$out"; bad "results differ" got.log; }
sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left" || bad "$(nodes_left) node(s) left"

# --- a second network host: node 1 in a network namespace of its own (its own address,
# a veth link to this one, an sshd there), reached over ssh; UCX over TCP between them --
tag=$$
ns=troupe-ssh-$tag va=tsa$((tag % 100000)) vb=tsb$((tag % 100000)) net=10.78.$((tag % 200 + 1))
if ! command -v ip >/dev/null || ! ip netns add "$ns" 2>"$tmp/netns.err"; then
  echo "SKIP second network host: cannot create a network namespace ($(cat "$tmp/netns.err" 2>/dev/null))"
  ns=""
else
  ip link add "$va" type veth peer name "$vb" && ip link set "$vb" netns "$ns" \
    && ip addr add "$net.1/24" dev "$va" && ip link set "$va" up \
    && ip -n "$ns" addr add "$net.2/24" dev "$vb" && ip -n "$ns" link set "$vb" up && ip -n "$ns" link set lo up \
    || bad "veth link to the namespace"
  for end in 1 2; do
    sed "s/^ListenAddress .*/ListenAddress $net.$end/; s|^PidFile .*|PidFile $s/sshd$end.pid|" "$s/sshd_config" >"$s/sshd_config$end"
  done
  start_sshd "$s/sshd_config1" "$tmp/sshd1.log"
  start_sshd "$s/sshd_config2" "$tmp/sshd2.log" ip netns exec "$ns"
  printf 'Host %s %s\n  Port %s\n  IdentityFile %s\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n' \
    "$net.1" "$net.2" "$port" "$s/user" >>"$s/config"
  for ((i = 0; i < 50; i++)); do $TROUPE_SSH -o BatchMode=yes "$net.2" true 2>/dev/null && break; sleep 0.2; done
  inside=$($TROUPE_SSH -o BatchMode=yes "$net.2" ip -o -4 addr show dev "$vb" 2>"$tmp/ssh2.err")
  echo "$inside" | grep -q "$net.2/24" && ok "ssh to $net.2 lands in the namespace" || bad "ssh to $net.2: '$inside'" "$tmp/ssh2.err"
  printf '%s\n%s\n' "$net.1" "$net.2" >hosts2
  # Each node has one of the two veth ends: UCX over TCP on it, nothing shared in memory.
  UCX_TLS=tcp,self UCX_NET_DEVICES="$va,$vb" "$launcher" "${job[@]}" --hostfile hosts2 --metrics net.jsonl \
    --save net.pt >net.log 2>&1
  rc=$?
  [ $rc = 0 ] && grep -q "node 1 of 2: $net.2 (ssh pid" net.log \
    && ok "node 0 on $net.1, node 1 on $net.2 (another network namespace): exit 0" || bad "second network host: exit $rc" net.log
  out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" "$work/ref" "$work/net" 0 2>&1) \
    && ok "across the two network hosts bit-identical to the local run ($out)" || { echo "$out"; bad "results differ" net.log; }
  sleep 0.5
  [ "$(nodes_left)" = 0 ] && ok "no node left" || bad "$(nodes_left) node(s) left"

  # The second host goes silent (every process in its namespace stopped: its sshd, the
  # node, the node's session): ssh's keep-alives end node 1's connection (status 255),
  # the launcher's probe of the host times out, and with --min-nodes 1 the job goes on
  # from its checkpoint on node 0's host alone (the same layout in one node process):
  # bit-identical to the local run.
  job30=(train "${small[@]}" --pipeline 2 --data-parallel 2 --steps 30 --eval-interval 0 --global-batch 16)
  "$launcher" "${job30[@]}" --nodes 1 --metrics ref30.jsonl --save ref30.pt >ref30.log 2>&1 \
    || bad "fault-free 30-step reference" ref30.log
  UCX_TLS=tcp,self UCX_NET_DEVICES="$va,$vb" "$launcher" "${job30[@]}" --hostfile hosts2 --min-nodes 1 \
    --checkpoint-dir ck30 --checkpoint-interval 2 --metrics silent.jsonl --save silent.pt >silent.log 2>&1 &
  pid=$!
  for ((i = 0; i < 600; i++)); do grep -q "step  6/30 |" silent.log 2>/dev/null && break; sleep 0.1; done
  stopped=$(ip netns pids "$ns")
  kill -STOP $stopped
  wait $pid
  rc=$?
  kill -KILL $stopped 2>/dev/null
  # Which end notices first is a race: the launcher, when ssh's keep-alives end node 1's
  # connection (it then probes the host and stops the job to go on without it), or node
  # 0, when node 1 does not rejoin in time (the job fails with 75 and restarts). Either
  # way the relaunch finds the host unfit and goes on without it.
  missing=""
  for want in "node 1 ended (status 255) and its host $net.2 cannot run a node (.*): stopping the job\|the job failed (status 75); restart 1" \
    "going on without host(s) $net.2, .* on 1 node(s): $net.1" "node 0 of 1: $net.1"; do
    grep -q "$want" silent.log || missing+=" [$want]"
  done
  [ $rc = 0 ] && [ -z "$missing" ] && ok "$net.2 went silent: its connection ended, the job went on on $net.1 alone" ||
    { grep "^troupe:" silent.log; bad "silent host: exit $rc, no line$missing" silent.log; }
  out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" "$work/ref30" "$work/silent" 1 2>&1) \
    && ok "bit-identical to the local run ($out)" || { echo "$out"; bad "silent host: results differ" silent.log; }
  sleep 0.5
  [ "$(nodes_left)" = 0 ] && ok "no node left" || bad "$(nodes_left) node(s) left"
fi
exit $fail
