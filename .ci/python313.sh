#!/usr/bin/env bash
# Python 3.13 for CI's second pass of the fast suite (`make test-py313`), on a machine that has only 3.11: CPython
# built from Debian's own source package (trixie's python3.13) under a prefix, the way the team's
# ../shared/tools/python313.sh builds it, with the headers it needs installed first (a CI machine may lack them).
# On Debian 13 it installs the system package instead. Prints the interpreter's path. About 3 minutes on 2 cores;
# a second call returns at once.
set -euo pipefail
prefix=${1:-/opt/python3.13}
if [ -x "$prefix/bin/python3.13" ]; then echo "$prefix/bin/python3.13"; exit 0; fi
export DEBIAN_FRONTEND=noninteractive
if grep -q '^13' /etc/debian_version 2>/dev/null; then
  apt-get install -y -qq python3.13 python3.13-venv python3.13-dev >/dev/null
  command -v python3.13; exit 0
fi
# What `import ssl, sqlite3, lzma, bz2, zlib, ctypes` needs at build time; already there, this installs nothing.
headers=(libssl-dev libsqlite3-dev liblzma-dev libbz2-dev zlib1g-dev libffi-dev libreadline-dev uuid-dev)
missing=()
for p in "${headers[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
cat > /etc/apt/sources.list.d/python313-src.sources <<SRC
Types: deb-src
URIs: $uri
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
apt-get update -qq >&2
if [ ${#missing[@]} -gt 0 ]; then apt-get install -y -qq "${missing[@]}" >/dev/null; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT  # the source tree and build, about 0.5 GB: CI's later stages need the disk
cd "$work"
apt-get source --download-only python3.13 >/dev/null 2>&1
tar xf python3.13_*.orig.tar.xz
cd Python-3.13.*
./configure --prefix="$prefix" --with-ensurepip=install >"$work/configure.log" 2>&1
make -j"$(nproc)" >"$work/make.log" 2>&1
make altinstall >"$work/install.log" 2>&1
"$prefix/bin/python3.13" -c 'import ssl, sqlite3, lzma, bz2, zlib, ctypes' >&2
echo "$prefix/bin/python3.13"
