# Sourced by scripts/*: create .venv (or $DBQUEUE_VENV) and install the project with the given extras;
# install the system packages the Spark pipeline needs (a Java runtime, PostgreSQL's JDBC driver) and
# the ODBC driver manager the SQL Server dialect loads Microsoft's driver through (unixODBC), and the
# headless browser the Queues page is tested in (Chromium), valgrind, under which
# benchmarks/instructions.py counts the server's instructions, and PgBouncer, the pooler the tests and
# benchmarks/run.py --pooler put in front of the server.
VENV="${DBQUEUE_VENV:-$PWD/.venv}"
ensure_venv() {
  local extras="$1" stamp
  stamp="$VENV/.dbqueue-installed-$(echo "$extras" | tr ',' '-')-$(cat pyproject.toml | sha1sum | cut -c1-12)"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    python3 -m venv "$VENV"
  fi
  if [ ! -e "$stamp" ]; then
    echo "== installing airflow-dbqueue[$extras] into $VENV (first run takes a few minutes)"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".[$extras]"
    touch "$stamp"
  fi
}
ensure_spark_system() {
  # Spark needs Java 17+; the jobs read the queue database through PostgreSQL's JDBC driver.
  local want=()
  command -v java >/dev/null 2>&1 || want+=(openjdk-17-jre-headless)
  [ -n "${DBQUEUE_JDBC_JAR:-}" ] || [ -f /usr/share/java/postgresql.jar ] || want+=(libpostgresql-jdbc-java)
  [ ${#want[@]} -eq 0 ] && return 0
  echo "== installing ${want[*]} (apt)"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get install -y -q "${want[@]}" >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q "${want[@]}" >/dev/null; }
}
ensure_odbc_system() {
  # pyodbc links against unixODBC's libodbc; the mssql extra's wheel ships ODBC Driver 18 itself.
  ldconfig -p 2>/dev/null | grep -q 'libodbc.so.2 ' && return 0
  echo "== installing unixodbc (apt)"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get install -y -q unixodbc >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q unixodbc >/dev/null; }
}
ensure_valgrind_system() {
  # benchmarks/instructions.py (and its smoke test) count a server's instructions under cachegrind.
  command -v valgrind >/dev/null 2>&1 && return 0
  echo "== installing valgrind (apt)"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get install -y -q valgrind >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q valgrind >/dev/null; }
}
ensure_browser_system() {
  # The Queues page's test drives Debian's Chromium headless (tests/browser.py).
  command -v chromium >/dev/null 2>&1 && return 0
  echo "== installing chromium (apt)"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get install -y -q chromium >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q chromium >/dev/null; }
}
ensure_pgbouncer_system() {
  # The suites that run through a connection pooler start Debian's PgBouncer (tests/pgbouncer.py).
  command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] && return 0
  echo "== installing pgbouncer (apt)"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get install -y -q pgbouncer >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q pgbouncer >/dev/null; }
}
