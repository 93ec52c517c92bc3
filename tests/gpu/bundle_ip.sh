#!/usr/bin/env bash
# Copies this machine's iproute2 `ip` and the libraries it needs into a folder (default
# build-ip/, ignored by git), for GPU machines without `ip`: carry that folder to the device
# machine, and tests/gpu/run_entries.sh tier finds it (launch/meshmem-hosts's --ip / --ip-libs)
# for the entries on hosts made of namespaces.
set -euo pipefail
dest=${1:-build-ip}
ip=$(readlink -f "$(command -v ip)")
mkdir -p "$dest/lib"
cp "$ip" "$dest/ip"
ldd "$ip" | awk '/=> \// {print $3}' | grep -v -E '/(libc|libm|ld-linux[^/]*)\.so' | xargs -r cp -t "$dest/lib"
du -sh "$dest"
