#!/usr/bin/env bash
# Installs Debian's chromium for the browser tests when it is missing and this machine can
# (root + apt). The tests skip with a clear message when no chromium can be had.
set -u
if command -v chromium >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_chromium: chromium not installed and cannot apt-get here; browser tests will skip" >&2
  exit 0
fi
echo "ensure_chromium: installing Debian's chromium for the browser tests" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1
apt-get install -y -qq chromium >/dev/null 2>&1 || echo "ensure_chromium: apt-get install chromium failed; browser tests will skip" >&2
