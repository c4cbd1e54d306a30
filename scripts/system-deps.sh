#!/usr/bin/env bash
# Install the system tools swiftslurm's preflight uses (nc, iperf3, fio) when missing, and the ones the tests
# use (script for a pseudo-terminal, unshare for a mount namespace; both essential on Debian, so rarely missing).
# Debian/Ubuntu, as root. Prints what it does; does nothing when everything is there.
set -euo pipefail
need=()
command -v nc >/dev/null 2>&1 || need+=(netcat-openbsd)
command -v iperf3 >/dev/null 2>&1 || need+=(iperf3)
command -v fio >/dev/null 2>&1 || need+=(fio)
command -v script >/dev/null 2>&1 || need+=(bsdutils)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "swiftslurm: missing tools: ${need[*]} (install them with your package manager; preflight checks that need them will fail)" >&2
  exit 0
fi
echo "installing ${need[*]} ..."
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
