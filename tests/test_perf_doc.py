"""The tables of docs/perf.md and docs/tuning.md are generated from the stored results in
docs/perf/ by scripts/make_perf_md.py: the pages must match them (CPU only, no GPU)."""
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
    """A copy of the two pages in tmp_path; perf.md's path."""
    for name in ("perf.md", "tuning.md"):
        shutil.copy(REPO / "docs" / name, tmp_path / name)
    return tmp_path / "perf.md"


def _args(copy, data=REPO / "docs" / "perf"):
    return ["--docs", str(copy.parent), "--data", str(data)]


def test_check_finds_an_edited_table_and_rewrite_restores_it(gen, copy, capsys):
    data = REPO / "docs" / "perf"
    text = copy.read_text(encoding="utf-8")
    start = text.index("<!-- table:fusion -->")
    row = text.index("| fused_add_mul |", start)
    edited = text[:row] + text[row:].replace("1.56", "1.66", 1)
    assert edited != text
    copy.write_text(edited, encoding="utf-8")
    assert gen.main(["--check", *_args(copy, data)]) == 1
    assert "fusion" in capsys.readouterr().err
    assert gen.main(_args(copy, data)) == 0
    assert copy.read_text(encoding="utf-8") == text  # the prose untouched, the table restored
    assert gen.main(["--check", *_args(copy, data)]) == 0


def test_prose_outside_the_markers_is_left_alone(gen, copy):
    data = REPO / "docs" / "perf"
    text = copy.read_text(encoding="utf-8")
    copy.write_text(text.replace("## Method", "## Method (edited)"), encoding="utf-8")
    assert gen.main(["--check", *_args(copy, data)]) == 0


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("<!-- table:graphs -->\n", "", 1), "no marker for table(s) graphs"),
    (lambda t: t + "\n<!-- table:nosuch -->\n<!-- /table -->\n", "unknown table 'nosuch'"),
    (lambda t: t + "\n<!-- table:host -->\n", "table 'host' appears twice"),
    (lambda t: t + "\n<!-- table:rowwise-groups-ab -->\n<!-- /table -->\n",
     "table 'rowwise-groups-ab' appears twice (")  # once on each page
])
def test_marker_problems_exit_2(gen, copy, capsys, edit, message):
    copy.write_text(edit(copy.read_text(encoding="utf-8")), encoding="utf-8")
    assert gen.main(["--check", *_args(copy)]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_result_file_exits_2(gen, copy, tmp_path, capsys):
    data = tmp_path / "perf"
    shutil.copytree(REPO / "docs" / "perf", data)
    (data / "fusion.json").unlink()
    assert gen.main(["--check", *_args(copy, data)]) == 2
    assert "fusion.json" in capsys.readouterr().err


def test_the_tuning_records_have_their_tables_and_the_pages_link(gen, copy):
    """The A/B tables stand on docs/tuning.md, which perf.md links."""
    tuning = (copy.parent / "tuning.md").read_text(encoding="utf-8")
    perf = copy.read_text(encoding="utf-8")
    ab = [n for n in gen.TABLES if n.endswith("-ab")]
    assert ab and all(f"<!-- table:{n} -->" in tuning for n in ab)
    assert not any(f"<!-- table:{n} -->" in perf for n in ab)
    assert "(tuning.md)" in perf and "(perf.md)" in tuning
