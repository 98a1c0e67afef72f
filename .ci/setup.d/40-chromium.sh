#!/usr/bin/env bash
# Installs Debian's chromium for the report.html headless-browser test
# (tests/it/notify.rs). Idempotent: does nothing when chromium is present.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
fi
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core
command -v chromium
