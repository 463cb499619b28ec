# Installs headers, the static core library and a CMake package config, so that a C++ project
# finds the core with find_package(mstar_rt CONFIG). Inside a wheel everything goes under the
# mstar_rt/ package folder.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

if(DEFINED SKBUILD)
  # In a wheel: mstar_rt/{include,lib} and the config in mstar_rt/cmake/, which CMake finds as
  # <prefix>/mstar_rtConfig.cmake with prefix = `python -m mstar_rt --cmake-prefix`.
  set(MSTAR_INCLUDE_DIR "mstar_rt/include")
  set(MSTAR_LIB_DIR "mstar_rt/lib")
  set(MSTAR_CMAKE_DIR "mstar_rt/cmake")
else()
  set(MSTAR_INCLUDE_DIR "${CMAKE_INSTALL_INCLUDEDIR}")
  set(MSTAR_LIB_DIR "${CMAKE_INSTALL_LIBDIR}")
  set(MSTAR_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/mstar_rt")
endif()

install(TARGETS mstar_core EXPORT mstar_rtTargets
        ARCHIVE DESTINATION ${MSTAR_LIB_DIR}
        INCLUDES DESTINATION ${MSTAR_INCLUDE_DIR})
install(DIRECTORY cpp/include/mstar DESTINATION ${MSTAR_INCLUDE_DIR})
install(EXPORT mstar_rtTargets NAMESPACE mstar_rt:: DESTINATION ${MSTAR_CMAKE_DIR})

configure_package_config_file(cmake/mstar_rtConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/mstar_rtConfig.cmake INSTALL_DESTINATION ${MSTAR_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/mstar_rtConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/mstar_rtConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/mstar_rtConfigVersion.cmake
        DESTINATION ${MSTAR_CMAKE_DIR})
