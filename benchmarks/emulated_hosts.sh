#!/usr/bin/env bash
# Two emulated hosts on one machine: network namespaces joined by a veth pair whose two ends are each
# rate-limited by a tbf qdisc (so each direction carries at most --rate), with an optional netem delay.
# Runs COMMAND twice, as rank 0 in the first namespace and rank 1 in the second (RANK, WORLD_SIZE,
# LOCAL_RANK, MASTER_ADDR, MASTER_PORT and GLOO_SOCKET_IFNAME set, as torchrun would on two hosts), and
# removes the namespaces, the veth pair and the qdiscs on exit, whatever happens. Needs root.
#
#   sudo benchmarks/emulated_hosts.sh [--rate 1gbit] [--delay 0ms] [--burst 512kb] -- COMMAND [ARGS...]
#   sudo benchmarks/emulated_hosts.sh -- .venv/bin/python benchmarks/bench_collectives.py --json out.json
#
# Rank 0 prints to the terminal; rank 1's output goes to a log file shown if it fails.
set -euo pipefail

RATE=1gbit
DELAY=""
BURST=512kb
PORT=29533
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) RATE="$2"; shift 2 ;;
    --delay) DELAY="$2"; shift 2 ;;
    --burst) BURST="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "emulated_hosts.sh: unknown option $1 (put the command after --)" >&2; exit 2 ;;
  esac
done
if [ $# -eq 0 ]; then
  echo "emulated_hosts.sh: no command given; usage: $0 [--rate 1gbit] -- COMMAND [ARGS...]" >&2
  exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "emulated_hosts.sh: needs root (ip netns, tc)" >&2
  exit 2
fi

tag="t$$"
NS0="torsh-h0-$tag"
NS1="torsh-h1-$tag"
IF0="tv0$tag"
IF1="tv1$tag"
IF0="${IF0:0:15}"
IF1="${IF1:0:15}"
IP0=10.213.$(( $$ % 200 )).1
IP1=10.213.$(( $$ % 200 )).2
LOG="$(mktemp /tmp/torsh-rank1-XXXX.log)"

cleanup() {
  ip netns pids "$NS0" 2>/dev/null | xargs -r kill 2>/dev/null || true
  ip netns pids "$NS1" 2>/dev/null | xargs -r kill 2>/dev/null || true
  ip netns del "$NS0" 2>/dev/null || true   # deleting a namespace removes its veth end, the peer and the qdiscs
  ip netns del "$NS1" 2>/dev/null || true
}
trap cleanup EXIT INT TERM

ip netns add "$NS0"
ip netns add "$NS1"
ip link add "$IF0" type veth peer name "$IF1"
ip link set "$IF0" netns "$NS0"
ip link set "$IF1" netns "$NS1"
for side in 0 1; do
  ns=NS$side; ifc=IF$side; ip=IP$side
  ip -n "${!ns}" link set lo up
  ip -n "${!ns}" addr add "${!ip}/24" dev "${!ifc}"
  ip -n "${!ns}" link set "${!ifc}" up
  if [ -n "$DELAY" ]; then
    ip netns exec "${!ns}" tc qdisc add dev "${!ifc}" root handle 1: netem delay "$DELAY"
    ip netns exec "${!ns}" tc qdisc add dev "${!ifc}" parent 1:1 handle 10: tbf rate "$RATE" burst "$BURST" latency 100ms
  else
    ip netns exec "${!ns}" tc qdisc add dev "${!ifc}" root tbf rate "$RATE" burst "$BURST" latency 100ms
  fi
done

echo "emulated hosts: $NS0 ($IP0) <-> $NS1 ($IP1), tbf rate $RATE burst $BURST per direction${DELAY:+, netem delay $DELAY}" >&2
common=(WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR="$IP0" MASTER_PORT="$PORT"
        TORSH_BENCH_NETWORK="two network namespaces, veth pair, tbf $RATE per direction${DELAY:+, delay $DELAY}")
ip netns exec "$NS1" env "${common[@]}" RANK=1 GLOO_SOCKET_IFNAME="$IF1" "$@" >"$LOG" 2>&1 &
pid1=$!
set +e
ip netns exec "$NS0" env "${common[@]}" RANK=0 GLOO_SOCKET_IFNAME="$IF0" "$@"
rc0=$?
wait "$pid1"
rc1=$?
set -e
if [ "$rc1" -ne 0 ]; then
  echo "rank 1 exited with $rc1; its output:" >&2
  cat "$LOG" >&2
fi
rm -f "$LOG"
[ "$rc0" -ne 0 ] && exit "$rc0"
exit "$rc1"
