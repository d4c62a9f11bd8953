# Sourced by scripts/*: create .venv (or $DBQUEUE_VENV) and install the project with the given extras.
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
