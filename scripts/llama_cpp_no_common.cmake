# Included by llama.cpp's own project() call when llama-cpp-python's wheel is compiled in the llama.cpp tree
# of the rapidspec cache (rapidspec/bench/llama_cpp_tree.py, run by scripts/install.py; CMAKE_PROJECT_llama.cpp_INCLUDE):
# llama.cpp's "common" library, which llama-cpp-python's CMakeLists forces on, is not built. llama-cpp-python
# loads only libllama and libggml*, and common was half the compilation (CPU time measured on 2026-11-26: 8 min
# 12 s with it, 4 min 11 s without), so the demo's set-up is about two minutes shorter on 2 cores. llama-server's
# build in the same build folder drops this include (-U), and common is built then, for the server alone. Under
# another project name this file is not included and the build is as before.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama.cpp common library (not loaded by llama-cpp-python)" FORCE)
