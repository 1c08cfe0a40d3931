#pragma once
// Where and in what precision compute runs (no CAF).
//
// - Devices: "cpu", "cuda", "cuda:N" or "auto" (cuda:0 where a GPU is usable, else cpu).
//   The CUDA parts need a LibTorch built with CUDA (TROUPE_TORCH_CUDA, set by CMake);
//   with Debian's CPU-only LibTorch asking for "cuda" is a clear error.
// - Precision: "fp32" or "bf16". bf16 runs each forward under autocast (matrix products
//   in bf16, reductions and the loss in fp32). As in Megatron's distributed optimizer the
//   model's parameters are bf16 values and the optimizer shards keep the fp32 main
//   parameters (and the moments): the shards all-gather their updated main parameters
//   rounded to bf16 (half the bytes of fp32), and a stage sets its bf16 parameters from
//   them (`model_slice::set_params`); its gradients accumulate in fp32 (Megatron's fp32
//   main_grad); checkpoints hold the main parameters.
// - Streams and events: each stage actor computes on a CUDA stream of its own; a tensor
//   handed to another actor carries an event recorded on the producer's stream, and the
//   consumer's stream waits on it (no host synchronisation, no copy). On CPU these are
//   no-ops.
// - Determinism (`deterministic = true`): LibTorch's deterministic algorithms, strict
//   (torch.use_deterministic_algorithms(True)), with the cuBLAS workspace setting they
//   need. On a GPU some default kernels are not run-to-run reproducible: LibTorch's fused
//   attention backwards (flash, memory-efficient) add partial sums with atomics, whose
//   rounding follows the order the thread blocks ran in, and cuBLAS guarantees the same
//   bits only with one stream active (or that setting): several stages computing at once
//   in one process change both. Strict mode takes deterministic kernels (slower) and
//   fails clearly on an op that has none.
#include <memory>
#include <string>

#include <torch/types.h>

namespace troupe {

/// Parses a device name; "auto" picks cuda:0 when a GPU is usable. Throws
/// std::invalid_argument for an unknown name or for cuda without a usable GPU.
torch::Device resolve_device(const std::string& name);
/// True when this build has CUDA support and at least one GPU is usable.
bool cuda_usable();
/// The GPUs this process can use (0 without CUDA support).
int cuda_device_count();
/// The device of a node process that is number `local_index` (from 0) of the node
/// processes on its machine, for a job on `name`: "cuda" (no index) becomes
/// "cuda:<local_index % gpus>", so that the node processes of a machine with several GPUs
/// each get one of their own (torchrun's LOCAL_RANK); with more node processes than GPUs
/// they share. Any other name (cpu, cuda:N, auto) is kept, as is "cuda" when gpus is 0
/// (resolve_device then gives its error).
std::string node_device(const std::string& name, int local_index, int gpus);
/// "fp32" -> kFloat32, "bf16" -> kBFloat16; throws std::invalid_argument otherwise.
torch::ScalarType parse_precision(const std::string& name);

/// Turns LibTorch's deterministic algorithms on (strict: no warn-only) or off for this
/// process, with cuDNN deterministic and its autotuner off. On: sets
/// CUBLAS_WORKSPACE_CONFIG to :4096:8 unless it is already :4096:8 or :16:8 (cuBLAS then
/// gives the same bits with several streams); throws std::invalid_argument when it is
/// set to anything else. Call before the process's first matrix product.
void use_deterministic_algorithms(bool on);

/// Runs the enclosed forward computation in `compute` precision (autocast on `device`'s
/// type) when that is not fp32; a no-op for fp32.
class precision_scope {
 public:
  precision_scope(torch::Device device, torch::ScalarType compute);
  ~precision_scope();
  precision_scope(const precision_scope&) = delete;
  precision_scope& operator=(const precision_scope&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType type_ = c10::DeviceType::CPU;
  bool prev_enabled_ = false;
  torch::ScalarType prev_dtype_ = torch::kFloat32;
};

/// While alive, a backward started on this thread runs every node of its graph on this
/// thread, CUDA ones included. LibTorch 2.x otherwise hands a backward's CUDA nodes to
/// one autograd thread per device and process, shared by every caller: two stage actors
/// whose backwards wait for each other in a collective (the expert all-to-all's) would
/// both queue on that one thread and wait forever, and the stages sharing a GPU would
/// launch all their backward kernels from it. With `on` false, or on LibTorch 1.13
/// (whose CPU backwards run on the caller already), it changes nothing.
class backward_on_this_thread {
 public:
  explicit backward_on_this_thread(bool on);
  ~backward_on_this_thread();
  backward_on_this_thread(const backward_on_this_thread&) = delete;
  backward_on_this_thread& operator=(const backward_on_this_thread&) = delete;

 private:
  bool set_ = false;
  bool prev_ = true;
};

/// The precision a precision_scope set for `device`'s type on this thread: the autocast
/// dtype while autocast is on, else kFloat32 (what a recomputation must run under again).
torch::ScalarType current_precision(torch::Device device);

/// An opaque "ready" marker for a tensor handed between actors: a CUDA event recorded
/// on the producing thread's current stream (empty on CPU).
using ready_event = std::shared_ptr<void>;

/// Records an event on the current stream of `t`'s device (nullptr for CPU tensors).
ready_event record_ready(const torch::Tensor& t);
/// Makes the current stream wait for `ev` and tells the caching allocator that `t` is
/// used on it (no-op for nullptr).
void wait_ready(const ready_event& ev, const torch::Tensor& t);

/// Gives the calling thread a CUDA stream of its own for `device` (from LibTorch's pool)
/// as its current stream; no-op for CPU. Call from the thread that computes (a detached
/// actor's own thread).
void use_own_stream(torch::Device device);

/// Blocks until every kernel queued on `device` is done (no-op for CPU).
void synchronize(torch::Device device);
/// Whether the calling thread's current stream of `device` has run all that was queued on
/// it (true for CPU).
bool stream_idle(torch::Device device);

/// A host tensor on `device`, without the host waiting for the device: bound for a GPU it
/// is copied into page-locked memory (LibTorch's caching host allocator, which keeps the
/// block until the copy has run) and the copy is queued on the current stream. A plain
/// `.to(device)` synchronises the current stream first: a stage receiving its next
/// micro-batch's input would wait for the kernels of the one before, and the GPU would
/// idle while the host launches the next forward. Elsewhere: `.to(device)`. For tensors
/// the caller owns (nothing else writes into `host` afterwards).
torch::Tensor to_device_async(const torch::Tensor& host, torch::Device device);

/// When a stage's ops ran on the GPU. A stage launches its kernels and goes on: the
/// host's time around an op is its launch, not its run. Each mark records a timing event
/// on the calling thread's current stream (at the point of the stream the caller reached);
/// once per step `anchor` places the stream on the caller's clock (it waits for the
/// stream's queued work and reads the clock: the anchor event completed then), and
/// `at_us` gives a mark's time on that clock (waiting for it if it has not completed).
/// Inactive on the CPU, whose ops run while the host calls them: marks are -1.
class gpu_op_clock {
 public:
  explicit gpu_op_clock(torch::Device device);
  ~gpu_op_clock();
  gpu_op_clock(const gpu_op_clock&) = delete;
  gpu_op_clock& operator=(const gpu_op_clock&) = delete;
  bool active() const { return impl_ != nullptr; }
  /// Drops the marks and anchors the stream at `now_us()` (read once its work is done).
  template <class Now>
  void anchor(Now now_us) {
    if (!active()) return;
    anchor_wait();
    anchor_us_ = now_us();
  }
  /// Records a mark on the current stream; its index (-1 when inactive).
  int mark();
  /// Mark `i`'s time on the anchor's clock, in microseconds.
  double at_us(int i);

 private:
  void anchor_wait();
  struct impl;
  std::unique_ptr<impl> impl_;
  double anchor_us_ = 0;
};

}  // namespace troupe
