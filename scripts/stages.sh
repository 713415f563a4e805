# Shared by scripts/repro.sh and scripts/real_model.sh (sourced): pipeline stages that record their wall-clock.
#   latest DIR              the newest DIR/global_step_N checkpoint
#   stage NAME FILE CMD...  runs CMD and appends "NAME <wall-clock seconds>" to FILE
latest() { ls -d "$1"/global_step_* | sort -t_ -k3 -n | tail -1; }
clock() { date +%s.%N; }
stage() {
  local name=$1 file=$2 t0
  shift 2
  echo "== $name: $*"
  t0=$(clock)
  "$@"
  echo "$name $(awk -v a="$t0" -v b="$(clock)" 'BEGIN { printf "%.1f", b - a }')" >> "$file"
}
