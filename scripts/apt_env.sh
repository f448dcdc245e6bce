#!/usr/bin/env bash
# A Debian package a test suite needs as a real server, installed when missing:
#   scripts/apt_env.sh PACKAGE "what needs it" COMMAND [COMMAND...]
# Nothing to do when every COMMAND is on the PATH. Otherwise `apt-get install` (with `apt-get
# update` first only when the package lists do not know the package: a fresh machine; once more
# if the lists are stale), and the time it took is printed. Cannot install: in CI (CI=true) that
# fails the run; elsewhere the tests that need it skip.
set -uo pipefail
pkg=$1
who=$2
shift 2
have() { for c in "$@"; do command -v "$c" >/dev/null 2>&1 || return 1; done; }
if have "$@"; then
  exit 0
fi
start=$(date +%s.%N)
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
ok=0
if command -v apt-get >/dev/null 2>&1; then
  if ! apt-cache show "$pkg" >/dev/null 2>&1; then
    echo "$pkg: apt-get update (the package lists do not know it)"
    $SUDO apt-get update -q >/dev/null 2>&1 || true
  fi
  # a package's postinst may start a system service where systemd runs; the tests use their own
  if $SUDO apt-get install -y -q --no-install-recommends "$pkg" >/dev/null 2>&1; then
    ok=1
  else  # stale lists (a mirror moved on): update once and retry
    $SUDO apt-get update -q >/dev/null 2>&1 && \
      $SUDO apt-get install -y -q --no-install-recommends "$pkg" >/dev/null 2>&1 && ok=1
  fi
fi
took=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $start }")
if [ "$ok" = 1 ] && have "$@"; then
  echo "$pkg installed ($(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null)) in ${took} s"
  exit 0
fi
echo "$pkg could not be installed (${took} s): apt-get install -y $pkg" >&2
case "${CI:-}" in
  1|true|TRUE|yes) exit 1 ;;
  *) echo "  $who will skip" >&2; exit 0 ;;
esac
