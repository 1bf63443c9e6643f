#!/usr/bin/env bash
# A Prefect server on PostgreSQL, on one host (issue 9).
#
#   deployments/server.sh start [ARGS]  the database (started if not running; initdb on first
#                                       use), then `prefect server start [ARGS]` in the foreground;
#                                       once its API answers, `lowerflow automations install`
#   deployments/server.sh db            only the database: start it if needed, print its URL
#   deployments/server.sh stop          stop the server started by `start`, then the database
#   deployments/server.sh status        is each running? (exit status 0 only if both are)
#   deployments/server.sh psql [ARGS]   psql on the Prefect database (as the cluster's superuser)
#
# `start` and `db` remember the data directory, the ports, HOST and the API URL in
# $LOWERFLOW_HOME/server.env: every later command (stop, status, psql, the next start)
# acts on that cluster and server without repeating them.  A variable set in the
# environment wins over the remembered value (and is remembered at the next start).
#
# Why: Prefect's default SQLite database locks up ("database is locked") when many
# workers and flow runs write at once; PostgreSQL does not.
#
# Settings (environment):
#   LOWERFLOW_HOME          state directory                 (default: $HOME/.lowerflow)
#   LOWERFLOW_PGDATA        the PostgreSQL cluster           (default: $LOWERFLOW_HOME/postgres)
#   LOWERFLOW_PG_PORT       PostgreSQL's port, on 127.0.0.1  (default: 5433)
#   LOWERFLOW_PG_PASSWORD   password of the role `prefect`   (default: generated on first use,
#                           kept in $LOWERFLOW_HOME/postgres.password, mode 600)
#   LOWERFLOW_PG_USER       OS user that runs PostgreSQL     (default: you; `postgres` if you are root:
#                           PostgreSQL refuses to run as root)
#   LOWERFLOW_PG_BINDIR     PostgreSQL's binaries            (default: `pg_config --bindir`, else the
#                           newest /usr/lib/postgresql/*/bin, else initdb on PATH)
#   HOST, PORT              the Prefect API's address        (default: 127.0.0.1, 4200; HOST=0.0.0.0 to
#                           serve workers on other machines)
#   PREFECT                 the prefect command              (default: prefect on PATH, else the repo's .venv)
#   PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE, _FLUSH_INTERVAL
#                           task runs written in batches     (default here: 200, 1 s; Prefect's: 1, 5 s)
#
#   LOWERFLOW_ZOMBIE_WINDOW seconds without a heartbeat before a run is Crashed (default: 90)
#   LOWERFLOW_FLEET_WINDOW  the same for lower-fleet runs (heartbeats every 10 s; default: 30)
#   LOWERFLOW_NOTIFY_URL    a webhook for failed nights, or LOWERFLOW_NOTIFY_BLOCK=TYPE/NAME a saved
#                           notification block (default: none; an installed one is kept)
#   LOWERFLOW_AUTOMATIONS   0: `start` installs no automation     (default: 1)
#   LOWERFLOW               the lowerflow command                 (default: beside PREFECT, else on PATH)
#
# The database only ever listens on 127.0.0.1 (and on a Unix socket inside its data
# directory, which only LOWERFLOW_PG_USER can open); the Prefect server is its only client.
set -euo pipefail

LOWERFLOW_HOME=${LOWERFLOW_HOME:-$HOME/.lowerflow}
STATE_FILE=$LOWERFLOW_HOME/server.env
# What the last `start`/`db` used, for every variable not set in the environment.
if [ -r "$STATE_FILE" ]; then
  while IFS='=' read -r key value; do
    case "$key" in
      LOWERFLOW_PGDATA|LOWERFLOW_PG_PORT|LOWERFLOW_PG_USER|HOST|PORT|LOWERFLOW_API_URL)
        [ -n "${!key+x}" ] || printf -v "$key" '%s' "$value" ;;
    esac
  done <"$STATE_FILE"
fi
PGDATA_DIR=${LOWERFLOW_PGDATA:-$LOWERFLOW_HOME/postgres}
PG_PORT=${LOWERFLOW_PG_PORT:-5433}
PG_DATABASE=prefect
PG_ROLE=prefect
PASSWORD_FILE=$LOWERFLOW_HOME/postgres.password
SERVER_PIDFILE=$LOWERFLOW_HOME/prefect-server.pid
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-4200}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

say() { echo "server.sh: $*" >&2; }
die() { echo "server.sh: error: $*" >&2; exit 1; }

# ----------------------------------------------------------------------------- PostgreSQL

find_bindir() {
  local dir
  if [ -n "${LOWERFLOW_PG_BINDIR:-}" ]; then
    [ -x "$LOWERFLOW_PG_BINDIR/pg_ctl" ] || die "LOWERFLOW_PG_BINDIR=$LOWERFLOW_PG_BINDIR has no pg_ctl"
    echo "$LOWERFLOW_PG_BINDIR"; return
  fi
  if command -v pg_config >/dev/null 2>&1; then
    dir=$(pg_config --bindir 2>/dev/null || true)
    if [ -n "$dir" ] && [ -x "$dir/initdb" ] && [ -x "$dir/pg_ctl" ]; then echo "$dir"; return; fi
  fi
  # Debian/Ubuntu keep the server binaries off PATH; take the newest version.
  dir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$dir" ] && [ -x "$dir/initdb" ]; then echo "$dir"; return; fi
  if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
    dirname "$(command -v initdb)"; return
  fi
  die "PostgreSQL is not installed (no initdb/pg_ctl: not in \`pg_config --bindir\`, /usr/lib/postgresql/*/bin or PATH).
  Install it: Debian/Ubuntu: apt-get install postgresql    Fedora: dnf install postgresql-server
              macOS: brew install postgresql@15
  or point LOWERFLOW_PG_BINDIR at the directory holding initdb and pg_ctl."
}

pg_user() {
  if [ -n "${LOWERFLOW_PG_USER:-}" ]; then echo "$LOWERFLOW_PG_USER"
  elif [ "$(id -u)" = 0 ]; then echo postgres
  else id -un
  fi
}

# Run a command as the PostgreSQL OS user (from /, which that user can always enter).
as_pg() {
  if [ "$PG_USER" = "$(id -un)" ]; then
    (cd / && "$@")
  elif [ "$(id -u)" = 0 ]; then
    (cd / && runuser -u "$PG_USER" -- "$@")
  else
    die "LOWERFLOW_PG_USER=$PG_USER: only root can run PostgreSQL as another user"
  fi
}

pg_running() { as_pg "$BINDIR/pg_ctl" status -D "$PGDATA_DIR" >/dev/null 2>&1; }

# psql as the cluster's superuser (peer authentication over the data directory's socket).
pg_admin() {
  as_pg "$BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -h "$PGDATA_DIR" -p "$(running_port)" -U "$PG_USER" "$@"
}

# The port of the running cluster (it may have been started with another LOWERFLOW_PG_PORT).
running_port() {
  local port
  port=$(sed -n 4p "$PGDATA_DIR/postmaster.pid" 2>/dev/null || true)
  echo "${port:-$PG_PORT}"
}

password() {
  local pw=${LOWERFLOW_PG_PASSWORD:-}
  if [ -z "$pw" ] && [ -s "$PASSWORD_FILE" ]; then pw=$(cat "$PASSWORD_FILE"); fi
  if [ -z "$pw" ]; then
    pw=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    (umask 077 && mkdir -p "$LOWERFLOW_HOME" && printf '%s\n' "$pw" >"$PASSWORD_FILE")
  fi
  # It goes into a URL and an SQL literal as is.
  [[ $pw =~ ^[A-Za-z0-9._~-]+$ ]] || die "LOWERFLOW_PG_PASSWORD: use letters, digits and . _ ~ - only"
  echo "$pw"
}

init_cluster() {
  local user=$PG_USER
  if ! id -u "$user" >/dev/null 2>&1; then
    die "PostgreSQL refuses to run as root and there is no user '$user' to run it as: create one, or set LOWERFLOW_PG_USER"
  fi
  if [ -d "$PGDATA_DIR" ] && [ -n "$(ls -A "$PGDATA_DIR")" ]; then
    die "$PGDATA_DIR is not empty and holds no PostgreSQL cluster (no PG_VERSION): move it away or set LOWERFLOW_PGDATA"
  fi
  # A first start that fails leaves no (empty or half-made) data directory behind.
  [ -d "$PGDATA_DIR" ] || trap 'rm -rf -- "$PGDATA_DIR"' EXIT
  mkdir -p "$PGDATA_DIR"
  chmod 700 "$PGDATA_DIR"
  [ "$(id -u)" = 0 ] && chown "$user:" "$PGDATA_DIR"
  if ! as_pg test -w "$PGDATA_DIR" -a -x "$PGDATA_DIR"; then
    die "user '$user' (who runs PostgreSQL) cannot reach $PGDATA_DIR: a parent directory is private (e.g. /root).
  Put the cluster where '$user' can reach it, e.g.: LOWERFLOW_PGDATA=/var/lib/lowerflow/postgres $0 start"
  fi
  say "initializing a PostgreSQL cluster in $PGDATA_DIR (as $user)"
  as_pg "$BINDIR/initdb" -D "$PGDATA_DIR" -U "$user" --auth-local=peer --auth-host=scram-sha-256 \
    --encoding=UTF8 --locale=C >"$LOWERFLOW_HOME/initdb.log" 2>&1 \
    || { cat "$LOWERFLOW_HOME/initdb.log" >&2; die "initdb failed (log above)"; }
  as_pg sh -c "echo \"include_if_exists = 'lowerflow.conf'\" >>'$PGDATA_DIR/postgresql.conf'"
  trap - EXIT
}

start_db() {
  BINDIR=$(find_bindir)
  PG_USER=$(pg_user)
  mkdir -p "$LOWERFLOW_HOME"
  if [ ! -s "$PGDATA_DIR/PG_VERSION" ]; then
    init_cluster
  fi
  if pg_running; then
    say "PostgreSQL already running in $PGDATA_DIR on 127.0.0.1:$(running_port)"
  else
    local socket="$PGDATA_DIR/.s.PGSQL.$PG_PORT"
    [ ${#socket} -lt 100 ] || die "LOWERFLOW_PGDATA path too long for PostgreSQL's Unix socket ($socket): choose a shorter one"
    # Loopback only; rewritten at every start so LOWERFLOW_PG_PORT applies.
    as_pg sh -c "cat >'$PGDATA_DIR/lowerflow.conf'" <<EOF
# Written by deployments/server.sh at every start.
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$PGDATA_DIR'
unix_socket_permissions = 0700
max_connections = 200
EOF
    say "starting PostgreSQL ($BINDIR) in $PGDATA_DIR on 127.0.0.1:$PG_PORT"
    as_pg "$BINDIR/pg_ctl" start -D "$PGDATA_DIR" -l "$PGDATA_DIR/server.log" -w -t 60 >/dev/null \
      || { tail -n 20 "$PGDATA_DIR/server.log" >&2 || true; die "PostgreSQL did not start (the log's end is above)"; }
  fi
  local pw
  pw=$(password)
  # Idempotent: the role (its password set every time, so a new LOWERFLOW_PG_PASSWORD
  # applies) and the database.  Through stdin: the password is on no command line.
  pg_admin -d postgres >/dev/null <<SQL
SELECT 'CREATE ROLE $PG_ROLE LOGIN' WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$PG_ROLE') \gexec
ALTER ROLE $PG_ROLE WITH LOGIN PASSWORD '$pw';
SELECT 'CREATE DATABASE $PG_DATABASE OWNER $PG_ROLE' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = '$PG_DATABASE') \gexec
SQL
  DATABASE_URL="postgresql+asyncpg://$PG_ROLE:$pw@127.0.0.1:$(running_port)/$PG_DATABASE"
  remember
}

# The settings of this start, for the commands after it (see the header).
remember() {
  local api
  api=$(api_url)
  (umask 077 && printf '%s\n' "LOWERFLOW_PGDATA=$PGDATA_DIR" "LOWERFLOW_PG_PORT=$(running_port)" \
    "LOWERFLOW_PG_USER=$PG_USER" "HOST=$HOST" "PORT=$PORT" "LOWERFLOW_API_URL=$api" >"$STATE_FILE.tmp") \
    && mv -f "$STATE_FILE.tmp" "$STATE_FILE"
  LOWERFLOW_API_URL=$api
}

stop_db() {
  BINDIR=$(find_bindir)
  PG_USER=$(pg_user)
  if [ -s "$PGDATA_DIR/PG_VERSION" ] && pg_running; then
    say "stopping PostgreSQL ($PGDATA_DIR)"
    as_pg "$BINDIR/pg_ctl" stop -D "$PGDATA_DIR" -m fast -w -t 60 >/dev/null
  else
    say "PostgreSQL is not running ($PGDATA_DIR)"
  fi
}

# ----------------------------------------------------------------------------- Prefect

prefect_cmd() {
  if [ -n "${PREFECT:-}" ]; then echo "$PREFECT"
  elif command -v prefect >/dev/null 2>&1; then command -v prefect
  elif [ -x "$REPO/.venv/bin/prefect" ]; then echo "$REPO/.venv/bin/prefect"
  else die "prefect is not installed: activate lowerflow's venv (./run sets up .venv) or pip install -e ."
  fi
}

# A process that runs (an exited one whose parent has not reaped it yet, a zombie, does not).
alive() {
  kill -0 "$1" 2>/dev/null && [[ $(ps -o stat= -p "$1" 2>/dev/null || echo R) != Z* ]]
}

server_pid() {
  local pid
  pid=$(cat "$SERVER_PIDFILE" 2>/dev/null || true)
  if [ -n "$pid" ] && alive "$pid"; then echo "$pid"; fi
}

api_url() {
  local host=$HOST
  # A started server's URL is the one `start` printed (HOST=0.0.0.0 resolves to a name).
  if [ -n "${LOWERFLOW_API_URL:-}" ] && [ "${1:-}" = remembered ]; then echo "$LOWERFLOW_API_URL"; return; fi
  case "$host" in 0.0.0.0|::|'') host=$(hostname -f 2>/dev/null || hostname) ;; esac
  [[ $host == *:* ]] && host="[$host]"
  echo "http://$host:$PORT/api"
}

lowerflow_cmd() {
  local beside
  beside="$(dirname "$1")/lowerflow"
  if [ -n "${LOWERFLOW:-}" ]; then echo "$LOWERFLOW"
  elif [ -x "$beside" ]; then echo "$beside"
  elif command -v lowerflow >/dev/null 2>&1; then command -v lowerflow
  fi
}

# Does the API on this host answer HTTP yet?  (bash's /dev/tcp: no curl needed)
api_answers() {
  local line
  { exec 3<>"/dev/tcp/$1/$PORT"; } 2>/dev/null || return 1
  printf 'GET /api/health HTTP/1.0\r\nHost: %s\r\n\r\n' "$1" >&3
  IFS= read -r -t 5 line <&3 || line=
  exec 3<&- 3>&-
  [[ $line == HTTP/* ]]
}

# In the background of `start` (its process group, so it ends with the server): once the
# server answers, `lowerflow automations install` (idempotent: it replaces its own
# automations) with LOWERFLOW_ZOMBIE_WINDOW and LOWERFLOW_NOTIFY_URL / _BLOCK.
install_automations() {
  local server=$1 lowerflow=$2 host=$HOST args=(automations install) i
  case "$host" in 0.0.0.0|'') host=127.0.0.1 ;; ::) host=::1 ;; esac
  [ -z "${LOWERFLOW_ZOMBIE_WINDOW:-}" ] || args+=(--zombie-window "$LOWERFLOW_ZOMBIE_WINDOW")
  [ -z "${LOWERFLOW_FLEET_WINDOW:-}" ] || args+=(--fleet-window "$LOWERFLOW_FLEET_WINDOW")
  [ -z "${LOWERFLOW_NOTIFY_URL:-}" ] || args+=(--notify-url "$LOWERFLOW_NOTIFY_URL")
  [ -z "${LOWERFLOW_NOTIFY_BLOCK:-}" ] || args+=(--notify-block "$LOWERFLOW_NOTIFY_BLOCK")
  for i in $(seq 1 720); do   # up to 6 min: a first start migrates the database
    alive "$server" || return 0
    if api_answers "$host"; then
      local url="http://$host:$PORT/api" out
      [[ $host == *:* ]] && url="http://[$host]:$PORT/api"
      if out=$(cd "$REPO" && PREFECT_API_URL=$url \
               PREFECT_API_AUTH_STRING=${PREFECT_SERVER_API_AUTH_STRING:-${PREFECT_API_AUTH_STRING:-}} \
               "$lowerflow" "${args[@]}" 2>&1); then
        say "${out//$'\n'/; }"
      else
        say "warning: \`lowerflow ${args[*]}\` failed: ${out//$'\n'/; }"
      fi
      return 0
    fi
    sleep 0.5
  done
  say "warning: the Prefect API did not answer in 6 min: automations not installed (\`lowerflow automations install\`)"
}

cmd_start() {
  local prefect pid
  prefect=$(prefect_cmd)
  pid=$(server_pid)
  [ -z "$pid" ] || die "a Prefect server started by this script is already running (pid $pid); \`$0 stop\` first"
  start_db
  export PREFECT_API_DATABASE_CONNECTION_URL=$DATABASE_URL
  export PREFECT_SERVER_ANALYTICS_ENABLED=false
  # Task runs are recorded from their state events, by default one event per database
  # transaction (~30 a model run).  In batches, flushed at least every second, the server
  # and PostgreSQL use ~20% less CPU on a fleet (issue 9); a task run shows in the UI up
  # to a second later.  Set either variable to keep your own value.
  export PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE=${PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE:-200}
  export PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL=${PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL:-1}
  say "Prefect server on $HOST:$PORT, database postgresql://$PG_ROLE@127.0.0.1:$(running_port)/$PG_DATABASE"
  echo "export PREFECT_API_URL=$LOWERFLOW_API_URL"
  echo $$ >"$SERVER_PIDFILE"   # exec keeps the pid
  if [ "${LOWERFLOW_AUTOMATIONS:-1}" != 0 ]; then
    local lowerflow
    lowerflow=$(lowerflow_cmd "$prefect")
    if [ -n "$lowerflow" ]; then
      install_automations $$ "$lowerflow" </dev/null &
    else
      say "warning: no lowerflow command (set LOWERFLOW): run \`lowerflow automations install\` yourself"
    fi
  fi
  exec "$prefect" server start --host "$HOST" --port "$PORT" "$@"
}

cmd_stop() {
  local pid i
  pid=$(server_pid)
  if [ -n "$pid" ]; then
    say "stopping the Prefect server (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 300); do alive "$pid" || break; sleep 0.1; done
    if alive "$pid"; then
      say "the Prefect server did not stop in 30 s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  else
    say "no Prefect server started by this script is running"
  fi
  rm -f "$SERVER_PIDFILE"
  stop_db
}

cmd_status() {
  local ok=0 pid
  BINDIR=$(find_bindir)
  PG_USER=$(pg_user)
  if [ -s "$PGDATA_DIR/PG_VERSION" ] && pg_running; then
    echo "postgres: running in $PGDATA_DIR on 127.0.0.1:$(running_port)"
  else
    echo "postgres: not running ($PGDATA_DIR)"; ok=1
  fi
  pid=$(server_pid)
  if [ -n "$pid" ]; then
    echo "prefect:  running (pid $pid), PREFECT_API_URL=$(api_url remembered)"
  else
    echo "prefect:  not running"; ok=1
  fi
  return $ok
}

cmd_db() {
  start_db
  echo "PREFECT_API_DATABASE_CONNECTION_URL=$DATABASE_URL"
}

cmd_psql() {
  BINDIR=$(find_bindir)
  PG_USER=$(pg_user)
  pg_running || die "PostgreSQL is not running ($PGDATA_DIR): \`$0 db\` or \`$0 start\`"
  pg_admin -d "$PG_DATABASE" "$@"
}

usage() {
  sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

case "${1:-}" in
  start) shift; cmd_start "$@" ;;
  stop) shift; cmd_stop ;;
  status) shift; cmd_status ;;
  db) shift; cmd_db ;;
  psql) shift; cmd_psql "$@" ;;
  -h|--help|help) usage ;;
  *) usage ;;
esac
