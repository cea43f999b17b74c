# An emulated cluster on this machine, to be sourced: N "nodes" as network namespaces
# (`bd-node1` ... `bd-nodeN`) joined by veth pairs through a bridge, each link shaped with `tc`
# in both directions, and the OpenMPI settings that start ranks inside them without ssh
# (`mpirun` runs a launch agent with a host name and a daemon's command line; the agent runs the
# command inside that host's namespace). Ranks on two nodes talk TCP through the shaped links;
# ranks on one node talk TCP to the node's own address, which never leaves the node (OpenMPI's
# shared-memory transport, `vader`, crashed with SIGSEGV in ranks started inside namespaces on
# this machine, so it is not used). Only traffic between the namespaces made here is
# shaped; everything is torn down by `cluster_down`, which `cluster_up` arms on EXIT.
#
#   . scripts/cluster.sh
#   cluster_check || { echo "skipped: $CLUSTER_SKIP"; exit 0; }
#   cluster_up 2 2 1gbit          # nodes, ranks per node, rate ("" for unshaped)
#   cluster_mpirun CMD ...        # `mpirun` with the cluster's hostfile and settings
#   cluster_launch CLI CMD ...    # the same through `burn-deepspeed launch --mpi N --hostfile`
#   cluster_link_bytes            # bytes the nodes received so far (the links' transmit side)
#   cluster_node_bytes            # bytes sent inside the nodes so far (their loopbacks)
#
# Latency: this kernel kind has no `netem` qdisc, so `cluster_up` cannot add delay; it says so
# when CLUSTER_DELAY is set and netem is missing (see `cluster_delay_supported`).

CLUSTER_NET=10.78.0
CLUSTER_NODES=0
CLUSTER_SLOTS=1
CLUSTER_SKIP=""
CLUSTER_WORK=""

# Whether namespaces can be made here; sets CLUSTER_SKIP to the reason when not.
cluster_check() {
    if [ "$(id -u)" != 0 ]; then
        CLUSTER_SKIP="not root"
        return 1
    fi
    if ! command -v ip > /dev/null || ! command -v tc > /dev/null; then
        CLUSTER_SKIP="no \`ip\` or \`tc\` command (iproute2)"
        return 1
    fi
    if ! ip netns add bd-probe 2> /dev/null; then
        CLUSTER_SKIP="cannot create a network namespace here"
        return 1
    fi
    ip netns del bd-probe
    return 0
}

# Whether `tc` here can delay packets (the netem qdisc).
cluster_delay_supported() {
    ip netns add bd-probe 2> /dev/null || return 1
    local ok=1
    ip netns exec bd-probe tc qdisc add dev lo root netem delay 1ms 2> /dev/null && ok=0
    ip netns del bd-probe
    return $ok
}

cluster_down() {
    local i
    for i in $(seq 1 "${CLUSTER_MAX_NODES:-8}"); do
        # Whatever still runs in a node (a daemon of a failed job) goes first; deleting the
        # host end of the link then frees the pair even while a dying namespace lingers.
        ip netns pids "bd-node$i" 2> /dev/null | xargs -r kill -9 2> /dev/null || true
        ip netns del "bd-node$i" 2> /dev/null || true
        ip link del "bd-veth$i" 2> /dev/null || true
    done
    ip link del br-bd 2> /dev/null || true
    [ -n "$CLUSTER_WORK" ] && rm -rf "$CLUSTER_WORK"
    CLUSTER_WORK=""
}

# Shapes the egress of `dev` (in namespace `ns`, or the host when empty) to `rate`, with
# CLUSTER_DELAY added where netem exists.
cluster_shape() {
    local ns=$1 dev=$2 rate=$3
    local run=()
    [ -n "$ns" ] && run=(ip netns exec "$ns")
    if [ -n "${CLUSTER_DELAY:-}" ]; then
        "${run[@]}" tc qdisc add dev "$dev" root handle 1: netem delay "$CLUSTER_DELAY"
        "${run[@]}" tc qdisc add dev "$dev" parent 1:1 handle 10: \
            tbf rate "$rate" burst 256kb latency 100ms
    else
        "${run[@]}" tc qdisc add dev "$dev" root tbf rate "$rate" burst 256kb latency 100ms
    fi
}

# cluster_up NODES RANKS_PER_NODE [RATE]: makes the nodes, their links (shaped to RATE in both
# directions when given, e.g. `1gbit`), the launch agent and a hostfile.
cluster_up() {
    CLUSTER_NODES=$1
    CLUSTER_SLOTS=$2
    local rate=${3:-} i
    trap cluster_down EXIT
    cluster_down
    if [ -n "${CLUSTER_DELAY:-}" ] && ! cluster_delay_supported; then
        echo "cluster: no netem qdisc in this kernel: links get no added delay" >&2
        CLUSTER_DELAY=""
    fi
    CLUSTER_WORK=$(mktemp -d)
    ip link add br-bd type bridge
    ip addr add "$CLUSTER_NET.1/24" dev br-bd
    ip link set br-bd up
    : > "$CLUSTER_WORK/hosts"
    for i in $(seq 1 "$CLUSTER_NODES"); do
        ip netns add "bd-node$i"
        ip link add "bd-veth$i" type veth peer name eth0 netns "bd-node$i"
        ip link set "bd-veth$i" master br-bd
        ip link set "bd-veth$i" up
        ip -n "bd-node$i" addr add "$CLUSTER_NET.$((10 + i))/24" dev eth0
        ip -n "bd-node$i" link set eth0 up
        # The daemon talks to its ranks over the node's loopback.
        ip -n "bd-node$i" link set lo up
        if [ -n "$rate" ]; then
            # Egress only is shaped: the node's side shapes what it sends, the host's side
            # what it receives.
            cluster_shape "bd-node$i" eth0 "$rate"
            cluster_shape "" "bd-veth$i" "$rate"
        fi
        echo "bd-node$i slots=$CLUSTER_SLOTS" >> "$CLUSTER_WORK/hosts"
    done
    # Bridged frames must not be dropped by a host firewall.
    sysctl -q -w net.bridge.bridge-nf-call-iptables=0 2> /dev/null || true
    # Each node must reach this host (where mpirun listens for its daemons) before a job
    # starts: a daemon that cannot connect back exits, and mpirun then waits for ever.
    for i in $(seq 1 "$CLUSTER_NODES"); do
        local _
        for _ in $(seq 1 50); do
            # Connected, or refused (the host answered): either way it is reachable.
            if ip netns exec "bd-node$i" bash -c "exec 3<> /dev/tcp/$CLUSTER_NET.1/9" \
                2> /dev/null || ip netns exec "bd-node$i" \
                bash -c "exec 3<> /dev/tcp/$CLUSTER_NET.1/9" 2>&1 | grep -q refused; then
                break
            fi
            sleep 0.1
        done
    done
    cat > "$CLUSTER_WORK/nsagent" <<'AGENT'
#!/bin/sh
host="$1"; shift
case "$host" in
    bd-node[0-9]*) ns="$host" ;;
    *) echo "nsagent: unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" sh -c "$*"
AGENT
    chmod +x "$CLUSTER_WORK/nsagent"
}

# The `mpirun` arguments that place ranks in the nodes: the agent, no tree spawn, the daemons'
# and ranks' TCP on the bridge's subnet.
cluster_mpirun_args() {
    CLUSTER_ARGS=(
        --hostfile "$CLUSTER_WORK/hosts" --map-by slot
        --mca plm_rsh_agent "$CLUSTER_WORK/nsagent"
        --mca plm_rsh_no_tree_spawn 1
        --mca oob_tcp_if_include "$CLUSTER_NET.0/24"
        --mca pml ob1
        --mca btl tcp,self
        --mca btl_tcp_if_include "$CLUSTER_NET.0/24"
    )
}

# Bytes delivered into the nodes so far: the transmit counters of the links' host ends, which
# every byte between two nodes crosses once (traffic inside a node does not).
cluster_link_bytes() {
    local i total=0 b
    for i in $(seq 1 "$CLUSTER_NODES"); do
        b=$(cat "/sys/class/net/bd-veth$i/statistics/tx_bytes")
        total=$((total + b))
    done
    echo "$total"
}

# Bytes sent inside the nodes so far: the loopback counters of every node, which carry the
# traffic between two ranks of one node (and between a node's daemon and its ranks).
cluster_node_bytes() {
    local i total=0 b
    for i in $(seq 1 "$CLUSTER_NODES"); do
        b=$(ip netns exec "bd-node$i" cat /sys/class/net/lo/statistics/tx_bytes)
        total=$((total + b))
    done
    echo "$total"
}

# The ranks started in the nodes whose command lines contain $1.
cluster_ranks_running() {
    local i pid
    for i in $(seq 1 "$CLUSTER_NODES"); do
        for pid in $(ip netns pids "bd-node$i" 2> /dev/null); do
            tr '\0' ' ' < "/proc/$pid/cmdline" 2> /dev/null | grep -F -q -- "$1" && echo "$pid"
        done
    done
}

# cluster_retrying NAME PROGRAM -- CMD ...: runs CMD (an mpirun job whose ranks run PROGRAM)
# with stdout to $CLUSTER_WORK/NAME.out and stderr to NAME.err. OpenMPI's rsh launcher,
# driven through the agent, sometimes never starts one of its daemons and then waits for ever
# (seen on this machine in about a third of runs, with no message, before any rank starts):
# such an attempt is ended after 60 s and retried, up to 5 times, and says so. A job whose ranks
# started and then hung or failed fails at once. Returns the job's status.
cluster_retrying() {
    local name=$1 program=$2 attempt rc job started
    shift 3
    for attempt in 1 2 3 4 5; do
        rc=0
        # Its own process group, so that a stuck attempt is ended whole.
        setsid timeout -k 5 "${CLUSTER_JOB_TIMEOUT:-600}" "$@" \
            > "$CLUSTER_WORK/$name.out" 2> "$CLUSTER_WORK/$name.err" &
        job=$!
        started=""
        local waited=0 stuck=""
        while kill -0 "$job" 2> /dev/null; do
            [ -z "$started" ] && [ -n "$(cluster_ranks_running "$program")" ] && started=yes
            if [ -z "$started" ] && [ "$waited" -ge 120 ]; then
                stuck=yes
                kill -9 -- "-$job" 2> /dev/null || true
                break
            fi
            sleep 0.5
            waited=$((waited + 1))
        done
        # (A job ended by the kill above is reported by the shell; that line is noise.)
        wait "$job" 2> /dev/null || rc=$?
        if [ -n "$stuck" ]; then
            echo "cluster: attempt $attempt: mpirun never started its ranks in 60 s; retrying" >&2
            local i
            for i in $(seq 1 "$CLUSTER_NODES"); do
                ip netns pids "bd-node$i" | xargs -r kill -9 2> /dev/null || true
            done
            pkill -9 -f "plm_rsh_agent $CLUSTER_WORK/nsagent" 2> /dev/null || true
            continue
        fi
        return "$rc"
    done
    return 1
}
