#pragma once
// Precompiled for transport/ (LibTorch is the heavy header).
#include <torch/torch.h>
