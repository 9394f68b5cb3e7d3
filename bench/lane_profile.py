"""Where one lane's CPU goes: a lane alone (`lanes: 1`, run in this process as lane-rates runs
it) making steps from one kind of input, sampled by py-spy or counted by callgrind.

    python -m bench lane-profile [--input text|tokens|chat] [--packing concat|bfd]
        [--steps 300] [--tool py-spy|callgrind|none] [--json PATH]

Inputs, from the demo corpus: `text` its code.jsonl (one text stream read `repeat` 1000);
`tokens` the same texts exported and read back pre-tokenized (`format: export`); `chat` code
0.7 and its chat.jsonl 0.3 (two streams, one of conversations). L 2048, G 32.

`--tool py-spy` (default): the lane's process is sampled (py-spy, 200 Hz, Python frames)
over its steps, after the warm-up (imports, the tokenizer loaded, the first read); each
sample goes to the first of CATEGORIES that a frame of its stack falls in, innermost frame
first. `--tool callgrind`: the same steps under valgrind's callgrind, its instructions
counted only over the steps (`--instr-atstart=no`, switched on after the warm-up), summed by
the shared object they ran in (the tokenizer's native code, the Python interpreter, Arrow,
numpy, the C library...). Instruction counts do not vary with a busy machine, samples do. Under
callgrind a step takes ~50x longer: 60 steps are enough there.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQ_LEN, BATCH = 2048, 32

# (category, a regular expression over "file:function" of a Python frame). Innermost first
# wins: a frame of the HF check under the encoder counts as the check.
CATEGORIES = [
    (
        "the HF check (a sample encoded again by the HF tokenizer)",
        r"verify_sample|hf_ids|proofs\.py",
    ),
    ("tokenizing (fastokens' encode)", r"encode_flat|FastokensEncoder|fastokens"),
    ("chat (templates, assistant masks)", r"tokenize/chat\.py"),
    ("decoding JSON records (json.loads)", r"\(.*json/(decoder|__init__)\.py"),
    ("finding lines and reading files", r"jsonl\.py|sources\.py|text\.py"),
    ("reading pre-tokenized step files", r"read/export|formats/export|parquet"),
    (
        "per-document arrays (EOS, offsets)",
        r"_with_specials|_encode_pretrain|encode_records|_encode_isolating",
    ),
    ("assembling steps into chunks (wire/schema.py)", r"wire/schema\.py|kept_chunk"),
    ("a rank's rows as Arrow IPC (take)", r"to_ipc|wire/arrays\.py|pyarrow/ipc"),
    ("packing", r"packing\.py"),
    ("mixing", r"mixing\.py"),
    ("states", r"/state/|state_dict"),
    ("reading units, epochs, documents", r"/read/|documents\.py|chain\.py"),
    ("Arrow (tables, columns)", r"pyarrow"),
    ("other tokenmill Python", r"/(pipeline|wire|service)/"),
]


def lane_config(kind: str, packing: str, work: Path) -> dict:
    """The config of the profiled lane, building what its input needs in `work`."""
    from pipeline.read.resolve import parse_config
    from service.demo_corpus import build_demo_corpus

    corpus = build_demo_corpus()
    base = {"seq_len": SEQ_LEN, "global_batch_size": BATCH, "packing": {"mode": packing}}
    code = {"paths": [str(corpus / "code.jsonl")], "repeat": 1000}
    if kind == "text":
        return base | {"streams": {"code": code}}
    if kind == "chat":
        chat = {"kind": "chat", "paths": [str(corpus / "chat.jsonl")], "weight": 0.3,
                "repeat": 1000}  # fmt: skip
        return base | {"streams": {"code": code | {"weight": 0.7}, "chat": chat}}
    from pipeline.read.reading import iter_blocks_local
    from service.export import run_export

    once = base | {"streams": {"code": code | {"repeat": 4}}}
    run_export(parse_config(once), work / "export", executor=iter_blocks_local)
    tokens = {"paths": [str(work / "export")], "format": "export", "repeat": 1000}
    return base | {"streams": {"code": tokens}}


def run_lane(cfg_json: dict, steps: int, on_timed) -> dict:
    """One lane (`lanes: 1`) makes `steps` steps after a warm call; `on_timed()` is called
    between the two. Its tokens/s over the steps."""
    from pipeline.lanes import LaneWorker

    lane = LaneWorker(cfg_json, 0, None, False, False, True, False, hold=True)
    per_call = 32
    made, _ = lane.steps(per_call, 0)  # warm: the tokenizer loaded, the first read begun
    lane.take([(made.first + j, 0, int(r)) for j, r in enumerate(made.rows)], 0, 1)
    on_timed()
    n, t = per_call, time.perf_counter()
    while n < per_call + steps:
        made, _ = lane.steps(per_call, 1, n)
        if not len(made):
            break
        lane.take([(made.first + j, 0, int(r)) for j, r in enumerate(made.rows)], 0, 1)
        n += len(made)
    wall = time.perf_counter() - t
    lane.close()
    return {"steps": n - per_call, "seconds": wall,
            "tokens_per_s": (n - per_call) * SEQ_LEN * BATCH / wall}  # fmt: skip


def categorize(stacks: dict[str, int]) -> dict[str, int]:
    """py-spy's raw stacks (`frame;frame;...` outermost first -> samples) by CATEGORIES."""
    patterns = [(name, re.compile(rx)) for name, rx in CATEGORIES]
    out: collections.Counter = collections.Counter()
    for stack, n in stacks.items():
        frames = stack.split(";")[::-1]
        for frame in frames:
            name = next((c for c, rx in patterns if rx.search(frame)), None)
            if name is not None:
                out[name] += n
                break
        else:
            out["other (Python, Ray, the interpreter)"] += n
    return dict(out.most_common())


def callgrind_by_object(path: Path) -> dict[str, int]:
    """Self instructions (Ir) by shared object, from a callgrind output file. A cost line
    after `calls=` is the call's inclusive cost (the callee's, counted where it ran): skipped."""
    names: dict[str, str] = {}
    cost: collections.Counter = collections.Counter()
    ob, skip = "?", False

    def named(value: str) -> str:
        m = re.match(r"\((\d+)\)(?: (.*))?", value)
        if m is None:
            return value
        if m.group(2) is not None:
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), value)

    with open(path) as f:
        for line in f:
            if line.startswith("ob="):
                ob = named(line[3:].strip())
            elif line.startswith(("cob=", "cfn=", "cfi=", "cfl=")):
                if line.startswith("cob="):
                    named(line[4:].strip())  # defines a name later lines may use
            elif line.startswith("calls="):
                skip = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                if skip:
                    skip = False
                    continue
                parts = line.split()
                if len(parts) >= 2:
                    cost[ob] += int(parts[1])
    return dict(cost.most_common())


def object_group(path: str) -> str:
    name = os.path.basename(path)
    if name == "???":  # code in no file: the regular expressions PCRE2 compiled (fastokens' split)
        return "the tokenizer's split, compiled by PCRE2's JIT (fastokens)"
    for group, rx in (("the tokenizer's native code (fastokens)", r"fastokens|_native\.abi3"),
                      ("the HF tokenizer's native code (tokenizers)", r"^tokenizers"),
                      ("the Python interpreter", r"python3|libpython"),
                      ("Arrow", r"arrow|parquet"),
                      ("numpy", r"numpy|_multiarray|openblas"),
                      ("the C library (malloc, memcpy...)", r"^libc\.|^ld-linux|libm\."),
                      ("the JSON decoder (json's C module)", r"_json")):  # fmt: skip
        if re.search(rx, name):
            return group
    return f"other ({name})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench lane-profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--input", choices=["text", "tokens", "chat"], default="text")
    ap.add_argument("--packing", choices=["concat", "bfd"], default="concat")
    ap.add_argument("--steps", type=int, default=None, help="300; 60 under callgrind")
    ap.add_argument("--tool", choices=["py-spy", "callgrind", "none"], default="py-spy")
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)  # the inner run's
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    steps = args.steps or (60 if args.tool == "callgrind" else 300)
    if args.config:  # the profiled process itself
        cfg = json.loads(Path(args.config).read_text())

        def timed():
            if os.environ.get("TOKENMILL_CALLGRIND"):
                subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())],
                               check=True, capture_output=True)  # fmt: skip
            print("timed", flush=True)

        print(json.dumps(run_lane(cfg, steps, timed)), flush=True)
        return 0

    from pipeline.config import REVEAL_SECRETS
    from pipeline.read.resolve import parse_config

    work = Path(tempfile.mkdtemp(prefix="bench-lane-profile-"))
    try:
        spec = lane_config(args.input, args.packing, work)
        cfg_path = work / "lane.json"
        cfg_path.write_text(json.dumps(parse_config(spec).model_dump(mode="json",
                                                                     context=REVEAL_SECRETS)))  # fmt: skip
        inner = [sys.executable, "-m", "bench.lane_profile", "--config", str(cfg_path),
                 "--steps", str(steps)]  # fmt: skip
        result = profile(args.tool, inner, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    what = f"{args.input}, {args.packing}, {result['lane']['steps']} steps"
    print(f"one lane ({what}): {result['lane']['tokens_per_s'] / 1e6:.2f}M tokens/s"
          + (" (under callgrind)" if args.tool == "callgrind" else ""))  # fmt: skip
    for key, unit in (("samples", "samples"), ("instructions", "instructions")):
        if key in result:
            total = sum(result[key].values())
            print(f"{unit}: {total:,}")
            for name, n in result[key].items():
                print(f"  {100 * n / total:5.1f}%  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps({"input": args.input, "packing": args.packing}
                                              | result, indent=2) + "\n")  # fmt: skip
    return 0


def profile(tool: str, inner: list[str], work: Path) -> dict:
    """Runs `inner` (the lane's process) under `tool`; its rate and what the tool counted."""
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if tool == "callgrind":
        out = work / "callgrind.out"
        inner = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                 f"--callgrind-out-file={out}", *inner]  # fmt: skip
        env |= {"TOKENMILL_CALLGRIND": "1"}
    proc = subprocess.Popen(inner, stdout=subprocess.PIPE, text=True, env=env,
                            stderr=subprocess.DEVNULL if tool == "callgrind" else None)  # fmt: skip
    assert proc.stdout is not None
    spy = None
    for line in proc.stdout:
        if line.strip() == "timed":
            if tool == "py-spy":
                raw = work / "py-spy.txt"
                spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record",
                                        "--pid", str(proc.pid), "--rate", "200", "--format",
                                        "raw", "--output", str(raw), "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            break
    rest = proc.stdout.read()
    if proc.wait() != 0:
        raise SystemExit(f"the lane's process failed (exit {proc.returncode})")
    result: dict = {"lane": json.loads(rest.strip().splitlines()[-1])}
    if spy is not None:
        spy.wait(timeout=60)
        stacks: dict[str, int] = {}
        for line in (work / "py-spy.txt").read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if n.isdigit():  # (a frame's name may hold a line break: its line is not a sample)
                stacks[stack] = stacks.get(stack, 0) + int(n)
        result["samples"] = categorize(stacks)
        result["stacks"] = dict(sorted(stacks.items(), key=lambda kv: -kv[1]))
    if tool == "callgrind":
        groups: collections.Counter = collections.Counter()
        for ob, n in callgrind_by_object(work / "callgrind.out").items():
            groups[object_group(ob)] += n
        result["instructions"] = dict(groups.most_common())
    return result


if __name__ == "__main__":
    raise SystemExit(main())
