"""The GPU check scripts' handling of PYTEST_ARGS (CPU only: bash and Python, no GPU)."""
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
