#!/usr/bin/env bash
# TLS between node processes (CAF's openssl module): a 2-node job with certificates of
# the job's CA trains; a node whose certificate comes from another CA, or a node without
# TLS, cannot join (exit 1 after its join timeout) and the job does not start.
#   tests/integration/tls_test.sh REPO_ROOT BUILD_DIR
set -u
root=$1 build=$2
export TROUPE_BUILD_DIR=$build TROUPE_SETUP_LOG=$(mktemp) TROUPE_SKIP_SETUP=1  # the build tests/run made
tmp=$(mktemp -d)
fail=0
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  [ -n "${KEEP:-}" ] || rm -rf "$tmp" "$TROUPE_SETUP_LOG"
}
trap cleanup EXIT
command -v openssl >/dev/null || { echo "SKIP: no openssl command"; exit 77; }
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; shift; for f in "$@"; do echo "--- $f"; tail -15 "$f"; done; fail=1; }

cert() {  # cert NAME CA: a key and a certificate signed by CA
  openssl req -newkey rsa:2048 -nodes -keyout "$tmp/$1.key" -out "$tmp/$1.csr" -subj "/CN=$1" 2>/dev/null &&
    openssl x509 -req -in "$tmp/$1.csr" -CA "$tmp/$2.pem" -CAkey "$tmp/$2.key" -CAcreateserial \
      -out "$tmp/$1.pem" -days 1 2>/dev/null
}
for ca in ca rogue-ca; do
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$tmp/$ca.key" -out "$tmp/$ca.pem" -days 1 \
    -subj "/CN=troupe-test-$ca" 2>/dev/null || { echo "SKIP: cannot make test certificates"; exit 77; }
done
cert node ca && cert rogue rogue-ca || { echo "SKIP: cannot sign test certificates"; exit 77; }

# A TLS job through the launcher.
"$root/launch/troupe" train --nodes 2 --data-parallel 2 --steps 3 --eval-interval 0 \
  --tls-cert "$tmp/node.pem" --tls-key "$tmp/node.key" --tls-ca "$tmp/ca.pem" >"$tmp/tls.log" 2>&1
rc=$?
[ $rc = 0 ] && grep -q "3/3 |" "$tmp/tls.log" && grep -q "(TLS)" "$tmp/tls.log" && ok "2-node job over TLS" \
  || bad "2-node job over TLS: exit $rc" "$tmp/tls.log"

# Node 0 with the job's certificate; node 1 with another CA's, then without TLS.
node=$build/troupe-node
port=$((30000 + $$ % 5000))
for variant in rogue plain; do
  port=$((port + 1))
  env TROUPE_JOB_TOKEN=t TROUPE_NODE=0 TROUPE_NODES=2 TROUPE_COORDINATOR=127.0.0.1:$port TROUPE_JOIN_TIMEOUT_MS=8000 \
    TROUPE_TLS_CERT="$tmp/node.pem" TROUPE_TLS_KEY="$tmp/node.key" TROUPE_TLS_CA="$tmp/ca.pem" \
    "$node" --data-parallel 2 --steps 3 --eval-interval 0 >"$tmp/$variant-0.log" 2>&1 &
  pids+=($!)
  node0=$!
  if [ $variant = rogue ]; then
    tls=(TROUPE_TLS_CERT="$tmp/rogue.pem" TROUPE_TLS_KEY="$tmp/rogue.key" TROUPE_TLS_CA="$tmp/rogue-ca.pem")
  else
    tls=()
  fi
  env TROUPE_JOB_TOKEN=t TROUPE_NODE=1 TROUPE_NODES=2 TROUPE_COORDINATOR=127.0.0.1:$port TROUPE_JOIN_TIMEOUT_MS=4000 \
    "${tls[@]}" "$node" >"$tmp/$variant-1.log" 2>&1
  rc=$?
  wait $node0
  rc0=$?
  [ $rc = 1 ] && grep -q "cannot reach the coordinator" "$tmp/$variant-1.log" \
    && ok "$variant node 1 cannot join (exit 1)" || bad "$variant node 1: exit $rc" "$tmp/$variant-1.log"
  [ $rc0 != 0 ] && ! grep -q "1/3 |" "$tmp/$variant-0.log" && ok "$variant: the job did not start (node 0 exit $rc0)" \
    || bad "$variant: node 0 exit $rc0" "$tmp/$variant-0.log"
done
exit $fail
