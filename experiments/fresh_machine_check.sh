#!/usr/bin/env bash
# Fresh-machine check: README's setup command in a freshly debootstrapped Debian 12, used
# with chroot, then `.venv/bin/testbed doctor`.  Prints how long each step took.
#
#   bash experiments/fresh_machine_check.sh [WORKDIR]      (as root; needs ~2 GB and the Debian mirror)
#
# The chroot shares this machine's kernel (so namespaces, tc and TUN are this kernel's) and,
# read-only, this machine's pip configuration and wheel cache where it has them, so that
# `pip install torch==2.13.0` takes the local CPU build as it does here.  Everything is
# removed at the end unless KEEP=1.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-/var/tmp/gtb-fresh}"
root="$work/rootfs"

if [ "$(id -u)" -ne 0 ]; then echo "error: run as root" >&2; exit 1; fi
command -v debootstrap >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }

mounts=()
cleanup() {
  for ((i=${#mounts[@]}-1; i>=0; i--)); do umount -l "${mounts[$i]}" 2>/dev/null || true; done
  if [ "${KEEP:-0}" != 1 ]; then rm -rf "$work"; fi
}
trap cleanup EXIT
bind() { [ -f "$1" ] || mkdir -p "$root$2"; mount --bind "$1" "$root$2"; mounts+=("$root$2"); if [ "${3:-}" = ro ]; then mount -o remount,bind,ro "$root$2"; fi; }

t0=$(date +%s)
if [ ! -x "$root/bin/bash" ]; then
  mkdir -p "$work"
  debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1
fi
t1=$(date +%s)
echo "debootstrap: $((t1 - t0)) s"

cp /etc/resolv.conf "$root/etc/resolv.conf"
# "/" must be a mount point inside the chroot (ip netns exec remounts it as a slave)
mount --bind "$root" "$root"; mounts+=("$root")
bind /proc /proc; bind /dev /dev; bind /dev/pts /dev/pts; bind /run /run
mount --rbind /sys "$root/sys"; mount --make-rslave "$root/sys"; mounts+=("$root/sys")
for d in /opt/wheels /opt/pypi /opt/pypi-more /etc/xdg/pip; do [ -e "$d" ] && bind "$d" "$d" ro; done
# a registry reached through a TLS-inspecting proxy needs this machine's CA bundle
touch "$root/etc/gtb-host-ca.crt"; bind /etc/ssl/certs/ca-certificates.crt /etc/gtb-host-ca.crt ro
mkdir -p "$root/src"
git -C "$repo" archive --format=tar HEAD | tar -x -C "$root/src"

t2=$(date +%s)
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  PIP_FIND_LINKS="${PIP_FIND_LINKS:-}" PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL:-}" PIP_CERT=/etc/gtb-host-ca.crt \
  bash -c 'cd /src && bash setup.sh' >"$work/setup.log" 2>&1 || { tail -20 "$work/setup.log"; echo "FAILED: setup"; exit 1; }
t3=$(date +%s)
echo "README setup (bash setup.sh) on the fresh system: $((t3 - t2)) s"
chroot "$root" /src/.venv/bin/testbed doctor
echo "fresh-machine check passed: debootstrap $((t1 - t0)) s, setup $((t3 - t2)) s"
