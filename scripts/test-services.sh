#!/usr/bin/env bash
# What `make test` needs besides the venvs: Debian's PostgreSQL (started, with the tests' `coop` role) for the
# coordinator's database tests, Debian's Chromium for the browser tests, iproute2 (ip, tc) for the tests that
# run hosts in network namespaces, and debootstrap with systemd-nspawn for the rehearsal on a booted host
# (scripts/rehearse.py). Installs them when run as root; as another user it starts nothing and says what
# is missing (outside CI those tests then skip or fail; in CI they fail).
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
  command -v pg_ctlcluster >/dev/null 2>&1 || echo "test-services: no PostgreSQL here, and not root to install it" >&2
  [ -x /usr/bin/chromium ] || echo "test-services: no /usr/bin/chromium here, and not root to install it" >&2
  echo "test-services: the network namespace tests need root" >&2
  exit 0
fi

missing=()
command -v pg_ctlcluster >/dev/null 2>&1 || missing+=(postgresql)
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v tc >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v systemd-nspawn >/dev/null 2>&1 || missing+=(systemd-container)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

cluster=$(pg_lsclusters --no-header | awk 'NR == 1 { print $1 " " $2 }')
# shellcheck disable=SC2086
pg_ctlcluster $cluster start >/dev/null 2>&1 || pg_ctlcluster $cluster status >/dev/null
su postgres -c "psql -tAc \"SELECT 1 FROM pg_roles WHERE rolname = 'coop'\"" | grep -q 1 \
  || su postgres -c "psql -qc \"CREATE ROLE coop LOGIN SUPERUSER PASSWORD 'coop'\""
