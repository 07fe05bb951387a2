"""The release: a wheel and an sdist that `twine check` passes, one version, the wheel
installed in a fresh venv running `grpojax train` (from the wheel, not the checkout), and
the type checker over the public API."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tomllib
import zipfile

import pytest
from user_cache import user_cache_dir

import grpojax

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The public API the type checker must cover: the ops (`import grpojax as gj`), the sampler,
# the models, the train steps, the rewards and the environments.
PUBLIC = ["grpojax/__init__.py", *(f"grpojax/{p}" for p in ("ops", "sampling", "models"))]
PUBLIC += [f"grpojax/{p}" for p in ("train", "rewards", "envs")]


def _run(cmd, **kw):
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=900, check=False, **kw
    )
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """`python -m build` of the checkout: the sdist, then the wheel built from the sdist."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT])
    return out


def test_one_version_source():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in meta and "version" in meta["dynamic"]
    from importlib.metadata import version

    assert version("grpojax") == grpojax.__version__


@pytest.mark.slow
def test_wheel_and_sdist_pass_twine_and_carry_the_typed_marker(dist):
    wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1
    assert wheels[0].name == f"grpojax-{grpojax.__version__}-py3-none-any.whl"
    _run([sys.executable, "-m", "twine", "check", "--strict", wheels[0], sdists[0]])
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "grpojax/py.typed" in names and "grpojax/ops/__init__.py" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    meta = (
        zipfile.ZipFile(wheels[0])
        .read(f"grpojax-{grpojax.__version__}.dist-info/METADATA")
        .decode()
    )
    assert "Provides-Extra: cuda" in meta and "Provides-Extra: tpu" in meta
    assert "Requires-Dist: jax[cuda12]" in meta


@pytest.mark.slow
def test_grpojax_train_runs_from_the_wheel_in_a_fresh_venv(dist, tmp_path):
    """A fresh venv with the wheel installed (its dependencies read from this environment's
    site-packages, behind the venv's own: nothing downloaded) runs a reduced main job from
    a directory outside the checkout; grpojax is imported from the venv."""
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    py = venv / "bin" / "python"
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    # Only this directory is added: its .pth files (the checkout's editable install) are not.
    (pathlib.Path(site) / "_grpojax_test_deps.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    wheel = next(dist.glob("*.whl"))
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel])
    where = _run([py, "-c", "import grpojax; print(grpojax.__file__)"], cwd=tmp_path).strip()
    assert where.startswith(site) and not where.startswith(str(ROOT)), where
    env = {**os.environ, "PYTHONPATH": ""}
    out = _run(
        [
            venv / "bin" / "grpojax",
            "train",
            "--no-progress",
            "total_steps=2",
            "optimizer.warmup_steps=1",
            "sft.steps=3",
            "eval.heldout_size=16",
            "eval.batch_size=16",
            "eval.k=2",
            f"log.run_dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env=env,
    )
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"grpojax train: success_before=[\d.]+ success_after=[\d.]+ wall_s=[\d.]+ "
        r"first_step_s=[\d.]+ run_dir=.+",
        last,
    ), last
    assert (tmp_path / "run" / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_type_checker_passes_on_the_public_api():
    """mypy as configured in pyproject.toml (its `files`: one list, read by a plain `mypy`
    too) covers every public package and reports nothing. Its cache is kept beside the
    suite's compilation cache: on an empty one mypy reads jax and flax's types for 20 s
    (transformers' and torch's are not read: pyproject.toml); on a kept one (entries checked
    by their sources' hashes, whatever the checkout's path) it takes seconds."""
    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert set(PUBLIC) <= set(files), sorted(set(PUBLIC) - set(files))
    cache = user_cache_dir("mypy-tests")
    out = _run([sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", cache], cwd=ROOT)
    assert out.strip() == "", out
