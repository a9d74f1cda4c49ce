# Sourced by the background-run scripts (gpu_bg.sh, bench/gateway/gpu_gateway.sh), which define
# $dir (the run's folder, holding its pid), $run and copy_back (what comes back to $OUT).
#
# follow: wait up to FOLLOW_S (default 560 s) for the run, copying back every minute too: if the
# device's time ends during this call, what the run wrote by then still comes back with it.
follow() {
  local limit=${FOLLOW_S:-560} pid
  pid=$(cat "$dir/pid" 2>/dev/null) || { echo "no run $run"; return 2; }
  while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$limit" ]; do
    sleep 5
    [ $((SECONDS % 60)) -lt 5 ] && copy_back >/dev/null
  done
  if kill -0 "$pid" 2>/dev/null; then echo "RUNNING after ${SECONDS}s"; else echo "FINISHED"; fi
  copy_back
}
