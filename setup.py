"""Maps the top-level component folders to the `triptych.*` import names.

pyproject.toml holds the metadata; only the package list lives here, because it is
derived from the folders (find_packages under each mapped root).

The four roots (triptych/, worker/, router/, operator/) deliberately have NO __init__.py:
they are PEP 420 namespace packages. A folder without __init__.py never shadows a regular
module or package of the same name further down sys.path, so a process started in the
checkout (cwd first on sys.path) still gets the standard library's `operator`, and the
checkout's `triptych/` folder merges with - instead of hiding - the installed
`triptych.worker/router/operator`. Both installs map the folders: the wheel (`pip install .`)
copies them to site-packages/triptych/{worker,router,operator}; the editable install
(`pip install -e .`) registers them with setuptools' editable finder. Packages below the
roots (worker/engine/, triptych/kube/, ...) are ordinary packages with an __init__.py.
tests/triptych/test_packaging.py starts processes in the checkout root to keep it so.
"""

from setuptools import find_packages, setup

ROOTS = {
    "triptych": "triptych",
    "triptych.worker": "worker",
    "triptych.router": "router",
    "triptych.operator": "operator",
}


def _packages() -> list[str]:
    found: list[str] = []
    for name, folder in ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=_packages(), package_dir=ROOTS)
