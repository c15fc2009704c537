"""Packaging: the top-level folders map to `triptych.*` and never shadow anything.

Processes started in the checkout root have the root first on sys.path (`python -c`,
`python -m`). There, a folder `operator/` with an __init__.py would replace the standard
library's `operator` for any process that had not imported it yet (`python -S`, embedded
interpreters, some launchers), and a regular package `triptych/` would hide the installed
`triptych.router`. setup.py explains the layout; these tests start such processes against
the editable install (the one running the tests) and against a freshly built wheel.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOT_FOLDERS = ("triptych", "worker", "router", "operator")
STDLIB_OPERATOR = importlib.util.find_spec("operator").origin  # type: ignore[union-attr]

# Imports `collections` (which needs the standard library's operator.eq) before anything
# else, then the router's and the operator's entry modules; prints where they came from.
PROBE = textwrap.dedent("""
    import collections, operator, sys
    {setup}
    import triptych.router.main, triptych.operator.main, triptych.kube.names
    from triptych.version import __version__
    print("operator", operator.__file__)
    print("router", triptych.router.main.__file__)
    print("version", __version__)
""")


def run(args: list[str], cwd: Path = ROOT, **kw: object) -> dict[str, str]:
    out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120, **kw)  # type: ignore[call-overload]
    assert out.returncode == 0, f"{args[:3]}: {out.stderr[-2000:]}"
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)


def test_root_folders_are_not_regular_packages() -> None:
    inits = [f"{folder}/__init__.py" for folder in ROOT_FOLDERS if (ROOT / folder / "__init__.py").exists()]
    assert inits == [], "the checkout root must hold no importable package (see setup.py)"


@pytest.mark.parametrize("flags", [["-S"], ["-I"], []], ids=["no-site", "isolated", "plain"])
def test_child_in_the_root_gets_stdlib_operator_and_the_mapping(flags: list[str]) -> None:
    # -S: nothing imported `operator` before our code runs (the case that used to fail);
    # site's .pth files (the editable finder) are processed after the root is first on the path.
    setup = "import site; site.main()" if "-S" in flags else ""
    setup += "\nsys.path.insert(0, '')" if "-I" in flags else ""  # -I drops cwd: put it back first
    got = run([sys.executable, *flags, "-c", PROBE.format(setup=setup)])
    assert got["operator"] == STDLIB_OPERATOR
    assert got["router"] == str(ROOT / "router" / "main.py")
    assert got["version"] == importlib.metadata.version("triptych")


def test_python_dash_m_in_the_root() -> None:
    for module in ("triptych.router.main", "triptych.operator.main"):  # importing them is the test
        run([sys.executable, "-S", "-c", f"import site, runpy; site.main(); runpy.run_module({module!r})"])
        run([sys.executable, "-m", module])
    out = subprocess.run([sys.executable, "-m", "triptych.cli", "router", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--discovery" in out.stdout, out.stderr


def _can_build_wheels() -> bool:
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    has_wheel = importlib.util.find_spec("wheel") is not None
    return has_wheel or tuple(int(p) for p in version.split(".")[:2]) >= (70, 1)  # bdist_wheel built in


@pytest.mark.slow
@pytest.mark.skipif(not _can_build_wheels(), reason="needs setuptools>=70.1 (the [test] extra pins it)")
def test_wheel_install_maps_the_folders_and_shadows_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ROOT_FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)], cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("triptych-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    assert {"triptych/router/main.py", "triptych/operator/reconcile.py", "triptych/worker/server.py",
            "triptych/kube/names.py", "triptych/cli.py",
            "triptych/worker/attention/cpu_decode.c"} <= files  # the kernel's source, built where it runs
    assert not any(f.split("/")[0] in ("worker", "router", "operator") for f in files)

    site = tmp_path / "site"
    run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], cwd=tmp_path)
    # Dependencies from this environment's site-packages, but no .pth processing: the editable
    # finder stays out, so only the checkout root and the wheel can provide `triptych`.
    deps = [p for p in sys.path if p.endswith("site-packages")]
    setup = f"sys.path[1:1] = [{str(site)!r}]; sys.path += {deps!r}"
    got = run([sys.executable, "-S", "-c", PROBE.format(setup=setup)])
    assert got["operator"] == STDLIB_OPERATOR
    assert got["router"] == str(site / "triptych" / "router" / "main.py")
    assert got["version"] == importlib.metadata.version("triptych")


def test_the_tests_folder_cannot_shadow_triptych_modules() -> None:
    """tests/conftest.py puts tests/ on sys.path, so tests/triptych/ joins the `triptych`
    namespace in the test process (first): a file there named like a module of triptych/
    would replace that module in every test."""
    def names(folder: Path) -> set[str]:
        return {p.stem for p in folder.iterdir() if p.suffix == ".py" or (p.is_dir() and p.name != "__pycache__")}
    assert names(ROOT / "triptych") & names(ROOT / "tests" / "triptych") == set()
