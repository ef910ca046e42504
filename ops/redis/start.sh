#!/usr/bin/env bash
# Start a Redis for tokenmill with ops/redis/redis.conf.
# Usage: ops/redis/start.sh [DATA_DIR] [extra redis-server args, e.g. --port 6380 --requirepass secret]
# It listens on localhost only; for remote workers pass --bind "0.0.0.0 ::" together with --requirepass.
# Runs in the foreground (for systemd, containers); add --daemonize yes to detach.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
data_dir="${1:-${TOKENMILL_REDIS_DIR:-$HOME/.local/share/tokenmill/redis}}"
shift || true

command -v redis-server >/dev/null || { echo "redis-server not found (apt install redis-server, or use the redis:7 image)" >&2; exit 1; }
version="$(redis-server --version | sed -E 's/.*v=([0-9]+\.[0-9]+).*/\1/')"
major="${version%%.*}"; minor="${version#*.}"
if (( major < 6 || (major == 6 && minor < 2) )); then
  echo "Redis $version is too old: tokenmill needs >= 6.2 (ZMSCORE, XTRIM MINID); >= 7.0 for lag metrics" >&2
  exit 1
fi

mkdir -p "$data_dir"
exec redis-server "$here/redis.conf" --dir "$data_dir" "$@"
