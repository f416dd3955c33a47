"""Install truth: CI runs the README's commands verbatim and installs nothing else, and the
extras the README installs bring what a kernel call needs at run time (no GPU needed)."""
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
CI = (REPO / ".ci" / "run").read_text()


def _bash_blocks(text):
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def _commands(block):
    out = []
    for line in block.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _readme_commands():
    section = README[README.index("## Set up and run"):]
    section = section[:section.index("\n## ", 3)]
    blocks = [_commands(b) for b in _bash_blocks(section)]
    install = [c for b in blocks for c in b if c.startswith("pip install")]
    test = [c for b in blocks for c in b if "pytest" in c]
    return install, test


def _ci_commands():
    skip = ("set -", "cd ", "python3 -m venv ", ". ", "source ")
    return [c for c in _commands(CI) if not c.startswith(skip)]


def test_readme_names_one_install_and_one_test_command():
    install, test = _readme_commands()
    assert install == ['pip install -e ".[cuda12,test]"']
    assert test == ["python -m pytest -q -rs"]


def test_ci_runs_exactly_the_readme_commands():
    install, test = _readme_commands()
    assert _ci_commands() == install + test


def test_ci_installs_nothing_the_readme_does_not():
    installs = [c for c in _commands(CI) if re.search(r"\bpip\b.*\binstall\b", c)]
    assert installs == _readme_commands()[0]


def test_cuda_extras_bring_nvrtc_and_the_runtime_but_not_the_whole_toolkit():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    for major in ("12", "13"):
        deps = extras[f"cuda{major}"]
        assert any(d.startswith(f"cupy-cuda{major}x") for d in deps)
        assert f"cuda-toolkit[nvrtc,cudart]=={major}.*" in deps
        assert not any("[ctk]" in d or "cublas" in d for d in deps)
    assert "torch" not in " ".join(meta["dependencies"])


def test_nvrtc_and_cuda_headers_are_found_after_the_install():
    """What `pip install -e ".[cuda12,test]"` brings on a CPU machine is enough to compile a
    user's kernel that includes the CUDA headers, for an explicit architecture."""
    import cupylab
    from cupylab import kernels

    if kernels.cuda_include_dir() is None:
        pytest.fail("the CUDA headers (cuda_fp16.h) were not found; the cudart extra is missing")
    src = ('#include <cuda_fp16.h>\n'
           'extern "C" __global__ void h(__half* x, int n) {\n'
           '  int i = threadIdx.x; if (i < n) x[i] = __hadd(x[i], x[i]); }\n')
    assert cupylab.load_kernels(source=src).compile(cc=90) == {"h": "h"}
