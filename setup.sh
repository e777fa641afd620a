#!/usr/bin/env bash
# Set up this machine for the testbed (idempotent), then run what was asked:
#   bash setup.sh demo   -> the main job (experiments/default.yaml) on its default topology
#   bash setup.sh test   -> the test suite
#   bash setup.sh        -> set up only
# Needs root: it installs Debian packages and the testbed builds network namespaces.
set -euo pipefail
cd "$(dirname "$0")"
what="${1:-setup}"

if [ "$(id -u)" -ne 0 ]; then
  echo "error: run as root (apt-get, network namespaces and tc need it)" >&2
  exit 1
fi

APT_PACKAGES="python3 python3-venv python3-dev gcc mininet bridge-utils iperf3 iputils-ping iproute2 iptables procps"
missing=""
for p in $APT_PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "installing Debian packages:$missing"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# The venv uses the system interpreter: Debian's mininet is installed for it.
if [ ! -x .venv/bin/python ]; then
  /usr/bin/python3 -m venv .venv
fi
if ! .venv/bin/python -c "import testbed, pytest" 2>/dev/null || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -c "import testbed, pytest"
  touch .venv/.installed
fi

case "$what" in
  setup) echo "set up: .venv/bin/testbed is ready" ;;
  demo) exec .venv/bin/testbed run experiments/default.yaml --out results/default ;;
  test) exec .venv/bin/python -m pytest -ra ;;
  *) echo "usage: bash setup.sh [setup|demo|test]" >&2; exit 2 ;;
esac
