#!/usr/bin/env bash
# Text captures of `btbctl tui --sim` at a given terminal size, through tmux (capture-pane).
# Usage: scripts/tui-capture.sh BTBCTL COLSxROWS OUT_FILE [SECONDS [KEY...]]
# BTBCTL is the btbctl executable to run; SECONDS the wall time to let pass before the capture (default 6); each KEY
# (tmux send-keys names: e, q, Escape, ...) is sent one second apart before the capture.
set -euo pipefail
btbctl=$1 size=$2 out=$3 wait_s=${4:-6}
shift 4 || shift $#
cols=${size%x*} rows=${size#*x}
session="btbctl-capture-$$"
tmux new-session -d -s "$session" -x "$cols" -y "$rows" \
    "$btbctl tui --sim --speed 4 --seed 7 --poll-hz 4"
trap 'tmux kill-session -t "$session" 2>/dev/null || true' EXIT
sleep "$wait_s"
for key in "$@"; do
    tmux send-keys -t "$session" "$key"
    sleep 1
done
tmux capture-pane -p -t "$session" > "$out"
tmux send-keys -t "$session" q
