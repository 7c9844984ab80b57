"""Run every benchmark, one process each, then write the tables from their JSON (`report.py`).

Each script writes ``results/<platform>-jax<version>/<name>.json``; the same command runs unchanged on CPU
and GPU. Run: ``python benchmarks/run_all.py`` (about 20 minutes on 2 CPU cores); ``--only gsgd scale``
runs some of them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
SCRIPTS = tuple(
    "trace gsgd path_sgd ddp kernels buffers eager ddp_norm scale depth memory collectives flax_examples".split()
)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=SCRIPTS, default=SCRIPTS)
    args = ap.parse_args(argv)
    for name in args.only:
        t0 = time.perf_counter()
        print(f"== bench_{name}.py", flush=True)
        subprocess.run([sys.executable, str(HERE / f"bench_{name}.py")], check=True)
        print(f"== bench_{name}.py: {time.perf_counter() - t0:.0f} s", flush=True)
    subprocess.run([sys.executable, str(HERE / "report.py")], check=True)


if __name__ == "__main__":
    main()
