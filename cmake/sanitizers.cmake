# MSTAR_SANITIZE=thread | address: instrument everything built in this tree (core, tests).
if(MSTAR_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -g -O1)
  add_link_options(-fsanitize=thread)
elseif(MSTAR_SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-sanitize-recover=undefined
                      -fno-omit-frame-pointer -g -O1)
  add_link_options(-fsanitize=address,undefined)
elseif(NOT MSTAR_SANITIZE STREQUAL "")
  message(FATAL_ERROR "MSTAR_SANITIZE must be '', 'thread' or 'address', got '${MSTAR_SANITIZE}'")
endif()
