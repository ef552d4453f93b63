#!/usr/bin/env bash
# Installs the Debian packages whose servers the tests, the demo, the benchmarks and the
# chaos suite start for themselves, when they are missing. Run as root (CI does); otherwise it
# only lists what is missing, and the tests that need it skip locally (and fail under CI=true).
#
#   binary the suite looks for        Debian package
#   pg_ctl (PostgreSQL server)         postgresql
#   pgbouncer                          pgbouncer
#   redis-server                       redis-server
#   rabbitmq-server, rabbitmqctl       rabbitmq-server
#   chromium, chromedriver             chromium, chromium-driver (the admin dashboard's browser test)
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/lib/rabbitmq/bin/$1" ]; }
have_pg_server() { command -v pg_ctl >/dev/null 2>&1 || compgen -G '/usr/lib/postgresql/*/bin/pg_ctl' >/dev/null; }

missing=()
have_pg_server || missing+=(postgresql)
have pgbouncer || missing+=(pgbouncer)
have redis-server || missing+=(redis-server)
{ have rabbitmq-server && have rabbitmqctl; } || missing+=(rabbitmq-server)
have chromium || missing+=(chromium)
have chromedriver || missing+=(chromium-driver)

if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system packages missing (install them to run every test): ${missing[*]}" >&2
    exit 0
fi
echo "installing missing system packages: ${missing[*]}" >&2
# Packages must not start their own services here: the tests start private servers on free
# ports, and the machine's shared services are already running. policy-rc.d (exit 101) is
# Debian's way to tell maintainer scripts not to start anything.
policy=/usr/sbin/policy-rc.d
placed=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    placed=1
fi
cleanup() { if [ "$placed" -eq 1 ]; then rm -f "$policy"; fi; }
trap cleanup EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# debconf's "delaying package configuration, since apt-utils is not installed" is Debian's
# own chatter on a minimal machine, not a problem: dropped; every other line of stderr stays.
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    2> >(grep -v '^debconf: delaying package configuration' >&2)
