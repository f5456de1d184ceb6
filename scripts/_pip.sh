# pip for the setup scripts (sourced): `pip ARGS...` runs "$VENV/bin/python -m pip" with its output shown
# but for one harmless warning; a failed pip (no network, no such version, a full disk) ends the setup
# there, naming what failed and the script to run again (before, the peers' setups went on to the next
# install and ended in an import traceback). The sourcing script sets VENV.
pip() {
  local out rc=0
  out=$("$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1) || rc=$?
  printf '%s\n' "$out" | grep -v -e "^WARNING: Location" -e "^$" >&2 || true
  if [ "$rc" -ne 0 ]; then
    echo "setup failed: pip $* exited with status $rc (its output above says why); fix that and run $0 again" >&2
    exit "$rc"
  fi
}
