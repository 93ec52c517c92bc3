# Sourced by the one-device-call study scripts (bench/run_staged_rows.sh, studies/run_agent_study.sh), whose
# steps are tests/gpu/run_entries.sh 'cmd' and 'entry' steps run in a pack built elsewhere.
#   study_begin PACK OUT MACHINE   sets pack, out, machine, root (the source tree), logs (a
#                                  scratch folder) and exports O (= logs), C (COMMIT), M, D
#                                  for the steps' commands
#   result REGEX                   the tail of a step's command that copies the lines matching
#                                  REGEX into the summary (as RESULT lines)
#   study_end RC FILE...           OUT gets summary.txt, each FILE the steps wrote into $O (if
#                                  made) and logs.tgz of everything; exits RC
study_begin() {
  pack=$(cd "${1:?pack}" && pwd); out=${2:?out}; machine=${3:?machine}
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  mkdir -p "$out"; out=$(cd "$out" && pwd)
  logs=$(mktemp -d)
  export O=$logs C=${COMMIT:-unknown} M=$machine D=$(date -u +%F)
}
result() { echo "2>&1 | awk '{print} /$1/{print \"RESULT \" \$0}'"; }
study_end() {
  local rc=$1; shift
  cp "$logs/steps/summary.txt" "$out/"
  local f
  for f in "$@"; do [ -f "$logs/$f" ] && cp "$logs/$f" "$out/"; done
  tar czf "$out/logs.tgz" -C "$logs" .
  rm -rf "$logs"
  exit "$rc"
}
