#!/usr/bin/env bash
# Install the reverse proxy serve-repo puts in front of Triton: HAProxy (2.6 or newer, built with Lua, as
# Debian's and Ubuntu's packages are), from the system's package registry. Nothing to do where it is present.
# Usage: tools/install_proxy.sh
set -euo pipefail
if command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "install HAProxy >= 2.6 with Lua (your system's package 'haproxy'); serve-repo --proxy needs it" >&2
  exit 1
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -q --no-install-recommends haproxy >/dev/null 2>&1 ||
  { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends haproxy >/dev/null; }
# Debian starts the packaged service where an init system runs; serve-repo starts its own.
$sudo service haproxy stop >/dev/null 2>&1 || true
# sed reads all of it: head could exit first and haproxy die of SIGPIPE (with pipefail: make's exit 141)
/usr/sbin/haproxy -v | sed -n 1p
