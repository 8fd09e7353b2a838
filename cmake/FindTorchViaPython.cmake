# Lets find_package(Torch) see the Python torch's own CMake config when no LibTorch
# folder was given through CMAKE_PREFIX_PATH or Torch_DIR. Nothing is hard-coded:
# the path comes from torch.utils.cmake_prefix_path of the interpreter in use.
if(NOT Torch_DIR)
  find_package(Torch QUIET CONFIG)
endif()
if(NOT Torch_FOUND AND NOT Torch_DIR)
  if(NOT Python3_EXECUTABLE)
    find_package(Python3 REQUIRED COMPONENTS Interpreter)
  endif()
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _torch_rc)
  if(NOT _torch_rc EQUAL 0)
    message(FATAL_ERROR "torch not found: give a LibTorch folder in CMAKE_PREFIX_PATH, "
                        "or set Python3_EXECUTABLE to a Python that has torch installed")
  endif()
  list(APPEND CMAKE_PREFIX_PATH "${_torch_prefix}")
endif()
