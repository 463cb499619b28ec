"""Holds mstar_rtConfig.cmake in an installed wheel; the ``cmake.root`` entry point names this
package so scikit-build-core projects find ``find_package(mstar_rt CONFIG)`` with no set-up.
Importing it never loads the compiled core."""
