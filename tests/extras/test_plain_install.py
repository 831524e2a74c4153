"""A plain ``pip install attnopt`` (torch + numpy only): every command runs or names its extra.

The optional packages are made unimportable in a subprocess: ``sys.modules[name] = None``
for every module of every extra, so ``import matplotlib`` raises ``ImportError`` there.
"""
import os
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from attnopt._extras import EXTRA_MODULES

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = sorted({m for mods in EXTRA_MODULES.values() for m in mods} - {"networkx"})  # a torch dependency
SHIM = (
    "import sys\n"
    f"for m in {BLOCKED!r}: sys.modules[m] = None\n"
    "from attnopt.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", SHIM, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_reproduce_skips_claims_that_need_extras(tmp_path):
    only = "implicit_kernel:prop1,implicit_kernel:prop2,fenchel_dual:eq18,doubly_normalized:eq10_sinkhorn"
    res = _run("reproduce", "--quick", "--only", only, "--out", str(tmp_path / "rep"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    papers = ("implicit", "fenchel", "doubly")
    lines = {ln.split()[0]: ln for ln in res.stdout.splitlines() if ln.startswith(papers)}
    assert " reproduced " in lines["implicit_kernel:prop1"]
    for cid in ("implicit_kernel:prop2", "fenchel_dual:eq18", "doubly_normalized:eq10_sinkhorn"):
        assert " skipped " in lines[cid] and "nan" not in lines[cid]
    assert "1/4 reproduced, 0 inconclusive, 3 skipped, 0 errors" in res.stdout
    assert "pip install 'attnopt[reproduce]'" in res.stdout
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "Verdict: skipped" in report and "pip install 'attnopt[reproduce]'" in report


@pytest.mark.slow  # ~11 s of subprocesses in the plain install: `pytest -m slow`
def test_analyze_and_bench_name_their_extra_in_one_line(tmp_path):
    res = _run("analyze", "--out", str(tmp_path / "an"), cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    assert "attnopt analyze needs" in res.stderr and "pip install 'attnopt[hf]'" in res.stderr
    res = _run("train", "ot-vit", "--quick", "--out", str(tmp_path / "tr"), cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "pip install 'attnopt[train]'" in res.stderr and "Traceback" not in res.stderr
    res = _run("bench", "--quick", "--only", "regularized", "--no-memory", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "skipped: bench suite 'regularized' needs entmax" in res.stdout
    assert "pip install 'attnopt[oracles]'" in res.stdout


@pytest.mark.slow  # ~11 s of subprocesses in the plain install: `pytest -m slow`
def test_version_list_and_python_m(tmp_path):
    from attnopt import __version__

    res = _run("--version", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == f"attnopt {__version__}"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    res = subprocess.run([sys.executable, "-m", "attnopt", "--version"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == f"attnopt {__version__}"
    res = _run("reproduce", "--list", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "fenchel_dual:eq18" in res.stdout and "hf (missing)" in res.stdout
    assert "implicit_kernel:prop1" in res.stdout and "Prop. 1" in res.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True, timeout=300)
    (whl,) = out.glob("attnopt-*.whl")
    return whl


def test_wheel_imports_and_runs_with_only_torch_and_numpy(wheel, tmp_path):
    names = zipfile.ZipFile(wheel).namelist()
    assert "attnopt/py.typed" in names and "attnopt/claims/fenchel_dual/__init__.py" in names
    # -S: no site-packages .pth files (so not the editable checkout); an allow-list finder keeps
    # every third-party module out but torch, numpy and torch's own requirements. The
    # site-packages folders are this interpreter's, read here: under -S a virtual environment's
    # python leaves sys.prefix at the base interpreter, whose folders do not hold torch.
    site_dirs = list(dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"],
                                    sysconfig.get_paths()["platlib"]]))
    probe = f"""
import importlib.abc, importlib.metadata, re, sys
sys.path[:0] = [{str(wheel)!r}]
sys.path += {site_dirs!r}
allowed = {{"torch", "numpy", "torchgen", "functorch", "_distutils_hack"}}
for req in importlib.metadata.requires("torch") or []:
    if "extra ==" not in req:
        allowed.add(re.split(r"[<>=;\\[ ]", req)[0].replace("-", "_").lower())
allowed |= {{"typing_extensions", "mpmath", "markupsafe", "jinja2", "sympy", "filelock", "fsspec"}}
class OnlyTorchAndNumpy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        root = name.split(".")[0]
        if root in sys.stdlib_module_names or root in allowed or root == "attnopt" or root.startswith("_"):
            return None
        raise ModuleNotFoundError(f"No module named {{name!r}} (not installed)", name=name)
sys.meta_path.insert(0, OnlyTorchAndNumpy())
import torch, attnopt
assert attnopt.__file__.startswith({str(wheel)!r}), attnopt.__file__
assert torch.__file__.startswith(tuple({site_dirs!r})), torch.__file__  # this environment's torch
q = torch.randn(1, 2, 4, 8)
assert attnopt.generalized_attention(q, q, q).shape == (1, 2, 4, 8)
from attnopt.cli import main
only = "fenchel_dual:eq16,fenchel_dual:fig3"
rc = main(["reproduce", "--quick", "--only", only, "--out", {str(tmp_path)!r}])
assert rc == 0, rc
print("analyze rc", main(["analyze"]))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-S", "-c", probe], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1/2 reproduced, 0 inconclusive, 1 skipped, 0 errors" in res.stdout
    assert "analyze rc 2" in res.stdout and "pip install 'attnopt[hf]'" in res.stderr


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_with_only_torch_and_numpy(wheel, tmp_path):
    """The real thing: a new virtual environment, ``pip install torch numpy attnopt.whl``."""
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout on the path
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, env=env)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0", "numpy", str(wheel)],
                   check=True, timeout=1200, env=env)
    res = subprocess.run([str(venv / "bin" / "attnopt"), "reproduce", "--quick", "--only",
                          "fenchel_dual:eq16,fenchel_dual:fig3", "--out", str(tmp_path / "rep")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1/2 reproduced, 0 inconclusive, 1 skipped, 0 errors" in res.stdout
    res = subprocess.run([str(venv / "bin" / "attnopt"), "analyze"], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env=env)
    assert res.returncode == 2 and "pip install 'attnopt[hf]'" in res.stderr
    assert "Traceback" not in res.stderr
