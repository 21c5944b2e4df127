#!/usr/bin/env bash
# A real, local, single-node SLURM (Debian slurm-wlm 22.05 + munge) with 8 fake GPUs, so that tests
# and CI can run the pipeline through `snakemake --executor slurm` without a cluster.
#
#   .ci/slurm.sh install          apt-get install slurm-wlm + munge if missing (root, idempotent)
#   .ci/slurm.sh start DIR        config, state, logs and PID files all under DIR; prints on stdout:
#                                   export SLURM_CONF=DIR/slurm.conf
#   .ci/slurm.sh stop DIR         cancels jobs, kills the daemons by the PIDs recorded in DIR
#
#   eval "$(.ci/slurm.sh start /tmp/slurm)"; sbatch --gpus=2 --wrap 'echo $CUDA_VISIBLE_DEVICES'
#
# Needs root (slurmd, mknod). One cluster per host: fixed ports 6817/6818 and /etc/slurm/slurm.conf,
# which is symlinked to DIR/slurm.conf because the snakemake SLURM job step clears SLURM_CONF before
# its inner `srun`. munged is private to DIR (own key and socket), the system munge is not touched.
# There is no slurmdbd, so `sacct` is useless: use the `squeue` status command (MinJobAge is long).
set -euo pipefail

MARKER="# eagle3-datagen local slurm (.ci/slurm.sh)"
ETC_CONF=/etc/slurm/slurm.conf
SBIN=/usr/sbin
export PATH="$PATH:/usr/sbin:/sbin"

log() { echo "slurm.sh: $*" >&2; }
die() { echo "slurm.sh: ERROR: $*" >&2; exit 1; }

need_root() { [[ $(id -u) == 0 ]] || die "'$1' must run as root (slurmd, mknod and munged need it)"; }

installed() {
  local b
  for b in "$SBIN/slurmctld" "$SBIN/slurmd" "$SBIN/munged" /usr/bin/sbatch /usr/bin/sinfo /usr/bin/squeue; do
    [[ -x $b ]] || return 1
  done
}

cmd_install() {
  installed && return 0
  need_root install
  log "installing slurm-wlm and munge with apt-get (about a minute)"
  local out; out=$(mktemp)
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } >"$out" 2>&1; then
    tail -n 20 "$out" >&2; die "apt-get install slurm-wlm munge failed (output above)"
  fi
  rm -f "$out"
  installed || die "slurm-wlm/munge installed but the daemons are still missing under $SBIN"
}

# alive PIDFILE NAME: the PID in PIDFILE is a running process called NAME (guards against PID reuse).
alive() {
  local pid; [[ -s $1 ]] || return 1
  pid=$(<"$1"); [[ $pid =~ ^[0-9]+$ ]] || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1
  [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]]
}

wait_for() {  # wait_for SECONDS WHAT CMD...: poll CMD every 0.2 s
  local secs=$1 what=$2; shift 2
  local end=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < end)) || return 1
    sleep 0.2
  done
}

our_symlink() {  # /etc/slurm/slurm.conf is a symlink made by this script (for any DIR) or absent
  [[ -L $ETC_CONF ]] || return 1
  local target; target=$(readlink "$ETC_CONF")
  [[ ! -e $target ]] || grep -qxF "$MARKER" "$target"
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

write_conf() {
  local dir=$1 c cpus sockets cores threads mem
  c=$("$SBIN/slurmd" -C | head -n1) || die "'slurmd -C' failed: cannot read this machine's CPUs/memory"
  cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$c")
  sockets=$(sed -n 's/.*SocketsPerBoard=\([0-9]*\).*/\1/p' <<<"$c")
  cores=$(sed -n 's/.*CoresPerSocket=\([0-9]*\).*/\1/p' <<<"$c")
  threads=$(sed -n 's/.*ThreadsPerCore=\([0-9]*\).*/\1/p' <<<"$c")
  mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$c")
  [[ -n $cpus && -n $sockets && -n $cores && -n $threads && -n $mem ]] || die "cannot parse 'slurmd -C': $c"
  mem=$((mem * 8 / 10))  # leave 20% to the OS and the daemons
  cat >"$dir/slurm.conf" <<EOF
$MARKER
ClusterName=local
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# Finished jobs stay visible to squeue for 10 min; the snakemake plugin needs >= 3x its first status delay.
MinJobAge=600
GresTypes=gpu
NodeName=localhost CPUs=$cpus Sockets=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$mem Gres=gpu:8 State=UNKNOWN
PartitionName=main Nodes=localhost Default=YES MaxTime=INFINITE State=UP
# Without this every job takes the whole node's memory.
DefMemPerCPU=1000
EOF
  echo "Name=gpu File=$dir/fakedev/nvidia[0-7]" >"$dir/gres.conf"
}

cmd_start() {
  local dir=$1
  need_root start
  installed || die "slurm is not installed (need slurmctld, slurmd, munged, sbatch); run: .ci/slurm.sh install"
  mkdir -p "$dir" && dir=$(cd "$dir" && pwd -P)
  ((${#dir} <= 80)) || die "DIR path too long (${#dir} > 80 chars): the munge socket path must fit 108 bytes"
  alive "$dir/slurmctld.pid" slurmctld && die "a cluster is already running from $dir; run: .ci/slurm.sh stop $dir"
  local p; for p in 6817 6818; do
    port_busy $p && die "port $p is in use: another slurmctld/slurmd runs on this host; stop it first"
  done
  if [[ -e $ETC_CONF || -L $ETC_CONF ]] && ! our_symlink; then
    die "$ETC_CONF exists and is not ours; refusing to replace it (jobs run by snakemake need it, see header)"
  fi
  # From here on, a failure stops whatever was started.
  trap 'log "start failed, cleaning up"; cmd_stop "$dir" >/dev/null 2>&1 || true' EXIT
  mkdir -p "$dir"/{state,spool,log,fakedev,munge}
  chmod 700 "$dir/munge"
  local i; for i in 0 1 2 3 4 5 6 7; do
    [[ -c $dir/fakedev/nvidia$i ]] || mknod "$dir/fakedev/nvidia$i" c 1 3 \
      || die "mknod $dir/fakedev/nvidia$i failed (no CAP_MKNOD?)"
  done
  if [[ ! -s $dir/munge/munge.key ]]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none && chmod 400 "$dir/munge/munge.key"
  fi
  write_conf "$dir"

  # --force: munged refuses a socket whose parent directories are not world-executable (tmp dirs).
  "$SBIN/munged" --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" \
    || die "munged failed to start; see $dir/log/munged.log"
  wait_for 10 munged alive "$dir/munge/munged.pid" munged || die "munged did not start; see $dir/log/munged.log"

  SLURM_CONF=$dir/slurm.conf "$SBIN/slurmctld" -f "$dir/slurm.conf" || die "slurmctld failed; see $dir/log/slurmctld.log"
  wait_for 15 slurmctld alive "$dir/slurmctld.pid" slurmctld || die "slurmctld did not start; see $dir/log/slurmctld.log"
  SLURM_CONF=$dir/slurm.conf "$SBIN/slurmd" -f "$dir/slurm.conf" -N localhost || die "slurmd failed; see $dir/log/slurmd.log"
  wait_for 15 slurmd alive "$dir/slurmd.pid" slurmd || die "slurmd did not start; see $dir/log/slurmd.log"

  mkdir -p /etc/slurm && ln -sfn "$dir/slurm.conf" "$ETC_CONF"
  node_idle() { [[ $(SLURM_CONF=$dir/slurm.conf sinfo -h -N -o %T 2>/dev/null) == idle ]]; }
  wait_for 60 "node idle" node_idle || {
    SLURM_CONF=$dir/slurm.conf sinfo -N -l >&2 || true; tail -n 5 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2
    die "node did not become idle within 60 s (state above; logs in $dir/log)"
  }
  trap - EXIT
  log "cluster up: partition 'main', 1 node, gpu:8 ($dir)"
  echo "export SLURM_CONF=$dir/slurm.conf"
}

# kill_pidfile PIDFILE NAME: TERM, wait up to 10 s, then KILL.
kill_pidfile() {
  alive "$1" "$2" || return 0
  local pid; pid=$(<"$1")
  kill -TERM "$pid" 2>/dev/null || true
  wait_for 10 "$2 exit" bash -c "! kill -0 $pid 2>/dev/null || [[ \$(awk '{print \$3}' /proc/$pid/stat) == Z ]]" || {
    log "$2 (pid $pid) ignored TERM, sending KILL"; kill -KILL "$pid" 2>/dev/null || true; sleep 0.5
  }
  ! alive "$1" "$2" || die "could not stop $2 (pid $pid)"
}

cmd_stop() {
  local dir=$1
  [[ -d $dir ]] || { log "nothing to stop: $dir does not exist"; return 0; }
  dir=$(cd "$dir" && pwd -P)
  if alive "$dir/slurmctld.pid" slurmctld; then  # cancel jobs so that no slurmstepd outlives slurmd
    local jobs; jobs=$(SLURM_CONF=$dir/slurm.conf squeue -h -o %i 2>/dev/null || true)
    if [[ -n $jobs ]]; then
      SLURM_CONF=$dir/slurm.conf scancel $jobs 2>/dev/null || true
      wait_for 15 "jobs cancelled" bash -c "[[ -z \$(SLURM_CONF='$dir/slurm.conf' squeue -h -t R,CG -o %i) ]]" \
        || log "warning: jobs still running after scancel: $jobs"
    fi
  fi
  kill_pidfile "$dir/slurmd.pid" slurmd
  kill_pidfile "$dir/slurmctld.pid" slurmctld
  kill_pidfile "$dir/munge/munged.pid" munged
  if [[ -L $ETC_CONF && $(readlink "$ETC_CONF") == "$dir/slurm.conf" ]]; then rm -f "$ETC_CONF"; fi
  log "stopped ($dir)"
}

case ${1:-} in
  install) cmd_install ;;
  start | stop) [[ -n ${2:-} ]] || die "usage: $0 $1 DIR"; "cmd_$1" "$2" ;;
  *) die "usage: $0 install | start DIR | stop DIR" ;;
esac
