"""``python -m mstar_rt --cmake-prefix``: where C++ projects find ``find_package(mstar_rt)``."""

from __future__ import annotations

import argparse
import pathlib
import sys


def cmake_prefix() -> pathlib.Path:
    """The folder holding mstar_rtConfig.cmake (use it as CMAKE_PREFIX_PATH or mstar_rt_DIR)."""
    return pathlib.Path(__file__).resolve().parent / "cmake"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mstar_rt")
    one = parser.add_mutually_exclusive_group()  # both printed only the first
    one.add_argument("--cmake-prefix", action="store_true",
                     help="print the CMAKE_PREFIX_PATH entry for find_package(mstar_rt CONFIG)")
    one.add_argument("--include-dir", action="store_true", help="print the C++ include folder")
    args = parser.parse_args(argv)
    if not (args.cmake_prefix or args.include_dir):
        parser.print_help()
        return 0
    path = cmake_prefix() if args.cmake_prefix else cmake_prefix().parent / "include"
    marker = path / ("mstar_rtConfig.cmake" if args.cmake_prefix else "mstar")
    if not marker.exists():  # a source checkout on PYTHONPATH holds neither
        print(f"python -m mstar_rt: {marker} does not exist: this mstar_rt "
              f"({cmake_prefix().parent}) is not an installed build; install it (pip install .) "
              "or point CMake at your build folder", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
