# Sourced by ./dev and dev-extras/swift-venv.sh: `install VENV ARGS...` installs into VENV with
# uv (`uv pip install ARGS`), which ./dev's venvs get from PyPI first (`pip install uv`).
#
# uv, not pip: it installs in parallel and links files from its cache. A fresh .venv (torch's
# CUDA build, ~7 GB) took pip ~63 s here and takes uv ~17 s (uv's cache empty, wheels on this
# machine's disk), and the ms-swift venv that CI builds beside the fast tier no longer takes a
# core from it for a minute. Same pins, same packages (`uv pip freeze` against `pip freeze`).
#
# uv does not read pip's configuration: what this machine tells pip (local wheel folders, extra
# indexes, a CA bundle) is passed on, and every index is trusted alike, as pip trusts them
# (uv's default takes a package only from the first index that has it: a local index holding
# an older filelock than torch pins would then fail).

_pip_setting() {  # pip's setting $1 (find-links, ...): the environment's PIP_*, else pip config
  local env_name="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  if [ -n "${!env_name:-}" ]; then echo "${!env_name}"; return; fi
  "${PY:-python3}" -m pip config get "global.$1" 2>/dev/null || true
}

uv_env() {
  local links extra index cert
  links=$(_pip_setting find-links | tr -s ' \n' ',' | sed 's/^,//; s/,$//')
  extra=$(_pip_setting extra-index-url | tr -s '\n' ' ')
  index=$(_pip_setting index-url)
  cert=$(_pip_setting cert)
  export UV_INDEX_STRATEGY=unsafe-best-match UV_NO_PROGRESS=1
  if [ -n "$links" ]; then export UV_FIND_LINKS="$links"; fi
  if [ -n "${extra// /}" ]; then export UV_EXTRA_INDEX_URL="$extra"; fi
  if [ -n "$index" ]; then export UV_INDEX_URL="$index"; fi
  if [ -n "$cert" ] && [ -z "${SSL_CERT_FILE:-}" ]; then export SSL_CERT_FILE="$cert"; fi
}

install() {
  local venv=$1
  shift
  if [ ! -x "$venv/bin/uv" ]; then
    "$venv/bin/pip" install -q --disable-pip-version-check -c .ci/constraints.txt uv
  fi
  (uv_env && "$venv/bin/uv" pip install -q --python "$venv/bin/python" "$@")
}
