#include "compute/runtime/device.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <c10/core/AutogradState.h>
#include <torch/cuda.h>
#include <torch/version.h>

#ifdef TROUPE_TORCH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace troupe {

bool cuda_usable() {
#ifdef TROUPE_TORCH_CUDA
  return torch::cuda::is_available();
#else
  return false;
#endif
}

int cuda_device_count() { return cuda_usable() ? int(torch::cuda::device_count()) : 0; }

std::string node_device(const std::string& name, int local_index, int gpus) {
  if (name != "cuda" || gpus <= 0) return name;
  return "cuda:" + std::to_string(std::max(0, local_index) % gpus);
}

torch::Device resolve_device(const std::string& name) {
  if (name == "auto") return cuda_usable() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (name == "cpu") return torch::kCPU;
  if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
#ifndef TROUPE_TORCH_CUDA
    throw std::invalid_argument("device '" + name + "': this build's LibTorch has no CUDA (build with launch/setup-gpu)");
#else
    if (!cuda_usable()) throw std::invalid_argument("device '" + name + "': no usable GPU");
    const int index = name == "cuda" ? 0 : std::stoi(name.substr(5));
    if (index < 0 || index >= int(torch::cuda::device_count()))
      throw std::invalid_argument("device '" + name + "': there are " + std::to_string(torch::cuda::device_count()) +
                                  " GPU(s)");
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
#endif
  }
  throw std::invalid_argument("unknown device '" + name + "' (expected auto, cpu, cuda or cuda:N)");
}

torch::ScalarType parse_precision(const std::string& name) {
  if (name == "fp32") return torch::kFloat32;
  if (name == "bf16") return torch::kBFloat16;
  throw std::invalid_argument("unknown precision '" + name + "' (expected fp32 or bf16)");
}

void use_deterministic_algorithms(bool on) {
  if (on) {
    const char* ws = std::getenv("CUBLAS_WORKSPACE_CONFIG");
    if (ws && std::strcmp(ws, ":4096:8") != 0 && std::strcmp(ws, ":16:8") != 0)
      throw std::invalid_argument(std::string("deterministic = true needs CUBLAS_WORKSPACE_CONFIG :4096:8 or :16:8 "
                                              "(cuBLAS's setting for the same bits with several streams), not '") +
                                  ws + "' (unset it, and it is set to :4096:8)");
    if (!ws) setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 1);
  }
  auto& ctx = at::globalContext();
  // Strict: LibTorch takes the deterministic attention backwards only then (warn-only
  // keeps the fast ones and warns).
  ctx.setDeterministicAlgorithms(on, /*warn_only=*/false);
  ctx.setDeterministicCuDNN(on);
  if (on) ctx.setBenchmarkCuDNN(false);
}

// LibTorch 2.4 made autocast's switches per device type; 1.13 (Debian) has one switch
// for CUDA and one for CPU.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
namespace {
bool autocast_enabled(c10::DeviceType t) { return at::autocast::is_autocast_enabled(t); }
void set_autocast(c10::DeviceType t, bool on) { at::autocast::set_autocast_enabled(t, on); }
torch::ScalarType autocast_dtype(c10::DeviceType t) { return at::autocast::get_autocast_dtype(t); }
void set_autocast_dtype(c10::DeviceType t, torch::ScalarType d) { at::autocast::set_autocast_dtype(t, d); }
}  // namespace
#else
namespace {
bool cpu(c10::DeviceType t) { return t == c10::DeviceType::CPU; }
bool autocast_enabled(c10::DeviceType t) { return cpu(t) ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled(); }
void set_autocast(c10::DeviceType t, bool on) { cpu(t) ? at::autocast::set_cpu_enabled(on) : at::autocast::set_enabled(on); }
torch::ScalarType autocast_dtype(c10::DeviceType t) {
  return cpu(t) ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
}
void set_autocast_dtype(c10::DeviceType t, torch::ScalarType d) {
  cpu(t) ? at::autocast::set_autocast_cpu_dtype(d) : at::autocast::set_autocast_gpu_dtype(d);
}
}  // namespace
#endif

torch::ScalarType current_precision(torch::Device device) {
  return autocast_enabled(device.type()) ? autocast_dtype(device.type()) : torch::kFloat32;
}

precision_scope::precision_scope(torch::Device device, torch::ScalarType compute) {
  if (compute == torch::kFloat32) return;
  active_ = true;
  type_ = device.type();
  prev_enabled_ = autocast_enabled(type_);
  prev_dtype_ = autocast_dtype(type_);
  set_autocast(type_, true);
  set_autocast_dtype(type_, compute);
  at::autocast::increment_nesting();
}

precision_scope::~precision_scope() {
  if (!active_) return;
  // Casts of the parameters are cached inside the outermost scope only: parameters
  // change between steps.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_autocast(type_, prev_enabled_);
  set_autocast_dtype(type_, prev_dtype_);
}

backward_on_this_thread::backward_on_this_thread(bool on) {
#if TORCH_VERSION_MAJOR >= 2
  if (!on) return;
  auto& state = c10::AutogradState::get_tls_state();
  prev_ = state.get_multithreading_enabled();
  state.set_multithreading_enabled(false);
  set_ = true;
#else
  (void)on;
#endif
}

backward_on_this_thread::~backward_on_this_thread() {
#if TORCH_VERSION_MAJOR >= 2
  if (set_) c10::AutogradState::get_tls_state().set_multithreading_enabled(prev_);
#endif
}

#ifdef TROUPE_TORCH_CUDA
ready_event record_ready(const torch::Tensor& t) {
  if (!t.defined() || !t.is_cuda()) return nullptr;
  auto ev = std::make_shared<at::cuda::CUDAEvent>();
  ev->record(c10::cuda::getCurrentCUDAStream(t.device().index()));
  return ev;
}

void wait_ready(const ready_event& ev, const torch::Tensor& t) {
  if (!ev || !t.defined() || !t.is_cuda()) return;
  auto stream = c10::cuda::getCurrentCUDAStream(t.device().index());
  static_cast<at::cuda::CUDAEvent*>(ev.get())->block(stream);
  c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
}

void use_own_stream(torch::Device device) {
  if (!device.is_cuda()) return;
  c10::cuda::set_device(device.index());
  c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromPool(false, device.index()));
}

void synchronize(torch::Device device) {
  if (device.is_cuda()) c10::cuda::device_synchronize();
}

bool stream_idle(torch::Device device) {
  return !device.is_cuda() || c10::cuda::getCurrentCUDAStream(device.index()).query();
}

struct gpu_op_clock::impl {
  c10::DeviceIndex device = 0;
  // Timing events (cudaEventDefault): the anchor, and the marks, reused step after step.
  at::cuda::CUDAEvent anchor{cudaEventDefault};
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> marks;
  std::size_t used = 0;
};

gpu_op_clock::gpu_op_clock(torch::Device device) {
  if (!device.is_cuda()) return;
  impl_ = std::make_unique<impl>();
  impl_->device = device.index();
}

void gpu_op_clock::anchor_wait() {
  impl_->used = 0;
  impl_->anchor.record(c10::cuda::getCurrentCUDAStream(impl_->device));
  impl_->anchor.synchronize();
}

int gpu_op_clock::mark() {
  if (!impl_) return -1;
  auto& m = impl_->marks;
  if (impl_->used == m.size()) m.push_back(std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault));
  m[impl_->used]->record(c10::cuda::getCurrentCUDAStream(impl_->device));
  return int(impl_->used++);
}

double gpu_op_clock::at_us(int i) {
  if (!impl_ || i < 0 || std::size_t(i) >= impl_->used) throw std::out_of_range("gpu_op_clock: no mark " + std::to_string(i));
  auto& ev = *impl_->marks[std::size_t(i)];
  ev.synchronize();
  return anchor_us_ + double(impl_->anchor.elapsed_time(ev)) * 1000.0;
}
#else
ready_event record_ready(const torch::Tensor&) { return nullptr; }
void wait_ready(const ready_event&, const torch::Tensor&) {}
void use_own_stream(torch::Device) {}
void synchronize(torch::Device) {}
bool stream_idle(torch::Device) { return true; }

struct gpu_op_clock::impl {};
gpu_op_clock::gpu_op_clock(torch::Device) {}
void gpu_op_clock::anchor_wait() {}
int gpu_op_clock::mark() { return -1; }
double gpu_op_clock::at_us(int i) { throw std::out_of_range("gpu_op_clock: no mark " + std::to_string(i)); }
#endif

gpu_op_clock::~gpu_op_clock() = default;

torch::Tensor to_device_async(const torch::Tensor& host, torch::Device device) {
  if (!device.is_cuda() || !host.device().is_cpu()) return host.to(device);
  return host.pin_memory().to(device, host.scalar_type(), /*non_blocking=*/true);
}

}  // namespace troupe
