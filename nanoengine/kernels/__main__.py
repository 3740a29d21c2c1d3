"""`python -m nanoengine.kernels`: build the CPU kernels now (make assets runs this). Chapters 03 and 06.

Where they cannot be built it prints one line saying why and how to get them, and exits 0: the engine runs on
torch's ops, so `make assets`, `make demo` and `make lab` go on. A failed build is remembered; `--retry`
forgets it (and the compiler probe) and builds again; `--require` exits 1 when the kernels are not there
(for CI and a kernel developer).
"""

import argparse
import sys

from nanoengine.kernels import cpu

parser = argparse.ArgumentParser(prog="python -m nanoengine.kernels", description=__doc__.splitlines()[0])
parser.add_argument("--retry", action="store_true", help="forget a failed build and the probe; try again")
parser.add_argument("--require", action="store_true", help="exit 1 when the kernels cannot be built")
args = parser.parse_args()
if args.retry:
    cpu.forget_failure()
try:
    cpu.load()
except cpu.KernelBuildError as e:
    print(cpu.fallback_line(e.problem), file=sys.stderr)
    sys.exit(1 if args.require else 0)
threads = "" if cpu.has_openmp() else " (this compiler has no OpenMP: they run on one thread)"
print(f"nanoengine CPU kernels: ready in {cpu.build_dir()}{threads}")
