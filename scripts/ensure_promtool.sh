#!/usr/bin/env bash
# Installs Debian's prometheus package (for promtool) when promtool is missing and this machine can
# (root + apt): the alert-rule unit tests and the rule/config checks run it. They skip with a clear
# message when no promtool can be had.
set -u
if command -v promtool >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_promtool: promtool not installed and cannot apt-get here; Prometheus rule tests will skip" >&2
  exit 0
fi
echo "ensure_promtool: installing Debian's prometheus package for promtool" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1
# --no-install-recommends: promtool only, not the exporters the package recommends.
apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
  || echo "ensure_promtool: apt-get install prometheus failed; Prometheus rule tests will skip" >&2
