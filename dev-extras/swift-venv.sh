#!/usr/bin/env bash
# The ms-swift venv (.venv-swift): ms-swift 4.6 installs transformers 5.x and pins trl<1.0,
# which the main venv's trl>=1.16 refuses, so it lives apart. tokenmill goes in with --no-deps
# plus what trainer/feed.py needs (ray, pyarrow, numpy), pinned as CI pins the main venv.
# torchtitan 0.3.0 (trainer/titan.py) joins it --no-deps: its metadata pins datasets<4.8 (for
# its own HF loaders, which import with 4.8.4), and a third venv would cost CI another torch;
# its models, flex attention, loaders and Trainer import with the five small packages below.
# Idempotent: a stamp of the pins skips a venv that is already up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
# nothing byte-compiled at install, and a .pyc kept at first import instead: the reasons are in
# ../dev
unset PYTHONDONTWRITEBYTECODE
PY=${PYTHON:-python3}
VENV=${SWIFT_VENV:-.venv-swift}
stamp="$VENV/.tokenmill-installed"
want=$(cat .ci/constraints-swift.txt dev-extras/swift-venv.sh pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo '*' > "$VENV/.gitignore"   # never committed (python3.13's venv writes this itself)
source dev-extras/install.sh  # `install VENV ARGS...`: uv, with this machine's pip settings
install "$VENV" -c .ci/constraints-swift.txt torch torchvision ms-swift ray pyarrow numpy
install "$VENV" --no-deps -c .ci/constraints-swift.txt torchtitan torchdata tyro \
    docstring-parser typeguard spmd_types
install "$VENV" --no-deps -e .
echo "$want" > "$stamp"
