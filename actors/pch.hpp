// Precompiled header for the actor runtime and everything above it: LibTorch and CAF.
#pragma once
#include "compute/pch.hpp"
#include <caf/all.hpp>
