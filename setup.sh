#!/usr/bin/env bash
# Set up this machine for the testbed (idempotent), then run what was asked:
#   bash setup.sh demo   -> the main job (experiments/default.yaml) on its default topology
#   bash setup.sh test   -> the quick suite, the tests not marked slow (more arguments go to
#                           pytest: test tests/test_lab.py, test -k wan, test -m slow)
#   bash setup.sh test-all -> every test, the slow experiments too
#   bash setup.sh        -> set up only
# Needs root. It bootstraps only what Ansible needs to start (Python, a venv with the
# project and ansible-runner), then runs playbooks/site.yml through `testbed provision`:
# the same playbook Vagrant and a fleet of servers use.
set -euo pipefail
cd "$(dirname "$0")"
what="${1:-setup}"
case "$what" in
  setup|demo|test|test-all) ;;
  *) echo "usage: bash setup.sh [setup|demo|test|test-all]" >&2; exit 2 ;;
esac

if [ "$(id -u)" -ne 0 ]; then
  echo "error: run as root (apt-get, network namespaces and tc need it)" >&2
  exit 1
fi

apt_install() {
  local missing=""
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
  done
  if [ -n "$missing" ]; then
    echo "installing Debian packages:$missing"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  fi
}

# 1. bootstrap: the system Python (Debian's mininet and python3-apt are built for it) and a venv
apt_install ca-certificates python3 python3-venv python3-apt
if [ ! -x .venv/bin/python ]; then
  /usr/bin/python3 -m venv .venv
fi
# (extensions are found through the package's entry points: an install older than them has none)
if ! .venv/bin/python -c "import testbed.extension as e, torch, ansible_runner, highspy, scapy, pytest_rerunfailures, hypothesis, jsonschema; assert e.extensions()" 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[all,test]' 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -c "import testbed, torch, ansible_runner, highspy, scapy, pytest_rerunfailures, hypothesis, jsonschema"
  # what the playbook's python role records after the same install (its python_wanted), so it
  # does not install it all again
  echo "$(sha1sum < pyproject.toml | cut -d' ' -f1) $(sha1sum < constraints.txt | cut -d' ' -f1)" > .venv/.installed
fi

# 2. everything else: the playbook
.venv/bin/testbed provision

case "$what" in
  setup) echo "set up: .venv/bin/testbed is ready" ;;
  demo) exec .venv/bin/testbed run experiments/default.yaml --out results/default ;;
  test|test-all)
    apt_install vagrant faketime  # the tests validate the Vagrantfile; faketime drifts a fake machine's clock
    # Where this kernel has no netem, the netem variants run in a VM with Debian's stock kernel
    # (testbed/tools/vm.py, tests/netem_vm.py; its image is built once, ~8 min, into
    # /var/cache/geo-testbed/vm).
    # Required here: a VM that cannot be built or run fails those tests with the one-line
    # reason instead of skipping them; a build gives up after 20 min.
    apt_install qemu-system-x86 debootstrap e2fsprogs
    export GTB_NETEM_VM="${GTB_NETEM_VM:-required}"
    # test: the quick suite (the experiments marked slow left out); test-all: every test
    quick=(-m "not slow")
    [ "$what" = test-all ] && quick=()
    exec .venv/bin/python -m pytest -ra --durations=15 "${quick[@]}" "${@:2}" ;;
esac  # (a word it does not take was refused at the top)
