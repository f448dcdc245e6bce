#!/usr/bin/env bash
# prometheus + promtool for the observability tests (tests/gateway/test_observability.py starts its
# own Prometheus on a free loopback port and checks deploy/prometheus/ with promtool): installed
# from the Debian package `prometheus` (it ships /usr/bin/prometheus and /usr/bin/promtool) when
# missing, with `apt-get update` first only when the package lists do not know it. Prints the time.
# Cannot install: CI (CI=true) fails here; elsewhere the tests that need it skip.
set -uo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
start=$(date +%s.%N)
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
ok=0
if command -v apt-get >/dev/null 2>&1; then
  if ! apt-cache show prometheus >/dev/null 2>&1; then
    echo "prometheus: apt-get update (the package lists do not know it)"
    $SUDO apt-get update -q >/dev/null 2>&1 || true
  fi
  # the package's postinst starts a system service where systemd runs; the tests use their own
  if $SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; then
    ok=1
  else  # stale lists (a mirror moved on): update once and retry
    $SUDO apt-get update -q >/dev/null 2>&1 && \
      $SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 && ok=1
  fi
fi
took=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $start }")
if [ "$ok" = 1 ] && command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1
then
  echo "prometheus installed ($(prometheus --version 2>&1 | head -1 | cut -d' ' -f3)) in ${took} s"
  exit 0
fi
echo "prometheus could not be installed (${took} s): apt-get install -y prometheus" >&2
case "${CI:-}" in
  1|true|TRUE|yes) exit 1 ;;
  *) echo "  the observability tests will skip" >&2; exit 0 ;;
esac
