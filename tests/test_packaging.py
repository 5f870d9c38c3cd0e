"""pyproject.toml's requirements and the README's set-up routes: the [plot] extra (matplotlib, inside the test
extra), triton optional (the gpu and test extras) and bounded to the releases tested, the two install routes (GPU:
the default wheels; CPU-only: PyTorch's CPU wheel index) and CI on the CPU route."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
TESTED_TRITON = ("3.6.0", "3.9.0")   # the GPU image's release and this CPU machine's


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _by_name(reqs: list[str]) -> dict[str, Requirement]:
    parsed = [Requirement(r) for r in reqs]
    return {r.name.lower(): r for r in parsed}


def test_plot_extra_is_matplotlib_and_inside_the_test_extra() -> None:
    extras = _project()["optional-dependencies"]
    plot, test = _by_name(extras["plot"]), _by_name(extras["test"])
    assert set(plot) == {"matplotlib"} and plot["matplotlib"].specifier.contains(metadata.version("matplotlib"))
    for name, req in plot.items():   # the tests draw a plot: the test extra carries the same requirement
        assert name in test and test[name].specifier == req.specifier, (name, extras["test"])


def test_triton_is_optional_and_bounded_to_the_tested_releases() -> None:
    """Not a runtime requirement (the CPU path runs without it: tests/test_no_triton.py); the gpu extra and the test
    extra (the interpreter tests) name it, with the same bounds: the releases tested."""
    project = _project()
    assert "triton" not in _by_name(project["dependencies"]), project["dependencies"]
    extras = project["optional-dependencies"]
    gpu, test = _by_name(extras["gpu"])["triton"], _by_name(extras["test"])["triton"]
    assert set(_by_name(extras["gpu"])) == {"triton"} and test.specifier == gpu.specifier, (gpu, test)
    assert all(gpu.specifier.contains(v) for v in TESTED_TRITON), gpu
    assert not gpu.specifier.contains("3.5.0") and not gpu.specifier.contains("3.10.0"), gpu
    installed = metadata.version("triton")
    assert gpu.specifier.contains(Version(installed).base_version), (installed, gpu)


def _setup_section() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^## Set up\n(.*?)^## ", text, re.S | re.M)
    assert m, "README.md has no '## Set up' section"
    return m[1]


def test_readme_states_both_install_routes_and_the_plot_extra() -> None:
    setup = _setup_section()
    lines = [ln.split("#")[0].strip() for ln in setup.splitlines()]
    assert 'pip install -e ".[test]"' in lines, setup                 # GPU host: the default wheels
    cpu = "pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install -e \".[test]\""
    assert cpu in lines, setup                                          # CPU-only host: PyTorch's CPU index first
    assert '".[plot]"' in setup and "--plot" in setup, setup


def test_readme_says_where_triton_comes_from() -> None:
    """torch's CUDA wheels bring it on Linux GPU hosts (the gpu extra otherwise), a CPU-only host does not need it,
    the test extra brings it for the interpreter tests."""
    setup = " ".join(_setup_section().split())   # the prose, its line breaks as spaces
    assert '".[gpu]"' in setup and "not needed on a CPU-only host" in setup, setup
    assert "the test extra brings it" in setup and "interpreter" in setup, setup


def test_ci_installs_the_cpu_build_first() -> None:
    """.ci/run (a clean CPU machine): torch's pinned CPU build, then the package with the test extra."""
    run = (ROOT / ".ci" / "run").read_text().splitlines()
    torch_at = next(i for i, ln in enumerate(run) if re.search(r"pip install .*torch==", ln))
    pkg_at = next(i for i, ln in enumerate(run) if 'install --quiet -e ".[test]"' in ln)
    assert torch_at < pkg_at, run
