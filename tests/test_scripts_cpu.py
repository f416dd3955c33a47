"""The GPU check scripts' handling of PYTEST_ARGS, and the row-wise bench script's SETS (CPU
only: bash and Python, no GPU)."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("gpu_check*.sh"))
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def split(value):
    """PARGS as scripts/pytest_args.sh sets it from PYTEST_ARGS=value: (exit code, words)."""
    env = dict(os.environ, PY=sys.executable)
    env.pop("PYTEST_ARGS", None)
    if value is not None:
        env["PYTEST_ARGS"] = value
    r = subprocess.run(["bash", "-c", '. scripts/pytest_args.sh; printf "%s\\n" "${PARGS[@]}"'],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    return r.returncode, [w for w in r.stdout.split("\n") if w]


@pytest.mark.parametrize("value, words", [
    ("-m 'not slow' --ignore=/a/b c.py", ["-m", "not slow", "--ignore=/a/b", "c.py"]),
    ('-k "norms and not large" -x', ["-k", "norms and not large", "-x"]),
    ("-q", ["-q"]),
    ("", []),
    ("   ", []),
    (None, []),
])
def test_quoted_arguments_stay_one_word(value, words):
    assert split(value) == (0, words)


def test_unbalanced_quotes_exit_2():
    assert split("-m 'not slow")[0] == 2


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_gpu_check_passes_the_split_arguments(script):
    text = script.read_text()
    assert ". scripts/pytest_args.sh" in text
    assert '"${PARGS[@]}"' in text
    assert "${PYTEST_ARGS" not in text  # unquoted: "'not" and "slow'" would be two words


def bench_rowwise(tmp_path, sets):
    """scripts/bench_rowwise.sh with SETS=sets and a stand-in bench command that records its
    arguments: (exit code, stderr, the recorded runs' --json file names)."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "fake_bench.sh"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> "{log}"\n')
    fake.chmod(0o755)
    env = dict(os.environ, BENCH=str(fake))
    env.pop("SETS", None)
    if sets is not None:
        env["SETS"] = sets
    r = subprocess.run(["bash", "scripts/bench_rowwise.sh", str(tmp_path / "out")], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    runs = [line.split("--json ")[1].rsplit("/", 1)[-1] for line in
            (log.read_text().splitlines() if log.exists() else [])]
    return r.returncode, r.stderr, runs


def test_bench_rowwise_runs_every_set_by_default(tmp_path):
    rc, _, runs = bench_rowwise(tmp_path, None)
    assert rc == 0
    assert runs == ["rowwise_bf16.json", "rowwise_fp32.json", "rowwise_bwd.json",
                    "rowwise_small.json", "rowwise_ce.json"]


def test_bench_rowwise_sets_pick_the_runs(tmp_path):
    rc, _, runs = bench_rowwise(tmp_path, "ce small")
    assert rc == 0
    assert runs == ["rowwise_small.json", "rowwise_ce.json"]  # in the script's order
    cmds = (tmp_path / "out" / "commands.txt").read_text().splitlines()
    assert len(cmds) == 2 and cmds[0].endswith("--json rowwise_small.json")


def test_bench_rowwise_unknown_set_exits_2_before_running(tmp_path):
    rc, err, runs = bench_rowwise(tmp_path, "bf16 fp16")
    assert rc == 2 and "unknown set 'fp16'" in err and runs == []
