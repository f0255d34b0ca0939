# Builds c10d_ext._C with torch's BuildExtension (ninja). The NCCL engine (src/cuda) is built
# when torch is a CUDA build and NCCL's header and library are found; MYCCL_WITH_NCCL=1 forces
# it on (and fails loudly if anything is missing), MYCCL_WITH_NCCL=0 forces it off.
import glob
import os
import sys

from setuptools import setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _site_packages_dirs():
    # nvidia-* wheels install as namespace packages under site-packages/nvidia/...
    import site

    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    dirs.append(os.path.dirname(os.path.dirname(torch.__file__)))
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _find(rel):
    for base in _site_packages_dirs():
        path = os.path.join(base, rel)
        if os.path.exists(path):
            return path
    return None


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
    # nvidia-cuda-crt / nvidia-cuda-cccl wheels (or a CUDA toolkit) do.
    cuda_inc = None
    for cand in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
        p = _find(os.path.join(cand, "cuda_runtime.h"))
        if p:
            cuda_inc = os.path.dirname(p)
            break
    if cuda_inc is None:
        home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
        if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            cuda_inc = os.path.join(home, "include")
    if cuda_inc is None:
        problems.append("cuda_runtime.h not found (pip install nvidia-cuda-crt nvidia-cuda-cccl)")
    elif not os.path.exists(os.path.join(cuda_inc, "crt", "host_defines.h")):
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

    inc = [os.path.dirname(nccl_h), cuda_inc]
    cccl = os.path.join(cuda_inc, "cccl")
    if os.path.isdir(cccl):
        inc.append(cccl)
    lib_dirs = [os.path.dirname(nccl_so)]
    libs = [":libnccl.so.2", "c10_cuda", "torch_cuda"]
    if cudart:
        lib_dirs.append(os.path.dirname(cudart))
        libs.append(":" + os.path.basename(cudart))
    else:
        libs.append("cudart")
    return inc, lib_dirs, libs


def _sources(with_nccl):
    srcs = sorted(glob.glob("src/**/*.cpp", recursive=True))
    if not with_nccl:
        srcs = [s for s in srcs if not s.startswith("src/cuda/")]
    return srcs


def _torch_minor():
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


nccl = _nccl_config()
define_macros = [
    ("MYCCL_TORCH_VERSION", f'"{torch.__version__}"'),
    ("MYCCL_TORCH_MINOR", f'"{_torch_minor()}"'),
]
include_dirs = [os.path.join(ROOT, "include"), os.path.join(ROOT, "src")]
library_dirs, libraries, rpaths = [], [], []
if nccl is not None:
    inc, lib_dirs, libs = nccl
    include_dirs += inc
    library_dirs += lib_dirs
    libraries += libs
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


def _write_build_info():
    info = {
        "torch_version": torch.__version__,
        "torch_minor": _torch_minor(),
        "with_nccl": nccl is not None,
        "nccl_build_header": None,
        "cxx_flags": cxx_flags,
        "python": sys.version.split()[0],
    }
    if nccl is not None:
        hdr = os.path.join(nccl[0][0], "nccl.h")
        ver = {}
        with open(hdr) as f:
            for line in f:
                for key in ("NCCL_MAJOR", "NCCL_MINOR", "NCCL_PATCH"):
                    if line.startswith(f"#define {key} "):
                        ver[key] = line.split()[2]
        info["nccl_build_header"] = ".".join(ver.get(k, "?") for k in ("NCCL_MAJOR", "NCCL_MINOR", "NCCL_PATCH"))
    with open(os.path.join(ROOT, "c10d_ext", "_build_info.py"), "w") as f:
        f.write("# Written by setup.py at build time; do not edit.\n")
        f.write(f"BUILD_INFO = {info!r}\n")


_write_build_info()

setup(
    name="c10d_ext",
    version="0.1.0",
    description="myccl: a fast, debuggable torch.distributed backend (shared memory / TCP on CPU, NCCL on CUDA)",
    packages=["c10d_ext", "c10d_ext.trace"],
    python_requires=">=3.10",
    ext_modules=[
        CppExtension(
            name="c10d_ext._C",
            sources=_sources(nccl is not None),
            include_dirs=include_dirs,
            library_dirs=library_dirs,
            libraries=libraries,
            runtime_library_dirs=rpaths,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-Wl,--as-needed"] if nccl is None else [],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
