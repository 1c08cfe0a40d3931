#pragma once
// A training job's configuration: workload defaults, then a TOML file, then flags. The
// keys, their flags, checks and help come from one table (key_defs in job_config.cpp);
// docs/configuration.md is generated from it (`troupe config-reference`).
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "compute/config/config_error.hpp"
#include "compute/config/fault_plan.hpp"
#include "compute/models/model.hpp"

namespace troupe {

/// Tokens one evaluation forward takes at most by default (`train.eval_tokens`; text: whole
/// windows, at least one): the validation windows go through the model a few at a time, so
/// evaluation holds the activations of those only. gpt-tiny's 32 windows of 128 tokens are
/// one forward; gpt-small's of 1024 go 8 at a time (all 32 at once held 9 GB on the CPU). A
/// test set of images is one forward.
constexpr std::int64_t eval_tokens_per_forward = 8192;

struct job_config {
  // [train]
  std::string workload = "gpt-tiny";  ///< gpt-tiny | gpt-small | llama-tiny | llama-small | moe-tiny | moe-small | fmnist-mlp
  int steps = 200;                    ///< also the lr schedule's length
  std::uint64_t seed = 1234;
  int threads = 0;                    ///< LibTorch intra-op threads (0: all hardware threads)
  int eval_interval = 50;             ///< validation every N steps (and at the end)
  std::string eval_mode = "pipeline"; ///< actors: pipeline (forward-only through the stages) | gather
  std::int64_t eval_tokens = eval_tokens_per_forward;  ///< tokens per evaluation forward (whole windows, at least one)
  std::string runtime = "actors";     ///< actors | local (the plain single-process loop)
  /// real | simulated (actors: the stages and shards run the schedule's ops as waits of a cost
  /// model's length, tensors as sizes without data; everything else as in a real run)
  std::string compute = "real";
  std::string simulated_device = "h100";  ///< simulated: the device model (compute/plan: h100, h200, a100, cpu)
  double simulated_time_scale = 1;        ///< simulated: each modelled wait times this (0.1: a 10 s step in 1 s)
  int simulated_nodes = 1;                ///< simulated: the ranks as this many nodes (failure domains) in one process
  int step_timeout = 300;             ///< seconds before an unfinished step is aborted
  double hang_factor = 4;             ///< no progress for this many recent median steps: a hang (0: off)
  int hang_min_seconds = 5;           ///< the hang watchdog's shortest limit
  bool checksum = false;              ///< CRC-32 on every activation / gradient payload
  std::string device = "auto";        ///< auto | cpu | cuda | cuda:N (auto: a GPU if usable)
  std::string precision = "fp32";     ///< fp32 | bf16 (autocast compute, bf16 param values, fp32 main params)
  bool deterministic = false;         ///< LibTorch's deterministic algorithms (strict; see compute/runtime/device.hpp)
  bool fp32_residual = false;         ///< bf16 decoders: the residual stream (and layer norms' input/output) in fp32 (autocast's); false: in bf16, as Megatron's default
  std::string recompute = "none";     ///< none | selective | full (gpt: the attention core's or each block's activations recomputed in the backward)
  int max_skipped_steps = 10;         ///< NaN/inf gradients: updates skipped before the run stops
  int max_step_retries = 2;           ///< in-place retries of a failed step (no node process lost)
  int rejoin_timeout = 60;            ///< seconds to wait for a restarted node process to rejoin
  /// A Hugging Face folder whose config.json gives the model (family and shape: the
  /// [model] keys that are not set) and whose weights are the initial ones (unless init,
  /// load or resume give others). Set [model] keys must agree with it.
  std::string hf_model;
  // [model]: the decoder workloads' architecture and shape (0 / "": the workload's own;
  // d_ff 0: the workload's d_ff scaled with d_model)
  std::string architecture;            ///< gpt2 | llama | mistral | qwen2 | qwen3 ("": the workload's)
  int layers = 0, heads = 0, kv_heads = 0, d_model = 0, d_ff = 0, seq_len = 0, vocab = 0;
  int head_dim = 0;                    ///< a head's width (0: d_model / heads)
  int sliding_window = 0;              ///< mistral: keys a query sees, itself included (0: all)
  double rope_theta = 0, norm_eps = 0;
  std::string tie_embeddings = "auto"; ///< auto (the architecture's: gpt2 tied, llama not) | true | false
  int experts = 0, moe_top_k = 0, moe_d_ff = 0, moe_every = 0;  ///< mixture of experts (0: the workload's)
  double moe_aux_loss_coeff = -1;     ///< the load-balancing loss's coefficient (negative: the workload's)
  double moe_capacity_factor = 0;     ///< experts: capacity factor in training (0: no token dropped)
  // [parallel]
  int pipeline = 1;
  int data_parallel = 1;
  int tensor_parallel = 1;            ///< ranks each layer is split over (Megatron's tensor parallelism)
  bool sequence_parallel = false;     ///< tensor_parallel > 1: norms and residuals hold 1/T of the sequence
  int expert_parallel = 1;            ///< ranks each expert layer's experts are spread over (divides data_parallel)
  int context_parallel = 1;           ///< ranks each sequence is split over (2C chunks, causal balance)
  std::string context_parallel_comm = "p2p";  ///< p2p (ring) | a2a (Ulysses) | allgather
  std::string shard = "optimizer";    ///< what the data-parallel group shards: optimizer | gradients | parameters
  int shard_group = 0;                ///< ranks a shard group spans (hybrid sharding; 0: the whole group)
  std::string fsdp_unit = "block";    ///< shard = gradients | parameters: block | chunk (what is gathered and reduced at once)
  bool fsdp_prefetch = true;          ///< shard = parameters: the next unit's gather started while one computes
  int microbatches = 8;               ///< per replica per step
  int chunks = 1;
  std::string schedule = "1f1b";      ///< gpipe | 1f1b | interleaved-1f1b | zero-bubble | combined-1f1b | zbv | dualpipev | dataflow
  int max_in_flight = 0;              ///< dataflow: micro-batches in flight per stage (0: p)
  bool split_backward = false;        ///< dataflow: backward split into B and W, a W run when nothing else
                                      ///< can and it is due (zero-bubble always splits)
  /// combined-1f1b, dualpipev with expert parallelism (actors, CPU): a pair's forward and
  /// backward compute at once, one's all-to-alls waiting while the other computes
  /// (false: one after the other, faster on few cores when the all-to-all is quick)
  bool overlap_pairs = true;
  int credit_window = 0;              ///< micro-batches a loader sends ahead of consumption (0: the whole step's)
  std::int64_t bucket_size = 40000000;  ///< d > 1: gradient buckets of at least this many elements per
                                        ///< chunk, reduce-scattered during the last backward (0: one
                                        ///< bucket; Megatron's default size)
  std::vector<int> split;             ///< explicit layers per virtual stage
  // [optimizer]
  double lr = 1e-3, min_lr = 1e-4;
  int warmup = 20;
  double weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double clip = 1.0;                  ///< global-norm clip; 0 disables
  // [data]
  int global_batch = 32;
  std::string fortunes_dir = "/usr/share/games/fortunes";
  std::string text;                   ///< gpt: a corpus of one's own (file or folder) instead of fortunes
  std::string val_text;               ///< with text: the validation text (then all of `text` trains)
  std::string tokenizer;              ///< decoders: a SentencePiece model, a tokenizer.json or a model folder ("": bytes)
  std::vector<std::string> data;      ///< documents: JSON lines, files, folders, Megatron prefixes, in order
  std::vector<std::string> val_data;  ///< with data: the validation documents (then all of data trains)
  std::string data_field = "text";    ///< JSON lines: the field that holds a document
  bool document_attention = false;    ///< with data: attention and positions reset at each document's start
  std::string cache_dir;              ///< the token cache's folder ("": $XDG_CACHE_HOME/troupe or ~/.cache/troupe)
  std::string fmnist_dir = "/usr/share/datasets/fashion-mnist";
  // [output]
  std::string metrics, save, load, init;
  int checkpoint_interval = 0;        ///< also save every N steps (0: only at the end)
  std::string checkpoint_dir;         ///< checkpoint folders (every checkpoint_interval, end)
  int keep_checkpoints = 3;           ///< newest step folders kept in checkpoint_dir
  bool checkpoint_async = true;       ///< interim folders: a host-memory snapshot, written while training goes on
  int checkpoint_async_memory = 0;    ///< MiB a node's snapshots may hold (0: half of its available memory)
  std::string resume;                 ///< checkpoint folder to continue from, or "auto"
  bool strict_resume = false;         ///< a newest checkpoint that does not verify: refused, not passed over
  std::string trace;                  ///< Chrome trace JSON of every executed op
  // [faults] (testing): parsed and checked by fault_plan (compute/config/fault_plan.hpp)
  std::string throw_at;               ///< "replica:stage:step[:late|:eval]": that stage throws
  int nan_at = -1;                    ///< step whose losses are made NaN (-1: none)
  std::string kill_node;              ///< "node:step[+node:step]": that node's process SIGKILLs itself
  std::string freeze_node;            ///< "node:step[+node:step]": that simulated node goes silent (frozen or cut off)
  std::string message;                ///< "ACTION[=SECONDS]@replica:stage:step[:loss|:eval]"
  std::string stall;                  ///< "stage:rank:step": that shard never starts its reduce-scatter
  std::string freeze;                 ///< "replica:stage:step[:SECONDS]": that stage's thread blocks
  std::string kill_in_write;          ///< "node:step[:SECONDS]": that node dies during its background checkpoint write
  int fault_attempt = 0;              ///< the launch (0: first, 1: first restart, ...) they fire in
  /// The [faults] keys, for fault_plan::parse.
  fault_keys faults() const {
    return {throw_at, nan_at, kill_node, message, stall, freeze, fault_attempt, pipeline, kill_in_write, freeze_node};
  }

  /// The defaults of a workload of WORKLOADS.md.
  static job_config defaults_for(const std::string& workload);

  /// Sets one key ("optimizer.lr" or just "lr") from text; throws config_error.
  void set(const std::string& key, const std::string& value, const std::string& origin);
  /// Throws config_error for contradictions (batch not divisible, bad schedule, ...).
  void validate() const;

  /// True when a [model] key is set (not 0): the shape differs from the workload's own.
  bool has_model_keys() const {
    return !architecture.empty() || layers || heads || kv_heads || d_model || d_ff || seq_len || vocab || head_dim ||
           sliding_window || rope_theta ||
           norm_eps || tie_embeddings != "auto" || experts || moe_top_k || moe_d_ff || moe_every ||
           moe_aux_loss_coeff >= 0 || moe_capacity_factor > 0;
  }
  /// Where the initial weights come from: init, else the hf_model folder ("" : initial_state).
  const std::string& initial_weights() const { return init.empty() ? hf_model : init; }
  /// Sets the [model] keys from the hf_model folder's config.json; throws config_error for
  /// a set key that disagrees (naming both values), a folder that cannot be read, a
  /// family Troupe lacks, or a seq_len above its positions.
  void take_model_from_folder();
  /// Whether the job trains on documents (data.data) rather than a text stream.
  bool uses_documents() const { return !data.empty(); }
  /// The tokenizer of the text or documents: data.tokenizer, else (documents) the
  /// train.model folder's ("": none, the text's bytes).
  std::string text_tokenizer() const;
  /// A decoder workload (not fmnist-mlp).
  bool is_decoder() const { return workload != "fmnist-mlp"; }
  /// The model to train: the workload's (or the hf_model folder's), with the [model] keys
  /// that are set applied.
  model_spec model() const;
  /// The hf_model folder's decoder, with what no [model] key holds (rope scaling, GELU's
  /// form, the experts' routing and places); set by take_model_from_folder.
  std::optional<decoder_config> folder_decoder;
  /// For the start-of-training log line: the workload, and its shape and parameter count
  /// when [model] keys change it ("gpt-tiny (4 layers, d_model 64, 2 heads, ...)").
  std::string model_label() const;
  /// " on the text in PATH" for data.text (", validated on VAL" with data.val_text), else
  /// "" (the workload's own data).
  std::string data_label() const;
  int microbatch_size() const { return global_batch / (data_parallel * microbatches); }
  /// For the start-of-training log line: ", bf16, recompute full, deterministic" (what
  /// differs from fp32 without recomputation; empty otherwise).
  std::string compute_note() const {
    return (precision != "fp32" ? ", " + precision : "") + (recompute != "none" ? ", recompute " + recompute : "") +
           (precision != "fp32" && fp32_residual ? ", fp32 residual" : "") + (deterministic ? ", deterministic" : "");
  }
  /// For the start-of-training log line: "tensor-parallel 2 (sequence parallel) x " and/or
  /// "expert-parallel 2 (2 of the 4 experts on each rank) x " (empty without either).
  std::string model_parallel_label() const {
    std::string out;
    if (context_parallel > 1)
      out = "context-parallel " + std::to_string(context_parallel) + " (" + context_parallel_comm + ") x ";
    if (tensor_parallel > 1)
      out += "tensor-parallel " + std::to_string(tensor_parallel) + (sequence_parallel ? " (sequence parallel)" : "") +
             " x ";
    if (expert_parallel > 1) {
      const int e = model().decoder.n_experts;
      out += "expert-parallel " + std::to_string(expert_parallel) + " (" + std::to_string(e / expert_parallel) +
             " of the " + std::to_string(e) + " experts on each rank) x ";
    }
    return out;
  }
  /// For the start-of-training log line: "1f1b", "dataflow, split backward".
  std::string schedule_label() const {
    return schedule + (schedule == "dataflow" && split_backward ? ", split backward" : "");
  }
  /// The whole configuration as TOML (what a run actually used).
  std::string to_toml() const;
  /// Every key with its value as text (TOML syntax), in to_toml()'s order.
  std::vector<std::pair<std::string, std::string>> values() const;
};

/// One configurable key: its full dotted name and a one-line help text.
struct config_key {
  std::string name;
  std::string help;
  bool list = false;  ///< a list of strings (TOML array; the flag repeats or takes several values)
  std::string flag() const;  ///< "--data-parallel" for "parallel.data_parallel"
};
const std::vector<config_key>& config_keys();
/// Every key with its flag, gpt-tiny's default and its help, as Markdown (docs/configuration.md).
std::string config_reference();

/// Defaults for the workload (flag > file > gpt-tiny), then the TOML file (if any),
/// then `overrides` (key, value) in order; validated.
job_config load_job_config(const std::string& toml_path,
                           const std::vector<std::pair<std::string, std::string>>& overrides);
/// Whether `nodes` node processes can host the p x d x t stage actors in equal shares,
/// each holding whole tensor-parallel groups or an equal part of one (node_slots).
bool nodes_fit(int p, int d, int t, int nodes);
/// A job's layout on fewer nodes (launch/troupe --min-nodes: a job that lost hosts goes on
/// without them from its newest checkpoint).
struct elastic_layout {
  int nodes = 0, data_parallel = 0, microbatches = 0;
};
/// The layout for at most `max_nodes` and at least `min_nodes` nodes: the same pipeline,
/// global batch and micro-batch size; data_parallel' <= the job's replicas with
/// global_batch / (micro-batch size x data_parallel') micro-batches each; nodes_fit (the
/// node count dividing pipeline x data_parallel', or with tensor parallelism spreading
/// each group over the same number of nodes). The most nodes first, then the most replicas (the job's own layout when it
/// fits: then the step's arithmetic is the same). Throws config_error when none fits.
elastic_layout shrink_layout(const job_config& cfg, int max_nodes, int min_nodes);
/// The configuration written by job_config::to_toml() (sent to the nodes of a job).
job_config job_config_from_toml(const std::string& text, const std::string& origin);

}  // namespace troupe
