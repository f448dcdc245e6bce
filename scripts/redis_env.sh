#!/usr/bin/env bash
# redis-server for the shared-state tests (tests/gateway/test_shared_state.py start their own on a
# free loopback port): installed from the Debian packages when missing, with `apt-get update` first
# only when the package lists do not know it (a fresh machine). Prints the time it took.
# Cannot install: CI (CI=true) fails here; elsewhere the tests that need it skip.
set -uo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
start=$(date +%s.%N)
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
ok=0
if command -v apt-get >/dev/null 2>&1; then
  if ! apt-cache show redis-server >/dev/null 2>&1; then
    echo "redis-server: apt-get update (the package lists do not know it)"
    $SUDO apt-get update -q >/dev/null 2>&1 || true
  fi
  if $SUDO apt-get install -y -q --no-install-recommends redis-server >/dev/null 2>&1; then
    ok=1
  else  # stale lists (a mirror moved on): update once and retry
    $SUDO apt-get update -q >/dev/null 2>&1 && \
      $SUDO apt-get install -y -q --no-install-recommends redis-server >/dev/null 2>&1 && ok=1
  fi
fi
took=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $start }")
if [ "$ok" = 1 ] && command -v redis-server >/dev/null 2>&1; then
  echo "redis-server installed ($(redis-server --version | cut -d' ' -f3)) in ${took} s"
  exit 0
fi
echo "redis-server could not be installed (${took} s): apt-get install -y redis-server" >&2
case "${CI:-}" in
  1|true|TRUE|yes) exit 1 ;;
  *) echo "  the shared-state tests will skip" >&2; exit 0 ;;
esac
