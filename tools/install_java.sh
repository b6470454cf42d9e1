#!/usr/bin/env bash
# Install Java 17+ for TorchServe 0.12's frontend, which the tests compare serve-repo's TorchServe API with
# (tests/test_torchserve_api.py), from the system's package registry. Nothing to do where java runs already.
# Usage: tools/install_java.sh
set -euo pipefail
if java -version >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "install Java 17 or newer (e.g. the package openjdk-17-jre-headless): TorchServe's frontend needs it" >&2
  exit 1
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
package=openjdk-17-jre-headless
$sudo apt-get install -y -q --no-install-recommends $package >/dev/null 2>&1 ||
  { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends $package >/dev/null; }
java -version 2>&1 | head -1
