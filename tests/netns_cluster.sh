#!/bin/bash
# Two "hosts" on this machine for multi-host tests: network namespaces joined by a veth pair, each with its
# own address (10.77.N.1 and 10.77.N.2) and, when a command enters it, its own hostname (h0, h1). Open MPI
# launches across them over TCP as over two machines: mpirun runs "on h0", and this script is its rsh
# agent, entering the namespace of the host it is asked for.
#
#   netns_cluster.sh check                   exit 0 where namespaces can be made here (root, ip, unshare)
#   netns_cluster.sh up NAME                 make cluster NAME (NAME: a few letters and digits)
#   netns_cluster.sh on NAME HOST CMD...     run CMD on HOST (h0 or h1) of cluster NAME
#   netns_cluster.sh mpirun NAME ARGS...     mpirun ARGS on h0, ranks placed 2 per host (h0 first), TCP between
#   netns_cluster.sh partition NAME          take the link between the hosts down
#   netns_cluster.sh slow NAME RATE          limit the link to RATE each way (tc tbf, e.g. 4mbit)
#   netns_cluster.sh down NAME               remove the cluster (also after a partial `up`)
#   netns_cluster.sh agent HOST CMD...       the rsh agent mpirun calls (LOOM_NETNS_CLUSTER names the cluster)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
self="$here/$(basename "${BASH_SOURCE[0]}")"

ns() { echo "loom-$1-$2"; }   # the namespace of host $2 of cluster $1

subnet() {   # a /24 per cluster name, so that clusters of tests run side by side do not clash
    echo "10.77.$(( $(printf '%s' "$1" | cksum | cut -d' ' -f1) % 250 + 1 ))"
}

enter() {   # enter host $2 of cluster $1 with its own hostname, then run the rest
    local cluster=$1 host=$2
    shift 2
    exec ip netns exec "$(ns "$cluster" "$host")" unshare --uts sh -c "hostname $host && exec \"\$@\"" sh "$@"
}

case "${1:-}" in
check)
    [ "$(id -u)" = 0 ] || { echo "not root"; exit 1; }
    command -v ip > /dev/null && command -v unshare > /dev/null || { echo "no ip or unshare command"; exit 1; }
    probe="loom-probe-$$"
    ip netns add "$probe" 2> /dev/null || { echo "cannot create a network namespace"; exit 1; }
    ip netns del "$probe"
    ;;
up)
    cluster=$2
    net=$(subnet "$cluster")
    for host in h0 h1; do
        ip netns add "$(ns "$cluster" "$host")"
        ip -n "$(ns "$cluster" "$host")" link set lo up
        # `ip netns exec` mounts /etc/netns/<namespace>/hosts over /etc/hosts: each host resolves both names.
        mkdir -p "/etc/netns/$(ns "$cluster" "$host")"
        printf '127.0.0.1 localhost\n%s.1 h0\n%s.2 h1\n' "$net" "$net" > "/etc/netns/$(ns "$cluster" "$host")/hosts"
    done
    ip link add "v$cluster-0" netns "$(ns "$cluster" h0)" type veth peer name "v$cluster-1" netns "$(ns "$cluster" h1)"
    ip -n "$(ns "$cluster" h0)" addr add "$net.1/24" dev "v$cluster-0"
    ip -n "$(ns "$cluster" h1)" addr add "$net.2/24" dev "v$cluster-1"
    ip -n "$(ns "$cluster" h0)" link set "v$cluster-0" up
    ip -n "$(ns "$cluster" h1)" link set "v$cluster-1" up
    ;;
on)
    cluster=$2 host=$3
    shift 3
    enter "$cluster" "$host" "$@"
    ;;
mpirun)
    cluster=$2
    shift 2
    net=$(subnet "$cluster")
    hostfile=$(mktemp)
    printf 'h0 slots=2\nh1 slots=2\n' > "$hostfile"
    export LOOM_NETNS_CLUSTER=$cluster
    # TCP between the hosts on the cluster's subnet only; shared memory within a host.
    ip netns exec "$(ns "$cluster" h0)" unshare --uts sh -c 'hostname h0 && exec "$@"' sh \
        mpirun --hostfile "$hostfile" --mca plm_rsh_agent "$self agent" --mca btl self,vader,tcp \
        --mca btl_tcp_if_include "$net.0/24" --mca oob_tcp_if_include "$net.0/24" \
        --mca btl_vader_single_copy_mechanism none "$@" &
    launcher=$!
    # Our caller may time out and kill this script: mpirun goes with it.
    trap 'kill -9 $launcher 2> /dev/null || true; rm -f "$hostfile"' EXIT
    status=0
    wait $launcher || status=$?
    exit $status
    ;;
partition)
    cluster=$2
    ip -n "$(ns "$cluster" h0)" link set "v$cluster-0" down
    ;;
slow)
    # A token bucket on both ends of the link (tbf: this kernel has no netem, so no added delay or loss).
    cluster=$2
    rate=$3
    for host in 0 1; do
        ip netns exec "$(ns "$cluster" "h$host")" tc qdisc add dev "v$cluster-$host" root tbf rate "$rate" burst 16kb latency 2s
    done
    ;;
down)
    cluster=$2
    for host in h0 h1; do
        # Whatever still runs inside (a launcher waiting for a lost daemon) goes first.
        for pid in $(ip netns pids "$(ns "$cluster" "$host")" 2> /dev/null); do kill -9 "$pid" 2> /dev/null || true; done
        ip netns del "$(ns "$cluster" "$host")" 2> /dev/null || true
        rm -rf "/etc/netns/$(ns "$cluster" "$host")"
    done
    ;;
agent)
    host=$2
    shift 2
    enter "$LOOM_NETNS_CLUSTER" "$host" sh -c "$*"
    ;;
*)
    sed -n '2,14p' "$self"
    exit 2
    ;;
esac
