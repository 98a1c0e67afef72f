#!/usr/bin/env bash
# Set-up for tests/it/seals.rs: stock OpenSSH's ssh-keygen, which the tests
# use to make keys and to verify every seal as a third party would
# (`ssh-keygen -Y verify`). Present on most machines; installed from the
# distribution's package when missing. Idempotent.
set -euo pipefail

if command -v ssh-keygen >/dev/null 2>&1; then
  echo "20-openssh: $(ssh -V 2>&1 || echo ssh-keygen present)"
  exit 0
fi
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openssh-client
else
  echo "20-openssh: ssh-keygen missing and no apt-get: install OpenSSH's client" >&2
  exit 1
fi
command -v ssh-keygen >/dev/null
