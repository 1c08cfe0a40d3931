// Precompiled header for everything that uses LibTorch (see CMakeLists.txt).
#pragma once
#include <torch/torch.h>
#include <spdlog/spdlog.h>
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>
