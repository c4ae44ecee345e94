# Install rules of the C++ client SDK (component "sdk"): the static library shardserve::client, the
# generated protocol code it links, its public header, and a CMake package so that another project
# can do
#   find_package(shardserve CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE shardserve::client)
#   cmake --install build --component sdk --prefix /opt/shardserve
include(CMakePackageConfigHelpers)

set(SHARDSERVE_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/shardserve)

# The client links the generated code privately, so only its archive is installed; the public
# header has no protobuf types. shardserve_proto's include directory is a build-tree path, which
# only builds in this tree may see.
get_target_property(_shardserve_proto_includes shardserve_proto INTERFACE_INCLUDE_DIRECTORIES)
set_target_properties(shardserve_proto PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES "$<BUILD_INTERFACE:${_shardserve_proto_includes}>"
  INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "$<BUILD_INTERFACE:${_shardserve_proto_includes}>"
  EXPORT_NAME proto)

install(TARGETS shardserve_client shardserve_proto EXPORT shardserveTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT sdk
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${PROJECT_SOURCE_DIR}/sdk/cpp/include/shardserve/client.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/shardserve COMPONENT sdk)
install(EXPORT shardserveTargets NAMESPACE shardserve:: DESTINATION ${SHARDSERVE_INSTALL_CMAKEDIR} COMPONENT sdk)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/shardserveConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cmake/shardserveConfig.cmake INSTALL_DESTINATION ${SHARDSERVE_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cmake/shardserveConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cmake/shardserveConfig.cmake ${PROJECT_BINARY_DIR}/cmake/shardserveConfigVersion.cmake
  DESTINATION ${SHARDSERVE_INSTALL_CMAKEDIR} COMPONENT sdk)
