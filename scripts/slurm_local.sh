#!/usr/bin/env bash
# A Slurm cluster of several nodes on this machine, for the tests of `reactor slurm` (as root).
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge if they are missing, writes a munge
# key and /etc/slurm/slurm.conf: SLURM_LOCAL_NODES nodes (default 3) named rx1, rx2, ..., each one
# slurmd on this host (`slurmd -N rxI`, its own port, spool and log: Debian's slurmd runs several on
# one host), each with SLURM_LOCAL_CPUS CPUs (default 4: more than the machine has, which
# `config_overrides` allows, so a job's daemons and its batch step fit beside each other). Starts
# munged, slurmctld and the slurmds unless they run already. Idempotent: a second call finds it
# running and exits 0.
#
# Prints "slurm ready: rx1 rx2 ..." on success; exits non-zero with the reason otherwise (the tests
# skip with it). `scripts/slurm_local.sh stop` stops the daemons it started (the test session does,
# at its end, when it started them: tests/conftest.py).
#
# It never touches a Slurm it did not set up. It exits 5 saying why, and changes nothing, where the
# configuration ($SLURM_CONF, else /etc/slurm/slurm.conf; a link counts, even a broken one) is another
# cluster's, or where there is none but signs of a Slurm of the machine's own: its daemons (slurmctld,
# slurmd, slurmdbd, slurmrestd, sackd) running, a configuration elsewhere (/etc/slurm-llnl, a
# configless node's /run/slurm/conf or conf-cache), or Slurm installed by someone else (a cluster
# node, a container with a Slurm of its own).
#
# What it started is recorded in /run/reactor-slurm-local, one line each ("packages", "slurm TOKEN",
# "munge TOKEN"; TOKEN is $REACTOR_TEST_SESSION, which a test session sets, so that the session stops
# only what it started itself).
set -euo pipefail

NODES="${SLURM_LOCAL_NODES:-3}"
CPUS="${SLURM_LOCAL_CPUS:-4}"
HOST="$(hostname -s)"
CONF="${SLURM_CONF:-/etc/slurm/slurm.conf}"
OURS="ClusterName=reactortest"  # the line that makes a configuration this script's
MARK=/run/reactor-slurm-local  # what this script started (see above), for `stop` and the test session
TOKEN="${REACTOR_TEST_SESSION:-manual}"
NAMES="$(seq -f 'rx%g' 1 "$NODES" | tr '\n' ' ')"

if [ "$(id -u)" != 0 ]; then
    echo "slurm_local.sh: needs root (it installs packages and starts slurmctld, slurmd, munged)" >&2
    exit 2
fi
# One at a time: the test session's two xdist workers may each set it up at once (the second found the
# first's slurm.conf.new gone under it). flock holds the lock and runs this script again; -o keeps the
# lock's descriptor from the daemons it starts (which would hold it for good).
if [ -z "${REACTOR_SLURM_LOCAL_LOCKED:-}" ]; then
    REACTOR_SLURM_LOCAL_LOCKED=1 exec flock -o /run/reactor-slurm-local.lock bash "$0" "$@"
fi
refuse() {
    echo "slurm_local.sh: $1: this machine's own Slurm is left alone" >&2
    exit 5
}
if [ -e "$CONF" ] || [ -L "$CONF" ]; then
    grep -qx "$OURS" "$CONF" 2>/dev/null || refuse "$CONF is another cluster's (it has no line $OURS)"
else
    for d in slurmctld slurmd slurmdbd slurmrestd sackd; do
        if pgrep -x "$d" >/dev/null; then refuse "$d runs here with no configuration at $CONF"; fi
    done
    for f in /etc/slurm-llnl/slurm.conf /run/slurm/conf /var/spool/slurmd/conf-cache; do
        if [ -e "$f" ]; then refuse "there is no $CONF but there is $f"; fi
    done
    if { command -v slurmctld || command -v slurmd || command -v sbatch; } >/dev/null \
            && ! grep -qx packages "$MARK" 2>/dev/null; then
        refuse "Slurm is installed here (not by this script) with no configuration at $CONF"
    fi
fi

gone() {  # wait up to 15 s until no process of these names runs; 1 if one still does
    for _ in $(seq 1 30); do
        local left=0
        for n in "$@"; do
            if pgrep -x "$n" >/dev/null; then left=1; fi
        done
        if [ "$left" = 0 ]; then return 0; fi
        sleep 0.5
    done
    return 1
}
stop_all() {  # and wait until they are gone: a stopping slurmctld still saves its state
    pkill -x slurmd || true
    pkill -x slurmctld || true
    if ! gone slurmd slurmctld; then
        pkill -9 -x slurmd || true
        pkill -9 -x slurmctld || true
    fi
}
if [ "${1:-}" = stop ]; then
    stop_all
    if grep -q "^munge " "$MARK" 2>/dev/null; then  # (a munged it found running is not its to stop)
        # and wait until it is gone: a start right after this one that still saw it running would not
        # start its own, and its Slurm would then find no munge socket (every sinfo fails: seen, a
        # second pytest run skipping the Slurm tests after 7 minutes of waiting for idle nodes)
        pkill -x munged || true
        gone munged || pkill -9 -x munged || true
    fi
    if grep -qx packages "$MARK" 2>/dev/null; then  # (the packages stay installed, and still its own)
        echo packages > "$MARK"
    else
        rm -f "$MARK"
    fi
    exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
        || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    # Debian's packages start their services through systemd, which is not there: block that.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get update -qq >/dev/null 2>&1 || true
    if ! apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/tmp/slurm-apt.log 2>&1; then
        echo "slurm_local.sh: apt-get install slurmctld slurmd slurm-client munge failed: $(tail -3 /tmp/slurm-apt.log)" >&2
        exit 3
    fi
    echo packages >> "$MARK"
fi

mkdir -p /etc/munge /var/log/munge /var/lib/munge /run/munge "$(dirname "$CONF")" /var/spool/slurmctld /var/log/slurm
for n in $NAMES; do mkdir -p "/var/spool/slurmd.$n"; done
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /var/log/munge /var/lib/munge /run/munge
chmod 0700 /etc/munge /var/log/munge /var/lib/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key

NODELINES=""
i=0
for n in $NAMES; do
    i=$((i + 1))
    NODELINES="${NODELINES}NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((17000 + i)) CPUs=$CPUS State=UNKNOWN
"
done
NODELINES="${NODELINES%$'\n'}"
cat > "$CONF.new" <<EOF
ClusterName=reactortest
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd.%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.%n.log
$NODELINES
PartitionName=debug Nodes=rx[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
if ! cmp -s "$CONF.new" "$CONF" 2>/dev/null; then
    mv "$CONF.new" "$CONF"
    changed=1
else
    rm -f "$CONF.new"
    changed=0
fi

if ! pgrep -x munged >/dev/null || [ ! -S /run/munge/munge.socket.2 ]; then
    # (a munged that runs with no socket is one on its way out: wait for it, then start ours)
    gone munged || true
    if ! pgrep -x munged >/dev/null; then
        runuser -u munge -- /usr/sbin/munged
        echo "munge $TOKEN" >> "$MARK"
    fi
fi
if [ "$changed" = 1 ]; then
    stop_all
fi
if ! pgrep -x slurmctld >/dev/null; then
    /usr/sbin/slurmctld
    echo "slurm $TOKEN" >> "$MARK"
fi
for n in $NAMES; do
    if ! pgrep -f "slurmd -N $n\$" >/dev/null; then
        /usr/sbin/slurmd -N "$n"
    fi
done

for _ in $(seq 1 60); do
    ready=1
    for n in $NAMES; do
        state="$(timeout 5 sinfo -h -n "$n" -o '%t' 2>/dev/null || true)"
        case "$state" in
            idle|mix|alloc|comp) ;;
            down*|drain*) scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true; ready=0 ;;
            *) ready=0 ;;
        esac
    done
    if [ "$ready" = 1 ]; then echo "slurm ready: $NAMES"; exit 0; fi
    sleep 1
done
echo "slurm_local.sh: nodes $NAMES did not all become idle (sinfo: $(timeout 5 sinfo -h -o '%n %t' 2>&1 | tr '\n' ' ')); see /var/log/slurm/" >&2
exit 4
