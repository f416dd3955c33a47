"""docs/perf.md's tables are generated from the stored results in docs/perf/ by
scripts/make_perf_md.py: the page must match them (CPU only, no GPU)."""
import importlib.util
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "make_perf_md.py"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("make_perf_md", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_perf_md_matches_the_stored_results(gen, capsys):
    rc = gen.main(["--check"])
    assert rc == 0, capsys.readouterr().err


def test_every_referenced_result_file_is_stored(gen):
    data = REPO / "docs" / "perf"
    stored = {p.name for p in data.iterdir()}
    assert set(gen.FILES) <= stored
    assert "sweep.png" in stored and gen.COMMANDS in stored


@pytest.fixture
def copy(tmp_path):
    doc = tmp_path / "perf.md"
    shutil.copy(REPO / "docs" / "perf.md", doc)
    return doc


def test_check_finds_an_edited_table_and_rewrite_restores_it(gen, copy, capsys):
    data = REPO / "docs" / "perf"
    text = copy.read_text(encoding="utf-8")
    start = text.index("<!-- table:fusion -->")
    row = text.index("| fused_add_mul |", start)
    edited = text[:row] + text[row:].replace("1.56", "1.66", 1)
    assert edited != text
    copy.write_text(edited, encoding="utf-8")
    assert gen.main(["--check", "--doc", str(copy), "--data", str(data)]) == 1
    assert "fusion" in capsys.readouterr().err
    assert gen.main(["--doc", str(copy), "--data", str(data)]) == 0
    assert copy.read_text(encoding="utf-8") == text  # the prose untouched, the table restored
    assert gen.main(["--check", "--doc", str(copy), "--data", str(data)]) == 0


def test_prose_outside_the_markers_is_left_alone(gen, copy):
    data = REPO / "docs" / "perf"
    text = copy.read_text(encoding="utf-8")
    copy.write_text(text.replace("## Method", "## Method (edited)"), encoding="utf-8")
    assert gen.main(["--check", "--doc", str(copy), "--data", str(data)]) == 0


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("<!-- table:graphs -->\n", "", 1), "no marker for table(s) graphs"),
    (lambda t: t + "\n<!-- table:nosuch -->\n<!-- /table -->\n", "unknown table 'nosuch'"),
    (lambda t: t + "\n<!-- table:host -->\n", "table 'host' appears twice"),
])
def test_marker_problems_exit_2(gen, copy, capsys, edit, message):
    copy.write_text(edit(copy.read_text(encoding="utf-8")), encoding="utf-8")
    assert gen.main(["--check", "--doc", str(copy), "--data", str(REPO / "docs" / "perf")]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_result_file_exits_2(gen, copy, tmp_path, capsys):
    data = tmp_path / "perf"
    shutil.copytree(REPO / "docs" / "perf", data)
    (data / "fusion.json").unlink()
    assert gen.main(["--check", "--doc", str(copy), "--data", str(data)]) == 2
    assert "fusion.json" in capsys.readouterr().err
