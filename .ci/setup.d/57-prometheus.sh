#!/usr/bin/env bash
# Set-up for tests/it/record_live_ops.rs: the Prometheus project's own
# servers and tools, from the distribution's packages:
# - prometheus (prometheus, promtool): `promtool check rules` and
#   `promtool test rules` over deploy/prometheus/, and a Prometheus server
#   the test starts on loopback to scrape a live `kvtrail record --metrics`;
# - prometheus-alertmanager: an Alertmanager the test starts on loopback
#   to receive `kvtrail record --alertmanager` alerts.
# The packages' services are not used (the tests start their own servers
# on random ports with temporary storage, and stop them after).
# Idempotent: nothing is done when the binaries are present.
set -euo pipefail

need=()
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 || need+=(prometheus-alertmanager)
if [ "${#need[@]}" -eq 0 ]; then
  echo "57-prometheus: $(prometheus --version 2>&1 | head -n1); $(prometheus-alertmanager --version 2>&1 | head -n1)"
  exit 0
fi
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
else
  echo "57-prometheus: ${need[*]} missing and no apt-get: install Prometheus and Alertmanager" >&2
  exit 1
fi
command -v promtool >/dev/null
command -v prometheus-alertmanager >/dev/null
