"""The persistent kernel cache on shared machines: a cubin is code this process runs, so the
cache is used only when nobody else can write it (NVRTC needs no GPU)."""
import os
import stat
import warnings

import pytest

from cupylab import _compile

SRC = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }\n'


def _prog():
    return _compile.Program(SRC, "k.cu", ["k"])


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(_compile, "_warned", set())


def _counts():
    return dict(_compile.stats)


def test_cache_dir_is_created_private(cache):
    assert not cache.exists()
    _compile.compile_program(_prog(), 90)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    entries = list(cache.glob("*.clbin"))
    assert len(entries) == 1
    assert stat.S_IMODE(entries[0].stat().st_mode) & 0o022 == 0


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_directory_others_can_write_is_neither_read_nor_written(cache, mode):
    _compile.compile_program(_prog(), 90)  # a good entry first
    os.chmod(cache, mode)
    before = _counts()
    with pytest.warns(RuntimeWarning, match="not using the kernel cache directory"):
        _compile.compile_program(_prog(), 90)
    assert _compile.stats["compiled"] == before["compiled"] + 1  # compiled, not loaded
    assert _compile.stats["disk_hits"] == before["disk_hits"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per path, not on every compile
        _compile.compile_program(_prog(), 90)
    os.chmod(cache, 0o700)


def test_entry_others_can_write_is_not_loaded(cache):
    _compile.compile_program(_prog(), 90)
    (entry,) = cache.glob("*.clbin")
    os.chmod(entry, 0o666)
    before = _counts()
    with pytest.warns(RuntimeWarning, match="not using the kernel cache entry"):
        _compile.compile_program(_prog(), 90)
    assert _compile.stats["compiled"] == before["compiled"] + 1


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="needs root to give a file to another user")
def test_entry_written_by_another_user_is_never_loaded(cache):
    _compile.compile_program(_prog(), 90)
    (entry,) = cache.glob("*.clbin")
    os.chown(entry, 12345, 12345)  # same bytes, checksum fine, but someone else's file
    before = _counts()
    with pytest.warns(RuntimeWarning, match="owned by uid 12345"):
        _compile.compile_program(_prog(), 90)
    assert _compile.stats["disk_hits"] == before["disk_hits"]
    assert _compile.stats["compiled"] == before["compiled"] + 1
    os.chown(cache, 12345, 12345)
    with pytest.warns(RuntimeWarning, match="kernel cache directory"):
        _compile.compile_program(_prog(), 90)


def test_a_symlink_to_someone_elses_directory_is_judged_by_its_target(cache, tmp_path):
    target = tmp_path / "shared"
    target.mkdir(mode=0o777)
    os.chmod(target, 0o777)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.symlink_to(target)
    with pytest.warns(RuntimeWarning, match="kernel cache directory"):
        _compile.compile_program(_prog(), 90)
    assert not list(target.glob("*.clbin"))  # nothing written there either


@pytest.mark.skipif(os.name != "posix", reason="POSIX descriptors")
def test_an_entry_is_a_regular_file_in_the_checked_directory(cache, tmp_path):
    """An entry is opened relative to the directory that was checked, without following a
    symlink and without blocking: a FIFO in an entry's place hung the compile; a symlink
    could be repointed between the check and the read."""
    _compile.compile_program(_prog(), 90)
    (entry,) = cache.glob("*.clbin")
    good = tmp_path / "good.clbin"
    entry.rename(good)
    entry.symlink_to(good)  # a valid entry, behind a symlink
    before = _counts()
    _compile.compile_program(_prog(), 90)
    assert _compile.stats["disk_hits"] == before["disk_hits"]
    entry.unlink()
    os.mkfifo(entry)  # nobody will ever write to it
    done = []
    t = __import__("threading").Thread(
        target=lambda: done.append(_compile.load_entry(entry.name[:-len(".clbin")])),
        daemon=True)
    t.start()
    t.join(10)
    assert done == [None]
    entry.unlink()
    _compile.compile_program(_prog(), 90)  # stored again, as a regular file
    assert entry.is_file() and not entry.is_symlink()
    assert not list(cache.glob(".*.tmp"))


def test_precompile_says_when_nothing_could_be_stored(cache, monkeypatch, capsys):
    """A full disk, quota or read-only cache: precompile printed "N compiled ... into DIR"
    and exited 0 with the directory empty."""
    from cupylab import __main__ as cli

    monkeypatch.setitem(cli._FAMILIES, "tiny", lambda: [_prog()])
    args = ["precompile", "--arch", "90", "--families", "tiny", "--jobs", "1"]
    assert cli.main(args) == 0
    assert "1 compiled" in capsys.readouterr().out
    for e in cache.glob("*.clbin"):
        e.unlink()
    monkeypatch.setattr(_compile, "store_entry", lambda *a: False)
    assert cli.main(args) == 1
    assert "1 of the 1 compiled could not be stored" in capsys.readouterr().err
