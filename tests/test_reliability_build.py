"""setup.py's OpenMP probe links as the real build does (CFLAGS, LDFLAGS, sanitizer flags)."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "setup.py")

# Load setup.py without running setup(), then run BuildExt's probe with the default compiler.
_PROBE = textwrap.dedent(
    """
    import runpy, sys
    import setuptools
    setuptools.setup = lambda **kw: None
    from setuptools import Distribution
    ns = runpy.run_path(sys.argv[1], run_name="setup_under_test")
    cmd = ns["BuildExt"](Distribution())
    cmd.finalize_options()
    from distutils.ccompiler import new_compiler
    from distutils.sysconfig import customize_compiler
    cmd.compiler = new_compiler()
    customize_compiler(cmd.compiler)
    print("REASON", cmd._probe_openmp(["-fopenmp"], ["-fopenmp"]))
    """
)


def _probe(**env):
    full_env = {**os.environ, **env}
    result = subprocess.run([sys.executable, "-c", _PROBE, SETUP], env=full_env, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("REASON ")][-1]
    return line[len("REASON "):]


needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                               reason="needs a C compiler")


@needs_gcc
def test_probe_passes_with_a_plain_environment():
    assert _probe(LDFLAGS="", CFLAGS="") == "None"


@needs_gcc
def test_probe_links_with_ldflags():
    # A library the real build would fail to link must fail the probe too (it used to pass,
    # so that e.g. sanitizer LDFLAGS silently gave a serial build).
    reason = _probe(LDFLAGS="-lmha_cy_no_such_library")
    assert reason != "None"
    assert "mha_cy_no_such_library" in reason


@needs_gcc
def test_probe_links_with_cflags_sanitizer():
    # -fsanitize in CFLAGS only: the object needs the ASan runtime, so the link must have it.
    asan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                          text=True).stdout.strip()
    if not os.path.isabs(asan):
        pytest.skip("no libasan")
    assert _probe(CFLAGS="-fsanitize=address", LDFLAGS="") == "None"


def test_sanitize_flag_documented_and_used():
    text = open(SETUP).read()
    assert "MHA_CY_SANITIZE" in text.split('"""')[1]       # in the module docstring
    assert "-fsanitize=address,undefined" in text
    assert "detect_leaks=0" in text
