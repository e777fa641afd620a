"""A throwaway VM with a stock Debian kernel (which has netem): the netem backend, run for real.

How it fits: a machine whose kernel has no netem qdisc (or a user without root on one that
has) cannot run the netem delay backend.  This module builds, once, a Debian 12 image from
the Debian registry and boots it under QEMU to run commands or the netem test variants in:

* **Build** (``build_image``, cached under ``/var/cache/geo-testbed/vm/image-KEY/``, which
  outlives clones and ``git clean``, or ``GTB_VM_CACHE``; 3-4 min here, all but the last
  half-minute at native speed; the whole build gives up after ``GTB_VM_BUILD_TIMEOUT_S``, 20
  min, with a one-line ``VMError``): ``debootstrap`` makes a Debian 12 root filesystem with
  Debian's kernel package (``linux-image-amd64``: 6.1, ``sch_netem`` a module), Python and
  iproute2; in a chroot apt installs the playbook's base packages (its own list, roles/base)
  and setup.sh's bootstrap step makes the venv (the project and its pinned dependencies, less
  ``GUEST_PIP_EXCLUDE``: no PyTorch); a small initramfs (virtio, ext4) is made; the project is
  copied to ``/opt/geo-testbed``; ``mke2fs -d`` makes the ext4 disk.  Then the image boots
  once and its ``testbed doctor`` must choose netem, or the image is not kept.  KEY hashes the
  playbook, ``pyproject.toml`` (less its pytest table), ``constraints.txt`` and this recipe,
  so a change to any of them rebuilds; the previous image is kept (another checkout may use
  it), older ones are removed.  Downloaded ``.deb`` files stay in the cache's ``debs/``.
* **The playbook on another machine** (``check_playbook``, ``testbed vm check-playbook``, a
  slow test): a throwaway copy of the image provisions itself with ``playbooks/site.yml``
  (``ansible-playbook``, connection local, user-mode network), as README's setup and the
  Vagrantfile do, on a machine and a kernel that are not this one.  Until 2026-12-06 every
  build did this, 200-310 s of a 345-470 s build under TCG, which kept a fresh machine's
  quick suite over 15 minutes; the netem tests do not need it (the base packages are
  installed natively, and the guest's kernel allows cubic by default).
* **Run** (``run_job``): QEMU boots the kernel and initramfs with the disk as a throwaway
  snapshot (``snapshot=on``: nothing the guest writes survives), the project shared
  read-only over 9p at ``/mnt/gtb`` and a per-run job folder (9p, writable) at
  ``/mnt/gtbjob``.  The guest's PID 1 (``GUEST_INIT``, no systemd: a boot under TCG takes
  10-15 s) runs the job folder's ``init.sh`` (``RUN_INIT``): it mounts what is needed, runs
  ``job.sh`` with its output on the serial console, writes the exit status and powers off.
  QEMU gets a parent-death signal, so it dies with the process that started it even on
  SIGKILL; the job folder is removed afterwards (stale ones of dead runs at the next run).
  No network by default, so no tap interface or bridge exists on the host; a build's
  user-mode network is QEMU's own (no host interface either).
* **Acceleration**: KVM where a short probe boot shows that it works, TCG (software
  emulation) otherwise; the probe result is cached per host kernel and QEMU version
  (``accel.json``).  ``GTB_VM_ACCEL=kvm|tcg`` forces one.  Jobs see ``GTB_VM_ACCEL`` in
  their environment so tests can state their emulation tolerances.

``testbed vm build|run|shell|status|remove`` (``vmcli.py``) drive it by hand;
``tests/netem_vm.py`` runs the netem test variants in it when the host has no netem.
Needs root (debootstrap, chroot), ``qemu-system-x86_64``, ``debootstrap`` and ``mke2fs``:
``missing()`` names what is absent.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GTB_VM_CACHE", "/var/cache/geo-testbed/vm"))
SUITE = "bookworm"
MIRROR = os.environ.get("GTB_VM_MIRROR", "http://deb.debian.org/debian")
GUEST_PROJECT = "/opt/geo-testbed"  # the copy the image was built from (its venv is here)
GUEST_PYTHON = f"{GUEST_PROJECT}/.venv/bin/python"
GUEST_SRC = "/mnt/gtb"  # the live project, shared read-only
GUEST_JOB = "/mnt/gtbjob"  # the run's job folder, shared read-write
DISK_SIZE = "6G"  # sparse: about 1.6 GB is used
_RECIPE = 5  # bump when the build steps below change in a way the key cannot see

# What the image needs to boot, and the three packages setup.sh installs before anything else
# (its bootstrap step); the rest is the playbook's (installed in a chroot: _preinstall).
BOOT_PACKAGES = ["linux-image-amd64", "kmod", "initramfs-tools", "python3", "python3-venv",
                 "python3-apt", "ca-certificates", "iproute2", "procps"]
# The guest's extras (pyproject.toml), less (the python role's python_exclude) PyTorch, ~1 GB,
# which the netem tests do not need, and ansible-lint, which checks the playbook on the host.
GUEST_EXTRAS = "[all,test]"
GUEST_PIP_EXCLUDE = ["torch", "ansible-lint"]
_INITRAMFS_MODULES = ["virtio_pci", "virtio_blk", "ext4"]
_GUEST_MODULES = ["virtio_net", "virtio_rng", "tun"]  # no udev: nothing loads them on its own
_COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", ".cache", "results", "__pycache__", ".vagrant",
                                      "*.egg-info", "build", ".pytest_cache", "*.pyc")
_DEFAULT_TIMEOUT_S = 1800.0
# A boot under KVM echoes in 2-5 s; one that has not in 15 s is nested KVM that hangs (this
# machine: /dev/kvm present, the guest never starts), and TCG is chosen.
_KVM_PROBE_S = 15.0
# The whole build (debootstrap, apt and pip in the chroot, the guest's doctor) gives up after
# this long: 2-3 min here, so a stuck mirror or a hung guest fails CI in minutes, in one line.
BUILD_TIMEOUT_S = float(os.environ.get("GTB_VM_BUILD_TIMEOUT_S", 1200))
_build_deadline: float | None = None  # monotonic; set while build_image runs
_build_cancel: "threading.Event | None" = None  # set while build_image runs, if it was given one

# PID 1 of the guest, baked into the image: it mounts the run's job folder and hands over to
# the init.sh the host wrote there (RUN_INIT), so that what a boot does never needs a rebuild.
# initramfs-tools has mounted /dev, /proc, /sys and /run already.
GUEST_INIT = r"""#!/bin/sh
# PID 1 of the testbed's netem VM (testbed/tools/vm.py): hand over to the run's init.sh.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sysfs /sys
mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
modprobe -q 9pnet_virtio; modprobe -q 9p
mkdir -p __JOB__
if mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 gtbjob __JOB__ && [ -f __JOB__/init.sh ]; then
  exec /bin/sh __JOB__/init.sh
fi
echo "gtb-vm: no job folder (9p tag gtbjob) with an init.sh"
echo o > /proc/sysrq-trigger
sleep 30
""".replace("__JOB__", GUEST_JOB)

# What every boot does (the job folder's init.sh): mount the rest, load modules, configure
# QEMU's user-mode network if there is one, run job.sh, record its status, power off.
RUN_INIT = r"""# init.sh of the testbed's netem VM (testbed/tools/vm.py), run by the image's /usr/local/sbin/gtb-init
mountpoint -q /run || mount -t tmpfs tmpfs /run
mkdir -p /dev/pts /dev/shm /run/lock
mount -t devpts -o gid=5,mode=620 devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t cgroup2 cgroup2 /sys/fs/cgroup
hostname gtb-vm
ip link set lo up
for m in __GUEST_MODULES__; do modprobe -q $m; done
sysctl -q --system >/dev/null 2>&1
echo "gtb-vm: up $(cut -d' ' -f1 /proc/uptime) s, kernel $(uname -r)"
mkdir -p __SRC__
if grep -qs gtbsrc /sys/bus/virtio/drivers/9pnet_virtio/*/mount_tag; then
  mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=loose,ro gtbsrc __SRC__
fi
for dev in /sys/class/net/eth*; do
  [ -e "$dev" ] || continue
  # QEMU's user-mode network: fixed addresses, DNS forwarded by QEMU
  ip link set "${dev##*/}" up
  ip addr add 10.0.2.15/24 dev "${dev##*/}"
  ip route add default via 10.0.2.2
  echo "nameserver 10.0.2.3" > /etc/resolv.conf
done
cd /root
GTB_VM_ACCEL=$(sed -n 's/.*gtb.accel=\([a-z]*\).*/\1/p' /proc/cmdline) sh __JOB__/job.sh </dev/null
rc=$?
echo "$rc" > __JOB__/rc.tmp && mv __JOB__/rc.tmp __JOB__/rc
echo "gtb-vm: job exited $rc after $(cut -d' ' -f1 /proc/uptime) s"
sync
mount -o remount,ro / 2>/dev/null
echo o > /proc/sysrq-trigger
sleep 30
""".replace("__JOB__", GUEST_JOB).replace("__SRC__", GUEST_SRC).replace("__GUEST_MODULES__", " ".join(_GUEST_MODULES))


class VMError(RuntimeError):
    """The VM could not be built or run; the message is one line."""


@dataclass
class Image:
    dir: Path

    @property
    def kernel(self) -> Path:
        return self.dir / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.dir / "initrd.img"

    @property
    def disk(self) -> Path:
        return self.dir / "disk.img"

    @property
    def meta(self) -> dict:
        try:
            return json.loads((self.dir / "image.json").read_text())
        except (OSError, ValueError):
            return {}


@dataclass
class JobResult:
    rc: int | None  # the job's exit status; None: the guest never reported one
    console: str  # everything the guest printed on its serial console
    accel: str
    boot_s: float | None  # QEMU start to the guest's init running
    wall_s: float
    files: dict[str, bytes] = field(default_factory=dict)  # what the job left in its folder
    timed_out: bool = False

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.console.rstrip().splitlines()[-lines:])


# -- what is needed ----------------------------------------------------------------------
def missing() -> str | None:
    """Why the VM cannot be built or run here, or None."""
    if os.geteuid() != 0:
        return "the netem VM needs root (debootstrap, chroot)"
    tools = {"qemu-system-x86_64": "qemu-system-x86", "debootstrap": "debootstrap", "mke2fs": "e2fsprogs"}
    absent = [pkg for tool, pkg in tools.items() if shutil.which(tool) is None]
    if absent:
        return f"the netem VM needs {', '.join(absent)} (apt-get install {' '.join(absent)}; setup.sh test installs them)"
    return None


# -- the image ---------------------------------------------------------------------------
def image_key() -> str:
    """Hash of everything the built image depends on besides the Debian archive."""
    h = hashlib.sha256(f"recipe {_RECIPE} {SUITE} {MIRROR} {BOOT_PACKAGES} {_INITRAMFS_MODULES} "
                       f"{GUEST_EXTRAS} {GUEST_PIP_EXCLUDE}\n".encode())
    h.update(GUEST_INIT.encode())
    h.update(_DOCTOR_SCRIPT.encode())
    h.update(b"pyproject.toml\0" + _install_spec() + b"\0")
    files = [REPO / "constraints.txt"] + sorted(p for p in (REPO / "playbooks").rglob("*") if p.is_file())
    for path in files:
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _install_spec() -> bytes:
    """What of pyproject.toml an install reads: all of it but pytest's own table (its markers
    and options change often and reach the guest through the live project, not the image)."""
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    data.get("tool", {}).pop("pytest", None)
    return json.dumps(data, sort_keys=True).encode()


def find_image() -> Image | None:
    """The cached image for the current key, if it was built completely."""
    img = Image(CACHE / f"image-{image_key()}")
    if all(p.exists() for p in (img.kernel, img.initrd, img.disk, img.dir / "image.json")):
        return img
    return None


def ensure_image(progress: Callable[[str], None] | None = None,
                 cancel: "threading.Event | None" = None) -> Image:
    """The cached image, built first if there is none for the current key."""
    return find_image() or build_image(progress, cancel=cancel)


# What a build asks the new image before it is kept: which backends its kernel offers.
_DOCTOR_SCRIPT = f"{GUEST_PROJECT}/.venv/bin/testbed doctor --json > {GUEST_JOB}/doctor.json\n"


def _doctor_said(result: "JobResult") -> dict:
    """What ``_DOCTOR_SCRIPT`` left in the job's folder ({} where it left nothing)."""
    return json.loads(result.files.get("doctor.json", b"{}") or b"{}")


def _provision_script() -> str:
    """The playbook check's job: the playbook, connection local, then ``testbed doctor``."""
    extra = json.dumps({"python_exclude": GUEST_PIP_EXCLUDE, "python_extras": GUEST_EXTRAS})
    return f"""set -eu
cd {GUEST_PROJECT}
# pip takes its certificate authorities from the system (which trusts the host's; see _copy_host_trust)
export PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=120
echo "gtb-vm: running playbooks/site.yml (connection local)"
export PATH={GUEST_PROJECT}/.venv/bin:$PATH ANSIBLE_NOCOLOR=1 ANSIBLE_RETRY_FILES_ENABLED=0 \\
  ANSIBLE_DEPRECATION_WARNINGS=0 ANSIBLE_LOCALHOST_WARNING=0
ansible-playbook -i playbooks/inventory.local.ini playbooks/site.yml -e {shlex.quote(extra)}
{_DOCTOR_SCRIPT}"""


def check_playbook(image: Image | None = None, progress: Callable[[str], None] | None = None,
                   timeout_s: float = 900.0) -> dict:
    """Provision a throwaway copy of the image with the live ``playbooks/site.yml`` (connection
    local, user-mode network, nothing kept): the playbook on a machine that is not this one and a
    kernel that is not this one.  Returns the guest's ``testbed doctor --json`` afterwards and
    the run's seconds; a one-line ``VMError`` where the playbook fails (minutes under TCG)."""
    say = progress or (lambda msg: None)
    image, accel = _bootable(image or ensure_image(progress), None)
    say(f"provisioning a throwaway copy of the image with playbooks/site.yml ({accel}; minutes)")
    result = run_job(_provision_script(), image=image, network=True, timeout_s=timeout_s, accel=accel,
                     on_line=lambda line: say(f"  guest: {line}"))
    if result.timed_out or result.rc != 0:
        log = CACHE / "playbook-check.log"
        log.write_text(result.console)
        state = f"did not finish within {timeout_s:.0f} s" if result.timed_out else f"failed (rc {result.rc})"
        raise VMError(f"playbooks/site.yml in the VM ({accel}) {state}; console in {log}: "
                      f"{_last_error(result.console)}")
    doctor = _doctor_said(result)
    return {"doctor": doctor, "wall_s": round(result.wall_s, 1), "accel": accel}


def build_image(progress: Callable[[str], None] | None = None, keep_debs: bool = True,
                cancel: "threading.Event | None" = None) -> Image:
    """Build the image for the current key (minutes; see the module docstring); once ``cancel``
    is set (from another thread), it stops within a second with a one-line ``VMError``."""
    why = missing()
    if why:
        raise VMError(why)
    say = progress or (lambda msg: None)
    CACHE.mkdir(parents=True, exist_ok=True)
    with _Flock(CACHE / "build.lock"):
        img = find_image()
        if img is not None:
            return img  # built by another process while we waited
        key = image_key()
        global _build_deadline, _build_cancel
        _build_deadline = time.monotonic() + BUILD_TIMEOUT_S
        _build_cancel = cancel
        work = CACHE / f"build-{os.getpid()}"
        for stale in CACHE.glob("build-*"):  # a build killed outright leaves its folder; the lock is ours
            if stale.is_dir():
                _remove_tree(stale)
        work.mkdir()
        root = work / "rootfs"
        t0 = time.monotonic()
        try:
            times = {}
            say(f"debootstrap {SUITE} from {MIRROR} (kernel, Python, iproute2)")
            debs = CACHE / "debs"
            debs.mkdir(exist_ok=True)
            _check([
                "debootstrap", "--variant=minbase", f"--include={','.join(BOOT_PACKAGES)}",
                f"--cache-dir={debs}", SUITE, str(root), MIRROR,
            ], "debootstrap", log=work / "debootstrap.log")
            times["debootstrap_s"] = round(time.monotonic() - t0, 1)
            t1 = time.monotonic()
            say("installing the playbook's base packages (apt in a chroot, at native speed)")
            _preinstall(root, _base_packages(), debs)
            times["preinstall_s"] = round(time.monotonic() - t1, 1)
            t1 = time.monotonic()
            say("configuring the root filesystem and its initramfs")
            kernel_version = _configure_rootfs(root)
            t3 = time.monotonic()
            say("bootstrapping the project's venv as setup.sh does (pip in a chroot, at native speed)")
            _bootstrap_venv(root)
            times["bootstrap_s"] = round(time.monotonic() - t3, 1)
            boot = root / "boot"
            shutil.copy2(boot / f"vmlinuz-{kernel_version}", work / "vmlinuz")
            shutil.copy2(boot / f"initrd.img-{kernel_version}", work / "initrd.img")
            say(f"making the {DISK_SIZE} ext4 disk image")
            _check(["mke2fs", "-q", "-F", "-t", "ext4", "-L", "gtbroot", "-d", str(root),
                    str(work / "disk.img"), DISK_SIZE], "mke2fs")
            _remove_tree(root)
            times["rootfs_s"] = round(time.monotonic() - t1, 1)
            t2 = time.monotonic()
            accel = choose_accel(Image(work), say)
            say(f"asking the guest's testbed doctor what its kernel offers ({accel})")
            result = run_job(_DOCTOR_SCRIPT, image=Image(work), share_src=False, accel=accel,
                             timeout_s=_build_time_left("the guest's testbed doctor") or _DEFAULT_TIMEOUT_S,
                             cancel=cancel)
            if cancel is not None and cancel.is_set():
                raise VMError("the build was cancelled")
            if result.rc != 0 or result.timed_out:
                (CACHE / "build-failed.log").write_text(result.console)
                raise VMError(f"testbed doctor in the new image failed (rc {result.rc}; console in "
                              f"{CACHE / 'build-failed.log'}): {_last_error(result.console)}")
            doctor = _doctor_said(result)
            times["doctor_s"] = round(time.monotonic() - t2, 1)
            times["total_s"] = round(time.monotonic() - t0, 1)
            meta = {"key": key, "suite": SUITE, "mirror": MIRROR, "kernel": kernel_version,
                    "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "accel": accel, "times": times,
                    "pip_excluded": GUEST_PIP_EXCLUDE,
                    "backends": doctor.get("backends"), "qdisc_netem": doctor.get("capabilities", {})
                    .get("qdiscs", {}).get("netem")}
            if meta["backends"] is None or meta["backends"].get("delay") != "netem":
                raise VMError(f"the new image does not choose netem: testbed doctor said {doctor}")
            (work / "image.json").write_text(json.dumps(meta, indent=1) + "\n")
            final = CACHE / f"image-{key}"
            _remove_tree(final)
            work.rename(final)
        except BaseException:
            _remove_tree(work)
            raise
        finally:
            _build_deadline = _build_cancel = None
        # keep the newest other image too: another checkout (or branch) may be using it
        others = sorted((p for p in CACHE.glob("image-*") if p != final), key=lambda p: p.stat().st_mtime)
        for old in others[:-1]:
            _remove_tree(old)
        (CACHE / "build-failed.log").unlink(missing_ok=True)
        if not keep_debs:
            _remove_tree(debs)
        say(f"image ready in {times['total_s']:.0f} s: {final}")
        return Image(final)


def _base_packages() -> list[str]:
    """The playbook's own package list (roles/base), so that there is one list."""
    import yaml

    data = yaml.safe_load((REPO / "playbooks/roles/base/defaults/main.yml").read_text())
    return list(data["base_packages"])


def _preinstall(root: Path, packages: list[str], debs: Path) -> None:
    """apt-get install in a chroot (services kept from starting, /proc mounted for the
    maintainer scripts and unmounted after); downloaded .deb files go to the cache."""
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    archives = root / "var/cache/apt/archives"
    for deb in debs.glob("*.deb"):
        if not (archives / deb.name).exists():
            shutil.copy2(deb, archives / deb.name)
    _check(["mount", "-t", "proc", "proc", str(root / "proc")], "mount /proc in the chroot")
    try:
        env = ["env", "DEBIAN_FRONTEND=noninteractive", "LANG=C.UTF-8"]
        _check(["chroot", str(root), *env, "apt-get", "update", "-qq"], "apt-get update (chroot)")
        _check(["chroot", str(root), *env, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
               "apt-get install (chroot)")
    finally:
        subprocess.run(["umount", "-l", str(root / "proc")], capture_output=True)
        policy.unlink(missing_ok=True)
    for deb in archives.glob("*.deb"):
        if not (debs / deb.name).exists():
            shutil.copy2(deb, debs / deb.name)
    _check(["chroot", str(root), "apt-get", "clean"], "apt-get clean (chroot)")


def _bootstrap_venv(root: Path) -> None:
    """setup.sh's first step in the image: a venv with the project and its dependencies
    (less GUEST_PIP_EXCLUDE, by the python role's own helper), so that Ansible can start;
    the playbook's python role then checks and records it inside the guest."""
    shutil.copy2("/etc/resolv.conf", root / "etc/resolv.conf")
    env = ["env", "PIP_CERT=/etc/ssl/certs/ca-certificates.crt", "PIP_NO_CACHE_DIR=1",
           "PIP_DISABLE_PIP_VERSION_CHECK=1", "PIP_DEFAULT_TIMEOUT=120", "HOME=/root", "LANG=C.UTF-8"]
    _check(["chroot", str(root), *env, "python3", "-m", "venv", f"{GUEST_PROJECT}/.venv"], "python3 -m venv (chroot)")
    helper = f"{GUEST_PROJECT}/playbooks/roles/python/files/install_except.py"
    _check(["chroot", str(root), *env, GUEST_PYTHON, helper, GUEST_PROJECT, GUEST_EXTRAS, *GUEST_PIP_EXCLUDE],
           "pip install (chroot)")


def _configure_rootfs(root: Path) -> str:
    """Hostname, a small initramfs, the init script, the project copy; the kernel version."""
    versions = sorted(p.name[len("vmlinuz-"):] for p in (root / "boot").glob("vmlinuz-*"))
    if not versions:
        raise VMError("debootstrap installed no kernel (linux-image-amd64)")
    (root / "etc/hostname").write_text("gtb-vm\n")
    (root / "etc/hosts").write_text("127.0.0.1 localhost\n127.0.1.1 gtb-vm\n")
    (root / "etc/fstab").write_text("/dev/vda / ext4 rw,noatime 0 1\n")
    conf = root / "etc/initramfs-tools/initramfs.conf"
    conf.write_text(re.sub(r"(?m)^MODULES=.*$", "MODULES=list", conf.read_text()))
    (root / "etc/initramfs-tools/modules").write_text("\n".join(_INITRAMFS_MODULES) + "\n")
    (root / "etc/initramfs-tools/conf.d").mkdir(exist_ok=True)
    (root / "etc/initramfs-tools/conf.d/resume").write_text("RESUME=none\n")
    _check(["chroot", str(root), "update-initramfs", "-u", "-k", "all"], "update-initramfs")
    init = root / "usr/local/sbin/gtb-init"
    init.write_text(GUEST_INIT)
    init.chmod(0o755)
    _copy_host_trust(root)
    _remove_tree(root / GUEST_PROJECT.lstrip("/"))
    shutil.copytree(REPO, root / GUEST_PROJECT.lstrip("/"), ignore=_COPY_IGNORE, symlinks=True)
    return versions[-1]


def _copy_host_trust(root: Path) -> None:
    """The guest downloads through the host (user-mode networking): where the host trusts
    extra certificate authorities (a TLS-inspecting proxy), the guest must trust them too."""
    extra = sorted(Path("/usr/local/share/ca-certificates").glob("**/*.crt"))
    if not extra:
        return
    dest = root / "usr/local/share/ca-certificates/gtb-host"
    dest.mkdir(parents=True, exist_ok=True)
    for crt in extra:
        shutil.copy2(crt, dest / crt.name)
    _check(["chroot", str(root), "update-ca-certificates"], "update-ca-certificates")


# -- acceleration -------------------------------------------------------------------------
def choose_accel(image: Image | None = None, progress: Callable[[str], None] | None = None) -> str:
    """'kvm' where a probe boot under KVM finishes, else 'tcg'; cached per host and QEMU."""
    forced = os.environ.get("GTB_VM_ACCEL", "auto")
    if forced in ("kvm", "tcg"):
        return forced
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    host = f"{os.uname().release} | {qemu}"
    cache = CACHE / "accel.json"
    try:
        cached = json.loads(cache.read_text())
        if cached.get("host") == host:
            return cached["accel"]
    except (OSError, ValueError, KeyError):
        pass
    image = image or find_image()
    if image is None:
        return "tcg"  # nothing to probe with yet; the build probes
    (progress or (lambda m: None))("probing KVM with a short boot")
    result = run_job("echo gtb-kvm-ok", image=image, accel="kvm", share_src=False, timeout_s=_KVM_PROBE_S)
    ok = result.rc == 0 and "gtb-kvm-ok" in result.console
    shown = [ln for ln in result.console.splitlines() if ln.strip() and not ln.startswith("[qemu]")]
    why = "" if ok else (f"a probe boot under KVM did not finish in {_KVM_PROBE_S:.0f} s (last console line: "
                         f"{shown[-1][-120:] if shown else 'none'!r})")
    cache.write_text(json.dumps({"host": host, "accel": "kvm" if ok else "tcg", "why_not_kvm": why,
                                 "probe_s": round(result.wall_s, 1)}) + "\n")
    return "kvm" if ok else "tcg"


# -- running -------------------------------------------------------------------------------
def default_cpus() -> int:
    return int(os.environ.get("GTB_VM_CPUS", min(2, os.cpu_count() or 1)))


def default_memory_mb() -> int:
    return int(os.environ.get("GTB_VM_MEMORY_MB", 2048))


def qemu_command(image: Image, job_dir: Path, accel: str, network: bool = False, writable: bool = False,
                 share_src: bool = True, interactive: bool = False, cpus: int | None = None,
                 memory_mb: int | None = None) -> list[str]:
    """The QEMU command line for one boot (see the module docstring)."""
    cmdline = (f"console=ttyS0 root=/dev/vda rw init=/usr/local/sbin/gtb-init panic=-1 net.ifnames=0 "
               f"random.trust_cpu=on gtb.accel={accel}" + ("" if interactive else " quiet"))
    cmd = [
        "qemu-system-x86_64", "-name", "gtb-vm", "-nodefaults", "-no-user-config", "-no-reboot",
        "-display", "none", "-machine", "q35", "-accel", accel,
        "-cpu", "max" if accel == "tcg" else "host,-arch-capabilities",
        "-smp", str(cpus or default_cpus()), "-m", str(memory_mb or default_memory_mb()),
        "-kernel", str(image.kernel), "-initrd", str(image.initrd), "-append", cmdline,
        "-drive", f"file={image.disk},format=raw,if=virtio,cache={'writeback' if writable else 'unsafe'}"
                  + ("" if writable else ",snapshot=on"),
        "-device", "virtio-rng-pci",
        "-fsdev", f"local,id=gtbjob,path={job_dir},security_model=none",
        "-device", "virtio-9p-pci,fsdev=gtbjob,mount_tag=gtbjob",
    ]
    if share_src:
        cmd += ["-fsdev", f"local,id=gtbsrc,path={REPO},security_model=none,readonly=on",
                "-device", "virtio-9p-pci,fsdev=gtbsrc,mount_tag=gtbsrc"]
    if network:
        cmd += ["-netdev", "user,id=net0", "-device", "virtio-net-pci,netdev=net0,romfile="]
    if interactive:
        cmd += ["-serial", "mon:stdio"]
    else:
        cmd += ["-serial", f"file:{job_dir / 'console.log'}"]
    return cmd


def _bootable(image: Image | None, accel: str | None) -> tuple[Image, str]:
    """The image to boot (the given one or the newest built) and its accelerator; a one-line
    ``VMError`` where qemu is missing or no image is built."""
    why = missing()
    if why:
        raise VMError(why)
    image = image or find_image()
    if image is None:
        raise VMError("no netem VM image yet: run 'testbed vm build'")
    return image, accel or choose_accel(image)


def run_job(script: str, image: Image | None = None, network: bool = False, writable: bool = False,
            share_src: bool = True, timeout_s: float = _DEFAULT_TIMEOUT_S, accel: str | None = None,
            on_line: Callable[[str], None] | None = None, env: dict[str, str] | None = None,
            cancel: "threading.Event | None" = None) -> JobResult:
    """Boot the VM, run ``script`` (sh) as root in it, power off; the VM is gone when this returns
    (also once ``cancel`` is set: a job run from a thread, given up).

    The project is at ``/mnt/gtb`` (read-only) unless ``share_src`` is false; the script
    may leave files in ``/mnt/gtbjob``, which come back in ``JobResult.files``.
    """
    image, accel = _bootable(image, accel)
    job_dir = _new_job_dir()
    try:
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in (env or {}).items())
        (job_dir / "init.sh").write_text(RUN_INIT)
        (job_dir / "job.sh").write_text(exports + script + "\n")
        cmd = qemu_command(image, job_dir, accel, network=network, writable=writable, share_src=share_src)
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent, start_new_session=True)
        tail = _ConsoleTail(job_dir / "console.log", t0, on_line)
        timed_out = False
        try:
            deadline = t0 + timeout_s
            while True:
                try:
                    proc.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())) if cancel else timeout_s)
                    break
                except subprocess.TimeoutExpired:
                    if cancel is not None and cancel.is_set():
                        break
                    if time.monotonic() >= deadline:
                        timed_out = True
                        break
        finally:
            _stop_qemu(proc)  # also on Ctrl-C: the VM never outlives this call
            tail.stop()
        wall = time.monotonic() - t0
        qemu_out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
        console = _read_text(job_dir / "console.log")
        if qemu_out.strip():
            console += "\n[qemu] " + qemu_out.strip()
        rc_text = _read_text(job_dir / "rc").strip()
        files = {}
        for p in job_dir.iterdir():
            if p.is_file() and p.name not in ("init.sh", "job.sh", "console.log", "rc"):
                files[p.name] = p.read_bytes()
        return JobResult(int(rc_text) if rc_text.lstrip("-").isdigit() else None, console, accel, tail.boot_s,
                         wall, files, timed_out)
    finally:
        _remove_job_dir(job_dir)


def shell(image: Image | None = None, accel: str | None = None, network: bool = False) -> int:
    """An interactive root shell in a throwaway VM on this terminal (exit it to stop the VM)."""
    image, accel = _bootable(image, accel)
    job_dir = _new_job_dir()
    try:
        (job_dir / "init.sh").write_text(RUN_INIT)
        (job_dir / "job.sh").write_text(
            f"cd {GUEST_SRC} 2>/dev/null; export PYTHONPATH={GUEST_SRC} PYTHONDONTWRITEBYTECODE=1 "
            f"PATH={GUEST_PROJECT}/.venv/bin:$PATH\n"
            "echo 'gtb-vm: the project is at /mnt/gtb (read-only); exit the shell to stop the VM'\n"
            "setsid -c /bin/bash -i </dev/ttyS0 >/dev/ttyS0 2>&1\n")
        cmd = qemu_command(image, job_dir, accel, network=network, interactive=True)
        proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
        try:
            return proc.wait()
        finally:
            _stop_qemu(proc)
    finally:
        _remove_job_dir(job_dir)


def pytest_job(nodeids: list[str], report_name: str = "results.jsonl", extra_args: list[str] | None = None) -> str:
    """A job script that runs these tests (the live project at /mnt/gtb) with the guest's venv,
    writing one JSON line per test phase to the job folder (``tests/netem_vm.py`` reads it)."""
    args = ["-p", "no:cacheprovider", "-q", "-rA", "-o", "console_output_style=classic", *(extra_args or []),
            *nodeids]
    return (f"cd {GUEST_SRC}\n"
            f"export PYTHONPATH={GUEST_SRC} PYTHONDONTWRITEBYTECODE=1 GTB_NETEM_VM=off "
            f"GTB_VM_REPORT={GUEST_JOB}/{report_name}\n"
            "echo \"gtb-vm: $(nproc) CPUs, $(grep MemTotal /proc/meminfo | tr -s ' ' | cut -d' ' -f2-), "
            "clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource)\"\n"
            f"{GUEST_PYTHON} -m pytest {' '.join(shlex.quote(a) for a in args)}\n")


def status() -> dict:
    """What is cached and what a run would use (no VM is started)."""
    img = find_image()
    others = sorted(p.name for p in CACHE.glob("image-*")) if CACHE.exists() else []
    try:
        accel = json.loads((CACHE / "accel.json").read_text())
    except (OSError, ValueError):
        accel = None
    return {"cache": str(CACHE), "key": image_key(), "image": str(img.dir) if img else None,
            "image_meta": img.meta if img else None, "stale_images": [o for o in others if img is None
                                                                       or o != img.dir.name],
            "accel_probe": accel, "cpus": default_cpus(), "memory_mb": default_memory_mb(),
            "disk_bytes_used": _du(CACHE) if CACHE.exists() else 0, "missing": missing()}


def remove_image(image: Image) -> None:
    with _Flock(CACHE / "build.lock"):
        _remove_tree(image.dir)


def remove_cache() -> None:
    """Remove every image, the .deb cache and the probe result."""
    if CACHE.exists():
        with _Flock(CACHE / "build.lock"):
            for p in CACHE.iterdir():
                if p.name != "build.lock":
                    _remove_tree(p) if p.is_dir() else p.unlink()
        (CACHE / "build.lock").unlink(missing_ok=True)
        for p in (CACHE, CACHE.parent):
            try:
                p.rmdir()
            except OSError:
                break


# -- helpers -------------------------------------------------------------------------------
class _ConsoleTail:
    """Follows the serial console file: lines to a callback, and when the guest's init ran."""

    def __init__(self, path: Path, t0: float, on_line: Callable[[str], None] | None):
        self.path, self.t0, self.on_line = path, t0, on_line
        self.boot_s: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pos, buf = 0, ""
        while True:
            stopping = self._stop.is_set()
            try:
                with open(self.path, "rb") as fh:
                    fh.seek(pos)
                    chunk = fh.read()
                    pos += len(chunk)
            except OSError:
                chunk = b""
            buf += chunk.decode(errors="replace")
            *lines, buf = buf.split("\n")
            for line in lines:
                line = _ANSI.sub("", line).rstrip("\r")
                if self.boot_s is None and line.startswith("gtb-vm: up"):
                    self.boot_s = time.monotonic() - self.t0
                if self.on_line and line.strip():
                    self.on_line(line)
            if stopping:
                return
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1bc")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)


def _stop_qemu(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _new_job_dir() -> Path:
    runs = CACHE / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    for old in runs.glob("run-*"):  # folders of runs whose process is gone
        pid = old.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _remove_tree(old)
    n = 0
    while (runs / f"run-{os.getpid()}-{n}").exists():
        n += 1
    path = runs / f"run-{os.getpid()}-{n}"
    path.mkdir(parents=True)
    return path


def _remove_job_dir(path: Path) -> None:
    _remove_tree(path)
    try:
        path.parent.rmdir()  # runs/ goes too when no other run is using it
    except OSError:
        pass


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mounts") as fh:
        points = [line.split()[1].encode().decode("unicode_escape") for line in fh]
    return [p for p in points if p.startswith(prefix) or p == prefix[:-1]]


def _remove_tree(path: Path) -> None:
    """rm -rf, but never through a mount (a debootstrap killed mid-way leaves /proc mounted)."""
    if not path.exists():
        return
    for point in sorted(_mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)
    left = _mounts_under(path)
    if left:
        raise VMError(f"refusing to remove {path}: still mounted: {left[0]}")
    shutil.rmtree(path)


def _build_time_left(what: str) -> float | None:
    """Seconds left of the build's deadline (None outside a build); VMError when none are."""
    if _build_deadline is None:
        return None
    left = _build_deadline - time.monotonic()
    if left <= 0:
        raise VMError(f"the image build ran out of its {BUILD_TIMEOUT_S:.0f} s (GTB_VM_BUILD_TIMEOUT_S) before {what}")
    return left


def _check(cmd: list[str], what: str, log: Path | None = None) -> None:
    """Run a build step; VMError (one line) when it fails, outlives the build's deadline or the
    build is cancelled (``build_image(cancel=...)``)."""
    timeout = _build_time_left(what)
    deadline = None if timeout is None else time.monotonic() + timeout
    out_fh = open(log, "w") if log is not None else subprocess.PIPE
    proc = subprocess.Popen(cmd, stdout=out_fh, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    stdout = ""
    try:
        while True:
            try:
                stdout, _ = proc.communicate(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                why = None
                if _build_cancel is not None and _build_cancel.is_set():
                    why = f"{what}: the build was cancelled"
                elif deadline is not None and time.monotonic() >= deadline:
                    why = f"{what} did not finish within the build's {BUILD_TIMEOUT_S:.0f} s (GTB_VM_BUILD_TIMEOUT_S)"
                if why:
                    os.killpg(proc.pid, signal.SIGKILL)  # debootstrap and chroot leave children otherwise
                    proc.communicate()
                    raise VMError(why) from None
    finally:
        if log is not None:
            out_fh.close()
    out = _read_text(log) if log is not None else (stdout or "")
    if proc.returncode != 0:
        raise VMError(f"{what} failed (exit {proc.returncode}): {_last_error(out)}")


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in _ANSI.sub("", text).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"error|fatal|failed|E:|W: Failure", ln, re.I) and not ln.startswith("gtb-vm: job exited"):
            return ln[-300:]
    return lines[-1][-300:] if lines else "no output"


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _du(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_blocks * 512
        except OSError:
            pass
    return total


class _Flock:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


if __name__ == "__main__":  # python -m testbed.tools.vm: build the image (the CLI is `testbed vm`)
    print(build_image(progress=lambda m: print(m, flush=True)).dir)
    sys.exit(0)
