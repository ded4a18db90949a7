#!/usr/bin/env bash
# Run a command that pauses whenever another process is paused: `pause_with.sh LEADER_PIDFILE -- COMMAND...`.
#
# Whoever times something on this machine pauses the background data generation (SIGSTOP to the pid in its
# pidfile) and resumes it after (SIGCONT). A training run started beside it goes through this wrapper, so the
# same pause stops it too: every half second the wrapper reads the leader's state (/proc/PID/stat) and sends
# the command's process group SIGSTOP while the leader is stopped, SIGCONT once it runs again. When the
# leader has exited, the command runs on unpaused. The wrapper's exit status is the command's.
# Usage: docs/results/heads-v3-cpu/pause_with.sh LEADER_PIDFILE -- COMMAND...
set -uo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the header comment above is the help
  sed -n '2,/^set -/{/^set -/d;s/^# \{0,1\}//;p}' "$0"; exit 0
fi
pidfile=$1
shift
[ "${1:-}" = "--" ] && shift
setsid "$@" &
child=$!
paused=0
while kill -0 "$child" 2>/dev/null; do
    leader=$(cat "$pidfile" 2>/dev/null || true)
    state=$( { [ -n "$leader" ] && awk '{print $3}' "/proc/$leader/stat"; } 2>/dev/null || true)
    if [ "$state" = "T" ] && [ $paused = 0 ]; then
        kill -STOP -- "-$child" 2>/dev/null && paused=1
    elif [ "$state" != "T" ] && [ $paused = 1 ]; then
        kill -CONT -- "-$child" 2>/dev/null
        paused=0
    fi
    sleep 0.5
done
wait "$child"
