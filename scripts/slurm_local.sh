#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the tests of `reactor slurm` (as root).
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge if they are missing, writes a munge
# key and /etc/slurm/slurm.conf (one node: this host, named by `hostname -s`, with
# SLURM_LOCAL_CPUS CPUs, default 8: more than the machine has, which `config_overrides` allows, so
# a job's daemons and its batch step fit beside each other), and starts munged, slurmctld and slurmd
# unless they run already. Idempotent: a second call finds it running and exits 0.
#
# Prints "slurm ready: NODE" on success; exits non-zero with the reason otherwise (the tests skip
# with it). `scripts/slurm_local.sh stop` stops the three daemons.
set -euo pipefail

NODE="$(hostname -s)"
CPUS="${SLURM_LOCAL_CPUS:-8}"
CONF=/etc/slurm/slurm.conf

if [ "$(id -u)" != 0 ]; then
    echo "slurm_local.sh: needs root (it installs packages and starts slurmctld, slurmd, munged)" >&2
    exit 2
fi

if [ "${1:-}" = stop ]; then
    pkill -x slurmd || true
    pkill -x slurmctld || true
    pkill -x munged || true
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
fi

mkdir -p /etc/munge /var/log/munge /var/lib/munge /run/munge /etc/slurm /var/spool/slurmctld /var/spool/slurmd \
    /var/log/slurm
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /var/log/munge /var/lib/munge /run/munge
chmod 0700 /etc/munge /var/log/munge /var/lib/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key

cat > "$CONF.new" <<EOF
ClusterName=reactortest
SlurmctldHost=$NODE
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
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$NODE CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
if ! cmp -s "$CONF.new" "$CONF" 2>/dev/null; then
    mv "$CONF.new" "$CONF"
    changed=1
else
    rm -f "$CONF.new"
    changed=0
fi

if ! pgrep -x munged >/dev/null; then
    runuser -u munge -- /usr/sbin/munged
fi
if [ "$changed" = 1 ]; then
    pkill -x slurmd || true
    pkill -x slurmctld || true
    sleep 1
fi
if ! pgrep -x slurmctld >/dev/null; then
    /usr/sbin/slurmctld
fi
if ! pgrep -x slurmd >/dev/null; then
    /usr/sbin/slurmd
fi

for _ in $(seq 1 60); do
    state="$(sinfo -h -n "$NODE" -o '%t' 2>/dev/null || true)"
    case "$state" in
        idle|mix|alloc|comp) echo "slurm ready: $NODE"; exit 0 ;;
        down*|drain*) scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 1
done
echo "slurm_local.sh: node $NODE did not become idle (sinfo says '${state:-nothing}'); see /var/log/slurm/" >&2
exit 4
