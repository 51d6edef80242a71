#!/usr/bin/env bash
# Installs Debian's wrk for the gateway benchmark when it is missing and this machine can
# (root + apt). Without it, benchmarks/gateway_overhead.py falls back to a Python load generator
# and says so in its results.
set -u
if command -v wrk >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_wrk: wrk not installed and cannot apt-get here; the benchmark uses its Python load generator" >&2
  exit 0
fi
echo "ensure_wrk: installing Debian's wrk for the gateway benchmark" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1
apt-get install -y -qq wrk >/dev/null 2>&1 || echo "ensure_wrk: apt-get install wrk failed; the benchmark uses its Python load generator" >&2
