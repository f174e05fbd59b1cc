#!/usr/bin/env bash
# System libraries the optional transports need and pip cannot provide:
#   libibverbs1  loaded by Mooncake's transfer engine even when it only speaks TCP.
# Installs them with apt when missing and we may (root); otherwise says what to install.
set -euo pipefail
missing=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || missing+=(libibverbs1)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "kvferry: Mooncake needs system packages: ${missing[*]} (e.g. sudo apt-get install -y ${missing[*]})" >&2
fi
