"""The wheel installs into a fresh venv, and a C++ project finds its libraries with find_package
(core, runtime, and embed, which serves a Python-defined model from C++)."""

import os
import pathlib
import shutil
import subprocess
import sys
import venv

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# What the installed wheel is checked under: nothing from the source tree or the calling venv.
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MSTAR_PYTHON")}


def _run(*cmd, **kw):
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory):
    if shutil.which("cmake") is None:
        pytest.fail("cmake is not on PATH; run scripts/setup.sh")
    tmp = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", tmp / "dist", ROOT)
    wheels = list((tmp / "dist").glob("mstar_rt-*.whl"))
    assert len(wheels) == 1, wheels
    venv.create(tmp / "venv", with_pip=True)
    python = tmp / "venv" / "bin" / "python"
    _run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheels[0])
    return tmp, python


def test_wheel_installs_into_a_fresh_venv_and_imports_the_core(fresh_env):
    _, python = fresh_env
    out = _run(python, "-c", "import mstar_rt, mstar_rt._core as c; print(c.__file__)",
               cwd="/", env=CLEAN_ENV)  # not the source tree: the import must come from the installed wheel
    assert "site-packages" in out


def test_cpp_consumer_builds_with_find_package_against_the_installed_wheel(fresh_env):
    """core, runtime and embed from the wheel; embed serves a Python-defined model from C++
    with the fresh venv's interpreter and its installed mstar_rt (never the source tree)."""
    tmp, python = fresh_env
    prefix = _run(python, "-m", "mstar_rt", "--cmake-prefix").strip()
    assert (pathlib.Path(prefix) / "mstar_rtConfig.cmake").is_file()
    assert (pathlib.Path(prefix) / "mstar_rtEmbedTargets.cmake").is_file()
    build = tmp / "consumer"
    env = {**CLEAN_ENV, "CMAKE_PREFIX_PATH": prefix}
    _run("cmake", "-S", ROOT / "tests" / "package", "-B", build, "-DMSTAR_CONSUMER_REQUIRE_EMBED=ON",
         env=env)
    _run("cmake", "--build", build, "--parallel", "2", env=env)
    out = _run("ctest", "--test-dir", build, "--output-on-failure", "-V", env=env, cwd="/")
    assert "100% tests passed" in out
    for test in ("package_consumer", "package_runtime", "package_embed"):
        assert f"{test} " in out, out
    # The embedded interpreter took the fresh venv, where the wheel is installed.
    assert f"via {python}" in out, out
    assert str(tmp / "venv") in out.split("embed_consumer: mstar_rt from", 1)[1], out


def test_the_location_flags_are_one_or_the_other(capsys, tmp_path, monkeypatch):
    import mstar_rt.__main__ as cli

    with pytest.raises(SystemExit) as e:  # both printed the first one only
        cli.main(["--cmake-prefix", "--include-dir"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err
    monkeypatch.setattr(cli, "cmake_prefix", lambda: tmp_path / "mstar_rt" / "cmake")
    # a source checkout on PYTHONPATH: the paths printed did not exist, exit 0, and CMake then
    # failed without a reason
    assert cli.main(["--include-dir"]) == 1
    assert "is not an installed build; install it (pip install .)" in capsys.readouterr().err
    (tmp_path / "mstar_rt" / "include" / "mstar").mkdir(parents=True)
    assert cli.main(["--include-dir"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "mstar_rt" / "include")
