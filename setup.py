"""pip install --no-build-isolation .

Builds libheadscope.so with CMake (CMakeLists.txt is the one source of truth for
sources and flags) and installs it inside the Python package ``headscope``
(source folder ``ops/``). ``--no-build-isolation`` makes the build use the torch that
is already installed instead of downloading another one.

Environment:
  HEADSCOPE_BUILD_DIR   CMake build folder to use or reuse (default: build)
  HEADSCOPE_CMAKE_ARGS  extra arguments for the first configure, e.g. -DHEADSCOPE_CUDA=OFF
  MAX_JOBS              parallel compile jobs
"""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeBuild(build_ext):
    def get_ext_filename(self, fullname):
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext):
        build_dir = Path(os.environ.get("HEADSCOPE_BUILD_DIR", ROOT / "build")).resolve()
        if not (build_dir / "CMakeCache.txt").exists():
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            subprocess.check_call(
                ["cmake", "-S", str(ROOT), "-B", str(build_dir), *generator,
                 f"-DPython3_EXECUTABLE={sys.executable}",
                 *shlex.split(os.environ.get("HEADSCOPE_CMAKE_ARGS", ""))])
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "headscope",
                               "--parallel", jobs])
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build_dir / "libheadscope.so", target)


setup(
    name="headscope",
    version="0.1.0",
    description="Attention introspection ops for PyTorch: VAS features, vStream attribution, "
                "KL projection and thin mixer",
    # every folder of ops/ with an __init__.py, so a new subpackage cannot be left out
    packages=["headscope"] + ["headscope." + p for p in find_packages("ops")],
    package_data={"headscope.shapes": ["data/*", "data/mixer/*", "data/video/*"]},
    package_dir={"headscope": "ops"},
    # The library is a plain shared object loaded with torch.ops.load_library, not a
    # Python extension module: its file name carries no ABI tag.
    ext_modules=[Extension("headscope.lib.libheadscope", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch>=2.9", "numpy"],
    # headscope.hf (the Tracer): the version requirements.txt pins is the one tested.
    # (matplotlib: the span PNGs of python -m headscope explain)
    extras_require={"hf": ["transformers>=5.24,<6", "safetensors", "pillow", "torchvision",
                           "tqdm", "greenlet>=3", "matplotlib", "pyarrow"],
                    # the live page of python -m headscope explain --serve
                    "app": ["transformers>=5.24,<6", "safetensors", "pillow", "torchvision",
                            "tqdm", "greenlet>=3", "matplotlib", "gradio>=6"],
                    # --quantize int8|int4 of python -m headscope explain|collect|vas
                    "quantize": ["optimum-quanto>=0.2.7", "accelerate>=1.16"],
                    # videos for python -m headscope explain --video (FFmpeg's libraries too)
                    "video": ["torchcodec"],
                    # the embedded model and its demo (python -m headscope.shapes)
                    "shapes": ["transformers>=5.24,<6", "safetensors", "pillow", "torchvision",
                               "tqdm", "greenlet>=3", "matplotlib"]},
    zip_safe=False,
)
