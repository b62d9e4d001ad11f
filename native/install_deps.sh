#!/usr/bin/env bash
# Installs what the native build and the fio peer need, if missing:
# libaio-dev, liburing-dev (headers; without them the extension builds
# without that backend) and fio. Uses apt-get only when root; otherwise it
# prints the command to run.
set -euo pipefail

missing=()
[ -f /usr/include/libaio.h ] || missing+=(libaio-dev)
[ -f /usr/include/liburing.h ] || missing+=(liburing-dev)
command -v fio >/dev/null 2>&1 || missing+=(fio)

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: libaio-dev, liburing-dev and fio are present"
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_deps: missing ${missing[*]}; as root run: apt-get install -y ${missing[*]}" >&2
  echo "install_deps: continuing; the build will skip the backends whose headers are missing" >&2
  exit 0
fi
echo "install_deps: installing ${missing[*]} with apt-get"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null
echo "install_deps: done"
