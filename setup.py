"""Build script for mha_cy's compiled extensions (metadata lives in pyproject.toml).

Every ``mha_cy/<name>.pyx`` becomes the extension ``mha_cy.<name>``.  The hand-written C of
``src/*.c`` (include dir ``src/``) is compiled once, with the extensions' flags (position-
independent: it goes into shared objects), into the static library ``mha_cy_kernels`` in
build_temp, and every extension links it: the linker copies in only the objects an extension
calls, so each kernel is in the wheel once (cpu_features.o, a few hundred bytes, is in every
module that dispatches).  New .pyx / .c files are picked up automatically (globs).
Release builds (not MHA_CY_DEBUG / MHA_CY_SANITIZE) link with -Wl,-S: no debug information.  Cython runs only when
extensions are actually built, so the sdist carries the .pyx sources and never
Cython's generated .c files.

Environment variables (all take 1/0, true/false, yes/no, on/off):

  MHA_CY_NATIVE=1           add -march=native and define MHA_CY_NATIVE_BUILD=1
                            (local builds only: the result runs only on CPUs
                            like the build host; build_info() reports it).
  MHA_CY_DEBUG=1            -O0 -g, and Cython boundscheck / wraparound /
                            initializedcheck back on.
  MHA_CY_REQUIRE_OPENMP=1   fail the build when OpenMP is missing or disabled
                            (default: warn and build serial kernels).  The probe
                            tries -fopenmp (gcc, clang + libomp), on macOS then
                            -Xpreprocessor -fopenmp -lomp (Apple clang + libomp),
                            and /openmp with MSVC.
  MHA_CY_DISABLE_OPENMP=1   skip the OpenMP probe and build serial kernels
                            (to test the serial fallback).
  MHA_CY_ANNOTATE=1         also write Cython's annotated HTML (cython -a) next
                            to each .pyx, to check hot loops for Python calls.
  MHA_CY_SANITIZE=1         compile (at -O1) and link with -fsanitize=address,undefined
                            -fno-omit-frame-pointer (gcc/clang), for memory and
                            undefined-behaviour checks.  CPython itself is not
                            instrumented, so preload the ASan runtime and turn
                            off leak checking (CPython keeps objects alive at exit):

      MHA_CY_SANITIZE=1 python setup.py build_ext --inplace
      LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
      UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 python -m pytest -x tests/...

The OpenMP probe compiles and links with the environment's CFLAGS / LDFLAGS
(and the sanitizer flags), as the real build does: a flag that breaks linking
then fails the probe loudly instead of silently giving a serial build.

A change of any of these (or of the compiler / Cython version) since the last
build in the same build/ directory forces Cython and the C compiler to rerun.
"""

import glob
import json
import os
import shutil
import sys
import tempfile
import textwrap

import numpy
from Cython import __version__ as cython_version
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.modified import newer_group  # setuptools >= 69
except ImportError:  # pragma: no cover
    from setuptools.dep_util import newer_group

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _env_flag(name):
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    sys.exit(f"error: environment variable {name} must be one of 1/0, true/false, "
             f"yes/no, on/off; got {os.environ[name]!r}")


NATIVE = _env_flag("MHA_CY_NATIVE")
DEBUG = _env_flag("MHA_CY_DEBUG")
REQUIRE_OPENMP = _env_flag("MHA_CY_REQUIRE_OPENMP")
DISABLE_OPENMP = _env_flag("MHA_CY_DISABLE_OPENMP")
ANNOTATE = _env_flag("MHA_CY_ANNOTATE")
SANITIZE = _env_flag("MHA_CY_SANITIZE")

PACKAGE = "mha_cy"
SRC_DIR = "src"

SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]

CYTHON_DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
}

OPENMP_PROBE = textwrap.dedent(
    """\
    #include <omp.h>
    #include <stdio.h>

    int main(void)
    {
        int team = 0;
    #pragma omp parallel
        {
    #pragma omp atomic
            team++;
        }
        printf("%d %d\\n", omp_get_max_threads(), team);
        return 0;
    }
    """
)


KERNELS_LIB = "mha_cy_kernels"


def _c_sources():
    """Hand-written C of the kernel library (sorted: reproducible builds)."""
    return sorted(glob.glob(os.path.join(SRC_DIR, "*.c")))


def _extensions():
    depends = sorted(glob.glob(os.path.join(SRC_DIR, "*.h")))
    extensions = []
    for pyx in sorted(glob.glob(os.path.join(PACKAGE, "*.pyx"))):
        name = os.path.splitext(os.path.basename(pyx))[0]
        extensions.append(
            Extension(
                f"{PACKAGE}.{name}",
                sources=[pyx],
                include_dirs=[SRC_DIR, numpy.get_include()],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                depends=depends,
                language="c",
            )
        )
    return extensions


class BuildExt(build_ext):
    """build_ext that cythonizes lazily, probes OpenMP and sets the flags."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:  # `-j N` on the command line wins
            self.parallel = os.cpu_count() or 1

    # -- configuration ---------------------------------------------------------

    def _openmp_flags(self):
        """(compile, link) OpenMP flags, or None when the build is serial."""
        if self.compiler.compiler_type == "msvc":
            candidates = [(["/openmp"], [])]
        else:
            # gcc, and clang with libomp on Linux. Apple's clang has no -fopenmp driver
            # flag: the front end takes it through -Xpreprocessor and the program links
            # libomp itself (its -I / -L come from CFLAGS / LDFLAGS, e.g. Homebrew's libomp).
            candidates = [(["-fopenmp"], ["-fopenmp"])]
            if sys.platform == "darwin":
                candidates.append((["-Xpreprocessor", "-fopenmp"], ["-lomp"]))

        if DISABLE_OPENMP:
            reason = "MHA_CY_DISABLE_OPENMP is set"
        else:
            reasons = []
            for candidate in candidates:
                reason = self._probe_openmp(*candidate)
                if reason is None:
                    return candidate
                reasons.append(reason)
            reason = "; ".join(reasons)

        if REQUIRE_OPENMP:
            sys.exit(
                "error: MHA_CY_REQUIRE_OPENMP=1 but OpenMP is not available "
                f"({reason}).\n"
                "Install a compiler with OpenMP support (gcc; or clang with libomp) "
                "or unset MHA_CY_REQUIRE_OPENMP / MHA_CY_DISABLE_OPENMP."
            )
        message = textwrap.dedent(
            f"""\

            ***********************************************************************
            WARNING: building mha_cy WITHOUT OpenMP ({reason}).
            The kernels will run serially on one core: correct, but slower.
            mha_cy.build_info()['openmp'] will be False.
            To get parallel kernels, use a compiler with OpenMP support (gcc;
            clang with libomp), then rebuild; set MHA_CY_REQUIRE_OPENMP=1 to turn
            this warning into an error.
            ***********************************************************************
            """
        )
        print(message, file=sys.stderr, flush=True)
        return None

    @staticmethod
    def _env_flags(name):
        """The environment's CFLAGS / LDFLAGS as a list."""
        return os.environ.get(name, "").split()

    def _probe_openmp(self, compile_flags, link_flags):
        """Compile and link a tiny OpenMP program with self.compiler.

        Links with CFLAGS / LDFLAGS and the sanitizer flags as the extensions will (the
        compile command already has CFLAGS, but link_executable has neither): a probe
        linked without them passes where the real build comes out different.
        Returns None on success, else a one-line reason.
        """
        extra = SANITIZE_FLAGS if SANITIZE else []
        compile_flags = extra + list(compile_flags)
        link_flags = (self._env_flags("CFLAGS") + self._env_flags("LDFLAGS") + extra
                      + list(link_flags))
        tmp = tempfile.mkdtemp(prefix="mha_cy_openmp_probe_")
        try:
            source = os.path.join(tmp, "probe.c")
            with open(source, "w") as f:
                f.write(OPENMP_PROBE)
            flags = " ".join(compile_flags)
            try:
                objects = self.compiler.compile(
                    [source], output_dir=tmp, extra_postargs=compile_flags
                )
            except Exception:  # CompileError, missing compiler...
                return f"the compiler cannot compile an OpenMP test program with {flags}"
            try:
                self.compiler.link_executable(
                    objects, "probe", output_dir=tmp, extra_postargs=link_flags
                )
            except Exception:  # LinkError: e.g. no OpenMP runtime library
                return (f"an OpenMP test program compiled with {flags} does not link with "
                        f"{' '.join(link_flags)}")
            return None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _configure(self):
        """Flags and macros shared by every extension, as a dict."""
        msvc = self.compiler.compiler_type == "msvc"
        if msvc:
            compile_args = ["/Od", "/Zi"] if DEBUG else ["/O2"]
            link_args = ["/DEBUG"] if DEBUG else []
        else:
            compile_args = ["-O0", "-g"] if DEBUG else ["-O3"]
            # No -ffast-math: kernels rely on IEEE inf/NaN (masked rows, -INFINITY
            # running max).  -fno-math-errno only lets libm calls inline.
            # Hidden visibility: the kernel library is linked into several modules;
            # keep each copy private (PyInit_* is exported explicitly by Python's headers).
            # -ffp-contract=fast: let a*b+c become one FMA (ISO -std=c11 turns
            # that off; it halves the instructions of the dot products in src/).
            # -fopenmp-simd: honour `#pragma omp simd` (vectorized reductions in
            # src/) even in a build without the OpenMP runtime.
            # -fno-trapping-math: nothing here reads FP exception flags; without it
            # gcc keeps the branch-free exp of the softmax (src/fast_exp.h) scalar on
            # AVX2, since it may not compute a select's both sides for every lane.
            compile_args += ["-std=c11", "-fno-math-errno", "-fno-trapping-math",
                             "-ffp-contract=fast", "-fopenmp-simd", "-fvisibility=hidden"]
            # Release: no debug information in the modules (-S: strip debug; GNU ld, lld
            # and Apple's ld alike). The symbol table stays, for readable backtraces.
            link_args = ["-g"] if DEBUG else [] if SANITIZE else ["-Wl,-S"]
        macros = []
        if NATIVE:
            if msvc:
                print("warning: MHA_CY_NATIVE is ignored with MSVC", file=sys.stderr)
            else:
                compile_args.append("-march=native")
                macros.append(("MHA_CY_NATIVE_BUILD", "1"))
        if SANITIZE:
            if msvc:
                sys.exit("error: MHA_CY_SANITIZE=1 needs gcc or clang")
            # -O1 (the last -O wins): ASan's advice, and -O3 with the sanitizers and every
            # SIMD clone took minutes longer to compile on a loaded 2-core CI machine
            compile_args += SANITIZE_FLAGS + ["-O1"]
            link_args += SANITIZE_FLAGS
        openmp = self._openmp_flags()
        if openmp is not None:
            compile_args += openmp[0]
            link_args += openmp[1]
        if not msvc:
            # Recorded for build_info(); a single argv element, so no shell quoting.
            macros.append(("MHA_CY_BUILD_FLAGS", '"%s"' % " ".join(compile_args)))
        return {
            "compile_args": compile_args,
            "link_args": link_args,
            "macros": macros,
            "openmp": openmp is not None,
            "directives": CYTHON_DIRECTIVES,
            "annotate": ANNOTATE,
            "cython": cython_version,
            "compiler": list(getattr(self.compiler, "compiler_so", []) or [])
            or self.compiler.compiler_type,
        }

    def _options_changed(self, config):
        """True (and remember config) when the options differ from the last build."""
        stamp = os.path.join(self.build_temp, "mha_cy_build_options.json")
        text = json.dumps(config, sort_keys=True, indent=1)
        try:
            with open(stamp) as f:
                if f.read() == text:
                    return False
        except OSError:
            pass
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(text)
        return True

    # -- building ---------------------------------------------------------------

    def build_extensions(self):
        # Runs once run() has set up self.compiler, which the probe needs.
        config = self._configure()
        if self._options_changed(config):
            self.force = True
        kernels = self._build_kernels_lib(config)
        for ext in self.extensions:
            ext.extra_compile_args = list(ext.extra_compile_args) + config["compile_args"]
            ext.extra_link_args = list(ext.extra_link_args) + config["link_args"]
            ext.define_macros = list(ext.define_macros) + config["macros"]
            # After the module's own objects on the link line, so that the linker takes
            # from the archive exactly what the module calls; a newer library relinks.
            ext.extra_objects = list(ext.extra_objects) + [kernels]
            ext.depends = list(ext.depends) + [kernels]
        cythonized = cythonize(
            self.extensions,
            compiler_directives=CYTHON_DIRECTIVES,
            annotate=ANNOTATE,
            force=self.force,
            nthreads=0,  # the C compilation below is the parallel part
            quiet=True,
        )
        # Keep setuptools' Extension objects (finalize_options() annotated them);
        # take only the .pyx -> .c source lists from Cython's copies.
        generated = {ext.name: ext.sources for ext in cythonized}
        for ext in self.extensions:
            ext.sources = list(generated[ext.name])
        super().build_extensions()

    def _build_kernels_lib(self, config):
        """Compile src/*.c once into the static library; return its path."""
        sources = _c_sources()
        depends = sources + sorted(glob.glob(os.path.join(SRC_DIR, "*.h")))
        out_dir = os.path.join(self.build_temp, "kernels")
        lib = self.compiler.library_filename(KERNELS_LIB, output_dir=out_dir)
        if not (self.force or newer_group(depends, lib, "newer")):
            return lib
        compile_args = list(config["compile_args"])
        if self.compiler.compiler_type != "msvc":
            compile_args.append("-fPIC")  # linked into shared objects

        def compile_one(source):
            # Every .c includes its headers only: any header change recompiles all (cheap).
            return self.compiler.compile(
                [source],
                output_dir=out_dir,
                macros=config["macros"],
                include_dirs=[SRC_DIR],
                debug=self.debug,
                extra_postargs=compile_args,
                depends=depends,
            )

        # The sources are independent: compile them concurrently, as build_ext -j does
        # the extensions (each object has its own output path).
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        with ThreadPoolExecutor(max_workers=max(1, int(self.parallel or 1))) as pool:
            objects = [obj for objs in pool.map(compile_one, sources) for obj in objs]
        if os.path.exists(lib):
            os.remove(lib)  # `ar -r` would keep members of a source since removed
        self.compiler.create_static_lib(objects, KERNELS_LIB, output_dir=out_dir)
        return lib

setup(
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExt},
)
