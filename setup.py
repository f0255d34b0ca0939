# Builds c10d_ext._C with torch's BuildExtension (ninja). The NCCL engine (src/cuda) is built
# when torch is a CUDA build and NCCL's header and library are found; MYCCL_WITH_NCCL=1 forces
# it on (and fails loudly if anything is missing), MYCCL_WITH_NCCL=0 forces it off.
# MYCCL_BUILD_TESTS=1 also builds c10d_ext._test_double, the strict CUDA/NCCL host double the
# tests run the CUDA engine on (scripts/setup.sh sets it for the source tree's venv; wheels and
# `pip install .` leave it out).
import os
import sys

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
import build_sources  # noqa: E402  (which sources each build compiles; the C++ unit tests use it too)


def _site_packages_dirs():
    # nvidia-* wheels install as namespace packages under site-packages/nvidia/... In a venv made
    # with --system-site-packages (the GPU check's) they are split: torch's CUDA runtime and NCCL
    # in the base interpreter's site-packages, the header wheels installed later in the venv's.
    # sys.path also names site dirs added by .pth files.
    import site

    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    dirs.append(os.path.dirname(os.path.dirname(torch.__file__)))
    dirs += [p for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _find_all(rel):
    return [os.path.join(base, rel) for base in _site_packages_dirs() if os.path.exists(os.path.join(base, rel))]


def _find(rel):
    found = _find_all(rel)
    return found[0] if found else None


def _nccl_config():
    """Returns (include_dirs, library_dirs, libraries) for the NCCL engine, or None."""
    want = os.environ.get("MYCCL_WITH_NCCL", "auto").strip().lower()
    if want not in ("auto", "0", "1"):
        sys.exit(f"setup.py: MYCCL_WITH_NCCL must be 0, 1 or unset, got {want!r}")
    if want == "0":
        return None

    problems = []
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is a CPU-only build")
    nccl_h = _find("nvidia/nccl/include/nccl.h")
    nccl_so = _find("nvidia/nccl/lib/libnccl.so.2")
    if nccl_h is None or nccl_so is None:
        problems.append("nccl.h / libnccl.so.2 not found (pip install nvidia-nccl-cu13)")
    # nccl.h includes cuda_runtime.h; torch's wheels do not ship the CUDA headers, the small
    # nvidia-cuda-crt / nvidia-cuda-cccl wheels (or a CUDA toolkit) do. Runtime, crt and cccl are
    # three wheels that may sit in different site-packages (see _site_packages_dirs): each part is
    # taken next to cuda_runtime.h if it is there, else from wherever it is.
    cuda_incs = [d for cand in ("nvidia/cu13/include", "nvidia/cuda_runtime/include") for d in _find_all(cand)]
    cuda_inc = next((d for d in cuda_incs if os.path.exists(os.path.join(d, "cuda_runtime.h"))), None)
    if cuda_inc is None:
        home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
        if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            cuda_inc = os.path.join(home, "include")
            cuda_incs = [cuda_inc]
    crt_inc = cccl_inc = None
    if cuda_inc is None:
        problems.append("cuda_runtime.h not found (pip install nvidia-cuda-crt nvidia-cuda-cccl)")
    else:
        near_first = [cuda_inc] + [d for d in cuda_incs if d != cuda_inc]
        crt_inc = next((d for d in near_first if os.path.exists(os.path.join(d, "crt", "host_defines.h"))), None)
        cccl_inc = next((os.path.join(d, "cccl") for d in near_first if os.path.isdir(os.path.join(d, "cccl"))), None)
        if crt_inc is None:
            problems.append(f"{cuda_inc} lacks crt/host_defines.h (pip install nvidia-cuda-crt)")
    cudart = None
    for cand in ("nvidia/cu13/lib/libcudart.so.13", "nvidia/cuda_runtime/lib/libcudart.so.12"):
        cudart = _find(cand)
        if cudart:
            break

    if problems:
        if want == "1":
            sys.exit("setup.py: MYCCL_WITH_NCCL=1 but the NCCL engine cannot be built:\n  - "
                     + "\n  - ".join(problems))
        print("setup.py: building without the NCCL engine: " + "; ".join(problems))
        return None

    inc = list(dict.fromkeys(d for d in (os.path.dirname(nccl_h), cuda_inc, crt_inc, cccl_inc) if d))
    lib_dirs = [os.path.dirname(nccl_so)]
    libs = [":libnccl.so.2", "c10_cuda", "torch_cuda"]
    if cudart:
        lib_dirs.append(os.path.dirname(cudart))
        libs.append(":" + os.path.basename(cudart))
    else:
        libs.append("cudart")
    return inc, lib_dirs, libs


def _build_tests():
    want = os.environ.get("MYCCL_BUILD_TESTS", "0").strip()
    if want not in ("0", "1"):
        sys.exit(f"setup.py: MYCCL_BUILD_TESTS must be 0 or 1, got {want!r}")
    return want == "1"


def _torch_minor():
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


# A build is for one torch minor release (c10d's C++ classes have no stable ABI), so the
# version says which: 0.2.0+torch2.14. The wheel also requires that torch minor.
_TORCH_MAJOR, _TORCH_MINOR = (int(x) for x in _torch_minor().split("."))
VERSION = f"0.2.0+torch{_TORCH_MAJOR}.{_TORCH_MINOR}"
TORCH_REQUIREMENT = f"torch>={_TORCH_MAJOR}.{_TORCH_MINOR},<{_TORCH_MAJOR}.{_TORCH_MINOR + 1}"

nccl = _nccl_config()
define_macros = [
    ("MYCCL_TORCH_VERSION", f'"{torch.__version__}"'),
]
include_dirs = [os.path.join(ROOT, "include"), os.path.join(ROOT, "src")]
library_dirs, libraries, rpaths = [], [], []
if nccl is not None:
    inc, lib_dirs, libs = nccl
    include_dirs += inc
    library_dirs += lib_dirs
    libraries += libs
    # The venv's NCCL (torch has loaded the same one by then): found from a wheel's install
    # location relative to the extension, and from the build venv for an editable install.
    rpaths += ["$ORIGIN/../" + os.path.relpath(d, os.path.dirname(os.path.dirname(torch.__file__))) for d in lib_dirs]
    rpaths += lib_dirs
    define_macros.append(("MYCCL_WITH_NCCL", "1"))

# Reduction kernels need real optimisation; the rest is fine at -O2.
# -g0 overrides the -g Python's own flags add: debug info roughly doubles compile time here.
# -ffp-contract=off: no multiply is fused into an add (FMA), so results round exactly as the
# same arithmetic in torch does (the scaled sum of the DDP reducer relies on it).
cxx_flags = ["-O3", "-g0", "-std=c++20", "-ffp-contract=off", "-fvisibility=hidden", "-Wall", "-Wno-unused-parameter",
             "-Wno-sign-compare", "-Wno-unknown-pragmas", "-Wno-missing-field-initializers"]
if os.environ.get("MYCCL_DEBUG_BUILD") == "1":
    cxx_flags += ["-g", "-O0", "-fno-omit-frame-pointer"]


def _nccl_header_version():
    ver = {}
    with open(os.path.join(nccl[0][0], "nccl.h")) as f:
        for line in f:
            for key in ("NCCL_MAJOR", "NCCL_MINOR", "NCCL_PATCH"):
                if line.startswith(f"#define {key} "):
                    ver[key] = line.split()[2]
    return ".".join(ver.get(k, "?") for k in ("NCCL_MAJOR", "NCCL_MINOR", "NCCL_PATCH"))


def _build_info():
    return {
        "version": VERSION,
        "torch_version": torch.__version__,
        "torch_minor": _torch_minor(),
        "with_nccl": nccl is not None,
        "with_test_double": _build_tests(),
        "nccl_build_header": _nccl_header_version() if nccl is not None else None,
        "cxx_flags": cxx_flags,
        "python": sys.version.split()[0],
    }


class BuildExt(BuildExtension):
    """torch's BuildExtension, plus: objects kept per torch and Python version under build/ (so a
    rebuild, or a switch back to another torch, recompiles only what changed), and
    c10d_ext/_build_info.py written next to the extension it describes."""

    def finalize_options(self):
        super().finalize_options()
        # Always hand the build to ninja, which knows what changed; setuptools' own check only
        # compares the .cpp files with the .so and would keep a build for another torch.
        self.force = True
        tag = f"torch{torch.__version__}-py{sys.version_info.major}.{sys.version_info.minor}"
        self.build_temp = os.path.join(ROOT, "build", "temp-" + tag.replace("+", "-"))

    def run(self):
        super().run()
        package_dir = os.path.dirname(self.get_ext_fullpath("c10d_ext._C"))
        with open(os.path.join(package_dir, "_build_info.py"), "w") as f:
            f.write("# Written when c10d_ext._C was built (setup.py, BuildExt); do not edit.\n")
            f.write(f"BUILD_INFO = {_build_info()!r}\n")


setup(
    name="c10d_ext",
    version=VERSION,
    description="myccl: a fast, debuggable torch.distributed backend (shared memory / TCP on CPU, NCCL on CUDA)",
    packages=find_packages(include=["c10d_ext", "c10d_ext.*"]),  # every subpackage, new ones too
    python_requires=">=3.10",
    install_requires=[TORCH_REQUIREMENT],
    ext_modules=[
        CppExtension(
            name="c10d_ext._C",
            sources=build_sources.extension_sources(nccl is not None),
            include_dirs=include_dirs,
            library_dirs=library_dirs,
            libraries=libraries,
            runtime_library_dirs=rpaths,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-Wl,--as-needed"] if nccl is None else [],
        )
    ]
    + (
        [
            CppExtension(
                name="c10d_ext._test_double",
                sources=build_sources.test_double_sources(),
                include_dirs=[os.path.join(ROOT, "include"), os.path.join(ROOT, "src")],
                define_macros=[("MYCCL_TORCH_VERSION", f'"{torch.__version__}"')],
                extra_compile_args={"cxx": cxx_flags},
            )
        ]
        if _build_tests()
        else []
    ),
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
    zip_safe=False,
)
