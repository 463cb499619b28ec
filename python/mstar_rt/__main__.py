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
    if args.cmake_prefix:
        print(cmake_prefix())
    elif args.include_dir:
        print(cmake_prefix().parent / "include")
    else:
        parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
