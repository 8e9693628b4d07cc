# Sourced by benchmarks/gpu_check.sh, gpu_launch.sh and gpu_session.sh: the mode of a device
# script, and one time-limited stage.
#   device_mode SCRIPT VAR ARGS...
# sets MODE (gpu | cpu) from the variable named VAR (default gpu) and the arguments --cpu / --gpu;
# anything else ends SCRIPT with a message naming the value and what is allowed.
#   stage NAME SECONDS CMD...
# runs CMD with a time limit (0 = skipped), lowered to what is left before STAGE_DEADLINE (epoch
# seconds, optional; a stage left with 5 s or less is skipped), its output in
# $STAGE_DIR/logs/NAME.log, and records name, exit status (-1 skipped, 124 out of time) and
# seconds in $STAGE_DIR/stages.tsv. STAGE_TAG prefixes its console lines.
stage() {
  local name=$1 limit=$2 rc=0 t0 ms left
  shift 2
  if [ -n "${STAGE_DEADLINE:-}" ]; then
    left=$((STAGE_DEADLINE - $(date +%s) - 10))
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -le 5 ] && limit=0
  fi
  if [ "$limit" -le 0 ]; then
    printf '%s\t-1\t0\n' "$name" >>"$STAGE_DIR/stages.tsv"
    echo "[$STAGE_TAG] $name: skipped"
    return 0
  fi
  echo "[$STAGE_TAG] $name (at most ${limit} s)"
  t0=$(date +%s%N)
  timeout --kill-after=10 "$limit" "$@" >"$STAGE_DIR/logs/$name.log" 2>&1 || rc=$?
  ms=$((($(date +%s%N) - t0) / 1000000))
  printf '%s\t%s\t%d.%03d\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) >>"$STAGE_DIR/stages.tsv"
  echo "[$STAGE_TAG] $name: exit $rc"
}

device_mode() {
  local script=$1 var=$2 arg
  shift 2
  MODE=${!var:-gpu}
  for arg in "$@"; do
    case $arg in
      --cpu) MODE=cpu ;;
      --gpu) MODE=gpu ;;
      *) echo "$script: unknown argument '$arg'; allowed: --cpu, --gpu" >&2; exit 2 ;;
    esac
  done
  case $MODE in gpu | cpu) ;; *) echo "$script: $var has value '$MODE'; allowed: gpu, cpu" >&2; exit 2 ;; esac
}
