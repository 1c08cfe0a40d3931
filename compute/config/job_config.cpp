#include "compute/config/job_config.hpp"
#include "compute/parallel/context_parallel.hpp"
#include "compute/optim/fsdp.hpp"
#include "compute/parallel/tensor_parallel.hpp"
#include "compute/models/tensor_parallel_layout.hpp"
#include "compute/data/tokenizer.hpp"
#include "compute/data/documents.hpp"
#include "compute/checkpoint/hf_folder.hpp"

#include "compute/runtime/device.hpp"
#include "compute/config/fault_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <sstream>

#include <toml++/toml.h>

#include "compute/schedule/schedule.hpp"

namespace troupe {

namespace {

struct key_def {
  config_key key;
  std::function<void(job_config&, const std::string&)> set;
  std::function<std::string(const job_config&)> get;
};

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument(what); }

long long parse_int(const std::string& v) {
  std::size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (...) {
    bad("expected an integer");
  }
  if (used != v.size()) bad("expected an integer");
  return x;
}

double parse_double(const std::string& v) {
  std::size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (...) {
    bad("expected a number");
  }
  if (used != v.size() || !std::isfinite(x)) bad("expected a finite number");
  return x;
}

std::string fmt_double(double x) {
  std::ostringstream o;
  o.precision(17);
  o << x;
  return o.str();
}

template <class T>
key_def int_key(std::string name, std::string help, T job_config::*field, long long lo, long long hi) {
  return {{name, help},
          [=](job_config& c, const std::string& v) {
            const auto x = parse_int(v);
            if (x < lo || x > hi)
              bad("must be between " + std::to_string(lo) + " and " + std::to_string(hi));
            c.*field = static_cast<T>(x);
          },
          [=](const job_config& c) { return std::to_string(c.*field); }};
}

key_def double_key(std::string name, std::string help, double job_config::*field, double lo, double hi) {
  return {{name, help},
          [=](job_config& c, const std::string& v) {
            const auto x = parse_double(v);
            if (x < lo || x > hi) bad("must be between " + fmt_double(lo) + " and " + fmt_double(hi));
            c.*field = x;
          },
          [=](const job_config& c) { return fmt_double(c.*field); }};
}

key_def bool_key(std::string name, std::string help, bool job_config::*field) {
  return {{name, help + " (true/false)"},
          [=](job_config& c, const std::string& v) {
            if (v != "true" && v != "false") bad("expected true or false");
            c.*field = v == "true";
          },
          [=](const job_config& c) { return std::string(c.*field ? "true" : "false"); }};
}

/// `s` as a TOML basic string: in double quotes, with quotes, backslashes and control
/// characters escaped. A string without those reads as it always did ("gpt-tiny"):
/// checkpoint manifests hold these texts and a resumed run compares them.
std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\f': out += "\\f"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char code[8];
          std::snprintf(code, sizeof code, "\\u%04x", c);
          out += code;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

/// A list of strings: set from the lines of a value (a TOML array or repeated flags are
/// joined with newlines), shown as a TOML array.
key_def list_key(std::string name, std::string help, std::vector<std::string> job_config::*field) {
  return {{name, help, true},
          [=](job_config& c, const std::string& v) {
            (c.*field).clear();
            std::stringstream in(v);
            std::string item;
            while (std::getline(in, item, '\n'))
              if (!item.empty()) (c.*field).push_back(item);
          },
          [=](const job_config& c) {
            std::string s = "[";
            for (std::size_t i = 0; i < (c.*field).size(); ++i) s += (i ? ", " : "") + toml_string((c.*field)[i]);
            return s + "]";
          }};
}

key_def string_key(std::string name, std::string help, std::string job_config::*field) {
  return {{name, help},
          [=](job_config& c, const std::string& v) { c.*field = v; },
          [=](const job_config& c) { return toml_string(c.*field); }};
}

const char* const workload_names = "gpt-tiny, gpt-small, llama-tiny, llama-small, moe-tiny, moe-small or fmnist-mlp";

const std::vector<key_def>& key_defs() {
  static const std::vector<key_def> defs = {
      string_key("train.workload", "gpt-tiny, gpt-small, llama-tiny, llama-small, moe-tiny, moe-small or fmnist-mlp",
                 &job_config::workload),
      {{"train.model",
        "a Hugging Face folder (config.json and its weights): the family and shape of the model (the [model] keys "
        "left unset; those set must agree) and its initial weights (unless init, load or resume give others); "
        "seq_len stays the job's (gpt2: its n_positions)"},
       [](job_config& c, const std::string& v) { c.hf_model = v; },
       [](const job_config& c) { return toml_string(c.hf_model); }},
      int_key("train.steps", "optimizer steps (also the lr schedule's length)", &job_config::steps, 1, 10000000),
      int_key("train.seed", "seed of initial weights and data sampling", &job_config::seed, 0, 0xffffffffLL),
      int_key("train.threads", "LibTorch intra-op threads (0: every hardware thread)", &job_config::threads, 0, 1024),
      int_key("train.eval_interval", "validation every N steps and at the end", &job_config::eval_interval, 0, 10000000),
      string_key("train.eval_mode",
                 "actors: pipeline (the validation windows go forward only through the stage actors, each "
                 "replica a share, as Megatron's forward-only schedule) or gather (node 0 gathers the whole "
                 "model and evaluates it alone)",
                 &job_config::eval_mode),
      int_key("train.eval_tokens",
              "tokens per evaluation forward (whole windows, at least one): bounds evaluation's activations",
              &job_config::eval_tokens, 1, 1LL << 40),
      string_key("train.runtime", "actors (the actor runtime) or local (the plain loop)", &job_config::runtime),
      string_key("train.compute",
                 "real, or simulated (actors, one process: the stage and shard actors run the schedule's ops as "
                 "waits of the planner's cost model for simulated_device, activations and gradients as sizes "
                 "without data; the coordinator, supervisors, loaders, reports and watchdog are the real ones. "
                 "Decoders with a fixed-order schedule, no evaluation, nothing loaded or saved; see docs/simulation.md)",
                 &job_config::compute),
      string_key("train.simulated_device",
                 "compute simulated: the device model (h100, h200, a100, or cpu: this machine's core, measured), or "
                 "trace:FILE, a Chrome trace (--trace) of a real run of the same layout: its ops' median times, and "
                 "each stage's median tail (the reduce-scatter after its last op, the update, the all-gather)",
                 &job_config::simulated_device),
      double_key("train.simulated_time_scale",
                 "compute simulated: every modelled wait times this (0.1: a 10 s step runs in about 1 s)",
                 &job_config::simulated_time_scale, 1e-6, 1000),
      int_key("train.simulated_nodes",
              "compute simulated: the ranks as this many nodes in this one process, each a failure domain of its own "
              "(a supervisor with its share of the stage, shard and loader actors, as node_slots spreads them over "
              "node processes); faults.kill_node ends one as a lost node process, and it rejoins from its buddy's "
              "copies",
              &job_config::simulated_nodes, 1, 1 << 20),
      int_key("train.step_timeout", "seconds before an unfinished step is aborted (the hard limit; see hang_factor)",
              &job_config::step_timeout, 1, 1000000),
      double_key("train.hang_factor",
                 "a step with no progress for this many times the recent steps' median time (and at least "
                 "hang_min_seconds; 60 s before a step's time is known) is a hang: every actor is asked what it "
                 "waits for, the wait-for graph is logged and the step retried in place (0: no watchdog)",
                 &job_config::hang_factor, 0, 1000),
      int_key("train.hang_min_seconds", "the hang watchdog's shortest limit, in seconds", &job_config::hang_min_seconds,
              1, 1000000),
      int_key("train.max_skipped_steps", "NaN/inf gradients: updates skipped (actors) before the run stops",
              &job_config::max_skipped_steps, 0, 1000000),
      int_key("train.max_step_retries",
              "a failed step is retried in place (actors rebuilt from in-memory snapshots, every node process "
              "alive) this often before the run exits for a restart from its newest checkpoint",
              &job_config::max_step_retries, 0, 1000),
      int_key("train.rejoin_timeout",
              "several nodes: seconds the coordinator waits for a lost node process (not node 0) that the "
              "launcher restarts to rejoin before the run exits for a restart (0: it does not wait)",
              &job_config::rejoin_timeout, 0, 100000),
      bool_key("train.checksum", "CRC-32 on every activation and gradient payload", &job_config::checksum),
      string_key("train.device", "auto, cpu, cuda or cuda:N (auto: the first GPU when one is usable)",
                 &job_config::device),
      string_key("train.precision", "fp32, or bf16 (autocast compute with bf16 parameter values; fp32 main parameters and optimizer)",
                 &job_config::precision),
      bool_key("train.deterministic",
               "LibTorch's deterministic algorithms, strict (slower on a GPU: the same bits every run, as "
               "torch.use_deterministic_algorithms(True); sets CUBLAS_WORKSPACE_CONFIG=:4096:8)",
               &job_config::deterministic),
      bool_key("train.fp32_residual",
               "bf16 decoders: the residual stream between the blocks, and the layer norms' input and output, in "
               "fp32 (what autocast alone gives: a cast around each layer norm); false: in bf16, as Megatron's "
               "default (layer norm statistics still in fp32; 13 % more tokens/s for gpt-small on an H100). fp32 "
               "jobs and fmnist-mlp ignore it",
               &job_config::fp32_residual),
      string_key("train.recompute",
                 "none, selective (the attention core keeps only q, k, v and runs again in the backward) or "
                 "full (each transformer block keeps only its input and runs again in the backward; least "
                 "memory, one more forward)",
                 &job_config::recompute),
      {{"model.architecture",
        "gpt2 (learned positions, LayerNorm, GELU MLP, biases) or llama (rotary positions, RMSNorm, "
        "grouped-query attention, SwiGLU MLP, no biases; Hugging Face names), or one of llama's relatives: "
        "mistral (sliding_window), qwen2 (biases on q, k and v), qwen3 (an RMSNorm of each head's q and k); "
        "with experts, llama and mistral are Mixtral, qwen3 is Qwen3-MoE; empty: the workload's"},
       [](job_config& c, const std::string& v) {
         if (!v.empty()) parse_decoder_arch(v);
         c.architecture = v;
       },
       [](const job_config& c) { return toml_string(c.architecture); }},
      int_key("model.layers", "decoders: transformer blocks (0: the workload's)", &job_config::layers, 0, 4096),
      int_key("model.heads", "decoders: attention heads, dividing d_model (0: the workload's)", &job_config::heads, 0,
              4096),
      int_key("model.kv_heads",
              "llama: key/value heads, dividing heads (grouped-query attention; 0: the workload's, gpt2's is heads)",
              &job_config::kv_heads, 0, 4096),
      int_key("model.d_model", "decoders: model width (0: the workload's)", &job_config::d_model, 0, 1 << 16),
      int_key("model.d_ff", "decoders: MLP hidden width (0: the workload's d_ff scaled with d_model: 4 x d_model for "
              "gpt, 3 x for llama-tiny)", &job_config::d_ff, 0, 1 << 18),
      int_key("model.seq_len", "decoders: tokens per sample, also gpt2's position table's length (0: the workload's)",
              &job_config::seq_len, 0, 1 << 16),
      int_key("model.vocab", "decoders: rows of the token embedding, at least the data's 256 byte values (0: 256)",
              &job_config::vocab, 0, 1 << 24),
      int_key("model.head_dim", "rotary decoders: each head's width (0: d_model / heads; Qwen3's differs)",
              &job_config::head_dim, 0, 1 << 14),
      int_key("model.sliding_window",
              "mistral: each query attends to itself and the sliding_window - 1 keys before it (0: to every "
              "earlier key)",
              &job_config::sliding_window, 0, 1 << 24),
      double_key("model.rope_theta", "llama: the rotary embedding's base (0: 10000)", &job_config::rope_theta, 0, 1e12),
      double_key("model.norm_eps", "decoders: LayerNorm's / RMSNorm's epsilon (0: 1e-5)", &job_config::norm_eps, 0, 1),
      int_key("model.experts",
              "llama: a mixture of experts (Mixtral's sparse MLP) with this many experts in place of the MLP "
              "(0: the workload's: moe-tiny 4, moe-small 8, the others dense)",
              &job_config::experts, 0, 1024),
      int_key("model.moe_top_k", "experts per token (0: the workload's, 2)", &job_config::moe_top_k, 0, 1024),
      int_key("model.moe_d_ff", "each expert's width (0: the workload's: moe-tiny 192, else d_ff)",
              &job_config::moe_d_ff, 0, 1 << 20),
      int_key("model.moe_every", "experts in blocks 0, N, 2N, ... (0: the workload's, 1: every block)",
              &job_config::moe_every, 0, 1024),
      double_key("model.moe_aux_loss_coeff",
                 "the load-balancing loss's coefficient (negative: the workload's, 0.01; 0: none)",
                 &job_config::moe_aux_loss_coeff, -1, 1e3),
      double_key("model.moe_capacity_factor",
                 "experts, in training: each expert takes at most ceil(factor x seq_len x moe_top_k / experts) "
                 "(token, choice) pairs of a sequence, those with the highest router probability; the others are "
                 "dropped (they add nothing to their token, which keeps its residual) and counted in the metrics "
                 "(0: none dropped, as in the moe-tiny workload; evaluation and generation never drop)",
                 &job_config::moe_capacity_factor, 0, 1e3),
      {{"model.tie_embeddings",
        "true: the output layer is the token embedding (gpt2's wte; with pipeline stages the first and last "
        "hold a copy, their gradients summed), false: an lm_head of its own; auto: the architecture's "
        "(gpt2 tied, llama not)"},
       [](job_config& c, const std::string& v) {
         if (v != "auto" && v != "true" && v != "false") bad("expected auto, true or false");
         c.tie_embeddings = v;
       },
       [](const job_config& c) { return c.tie_embeddings == "auto" ? toml_string("auto") : c.tie_embeddings; }},
      int_key("parallel.pipeline", "pipeline stages", &job_config::pipeline, 1, 1024),
      int_key("parallel.data_parallel", "data-parallel replicas (sharded optimizer)", &job_config::data_parallel, 1, 1024),
      int_key("parallel.tensor_parallel",
              "ranks each decoder layer is split over (Megatron's tensor parallelism: heads, MLP width and "
              "vocabulary; a group's stage actors share one node process)",
              &job_config::tensor_parallel, 1, 1024),
      int_key("parallel.expert_parallel",
              "ranks each expert layer's experts are spread over (expert parallelism: an all-to-all sends each "
              "token to its experts' rank): EP consecutive ranks of the dense layout, tensor-parallel rank fastest "
              "(Megatron's folding); divides data_parallel x tensor_parallel and the experts",
              &job_config::expert_parallel, 1, 1024),
      int_key("parallel.context_parallel",
              "ranks each sequence is split over (context parallelism): the sequence cut into 2 x C chunks, rank i "
              "holding chunks i and 2C-1-i (causal load balance); the gradients are averaged over data_parallel x "
              "context_parallel; a group's stage actors share one node process",
              &job_config::context_parallel, 1, 1024),
      string_key("parallel.context_parallel_comm",
                 "context_parallel > 1: how the attention sees the other ranks' keys: p2p (ring of key/value "
                 "blocks, overlapped with the attention), a2a (all-to-all of heads for sequence, "
                 "DeepSpeed-Ulysses) or allgather",
                 &job_config::context_parallel_comm),
      string_key("parallel.shard",
                 "what each data-parallel replica keeps 1/d of: optimizer (ZeRO-1: the fp32 main parameters and "
                 "AdamW's moments, Megatron's distributed optimizer), gradients (ZeRO-2: and the gradients, "
                 "reduce-scattered as a unit's backward ends) or parameters (ZeRO-3, FSDP: and the parameters, "
                 "all-gathered for the unit's compute and released after it); the unit: fsdp_unit",
                 &job_config::shard),
      int_key("parallel.shard_group",
              "ranks the state is sharded over (hybrid sharding, HSDP: shard within groups of this many "
              "consecutive replicas, replicate across the groups; it divides the data-parallel x "
              "context-parallel ranks); 0: the whole data-parallel group",
              &job_config::shard_group, 0, 1 << 20),
      string_key("parallel.fsdp_unit",
                 "shard = gradients or parameters: what is gathered and reduced at once: block (torch's FSDP2 "
                 "wrapping each transformer block: a block's parameters all-gathered before its forward and "
                 "again before its backward, released after each, its gradients reduce-scattered as its "
                 "backward ends; the chunk's embeddings, final norm and output layer one more unit, for the run of "
                 "ops on the chunk) or chunk (a stage's chunk gathered for a run of the stage's ops on it and reduced once the run "
                 "ends: one chunk per stage gathers and reduces once a step)",
                 &job_config::fsdp_unit),
      bool_key("parallel.fsdp_prefetch",
               "shard = parameters: start the next unit's all-gather while the stage computes with this one "
               "(by blocks: the next block's; by chunks: one op ahead, or for the step's first op while it "
               "waits for its input); a unit's parameters are then held beside the one computing",
               &job_config::fsdp_prefetch),
      bool_key("parallel.sequence_parallel",
               "tensor_parallel > 1: the norms, residuals and embeddings hold 1/tensor_parallel of the sequence "
               "(all-gather and reduce-scatter instead of all-reduce)",
               &job_config::sequence_parallel),
      int_key("parallel.microbatches", "micro-batches per replica per step", &job_config::microbatches, 1, 1000000),
      int_key("parallel.chunks", "virtual chunks per stage (interleaved-1f1b)", &job_config::chunks, 1, 64),
      string_key("parallel.schedule", "gpipe, 1f1b, interleaved-1f1b, zero-bubble, combined-1f1b, zbv, dualpipev (zbv and dualpipev: chunks = 2) or dataflow", &job_config::schedule),
      int_key("parallel.max_in_flight", "dataflow: micro-batches in flight per stage (0: stages)", &job_config::max_in_flight, 0, 1000000),
      bool_key("parallel.split_backward",
               "dataflow: split each backward into B (the input's gradient) and W (the weights'); a W runs "
               "when nothing else can and the in-flight bound or the step's end needs it (zero-bubble always splits)",
               &job_config::split_backward),
      bool_key("parallel.overlap_pairs",
               "combined-1f1b and dualpipev with expert parallelism (actors runtime, CPU): a pair's forward and "
               "backward compute at once on two threads, so that one's all-to-alls wait while the other computes "
               "(false: one after the other; faster on few cores where the all-to-all is quick)",
               &job_config::overlap_pairs),
      int_key("parallel.bucket_size",
              "data parallelism: gradient buckets of at least this many elements per chunk, each "
              "reduce-scattered as soon as the step's last backward has produced it, while that backward goes "
              "on (Megatron's overlapped gradient reduction and its default size); 0: one bucket per chunk",
              &job_config::bucket_size, 0, 1LL << 40),
      int_key("parallel.credit_window",
              "micro-batches a data loader sends ahead of stage 0's forwards, one more for each credit stage 0 "
              "returns; 0: every micro-batch of the step at its begin, and no credits (a credit wakes the loader's "
              "thread each micro-batch)",
              &job_config::credit_window, 0, 1000000),
      {{"parallel.split", "explicit layers per virtual stage, e.g. 3,5"},
       [](job_config& c, const std::string& v) {
         c.split.clear();
         if (v.empty()) return;
         std::stringstream in(v);
         std::string item;
         while (std::getline(in, item, ',')) {
           const auto x = parse_int(item);
           if (x < 1) bad("every entry must be >= 1");
           c.split.push_back(int(x));
         }
       },
       [](const job_config& c) {
         std::string s = "[";
         for (std::size_t i = 0; i < c.split.size(); ++i) s += (i ? ", " : "") + std::to_string(c.split[i]);
         return s + "]";
       }},
      double_key("optimizer.lr", "peak learning rate", &job_config::lr, 0, 10),
      double_key("optimizer.min_lr", "final learning rate of the cosine decay", &job_config::min_lr, 0, 10),
      int_key("optimizer.warmup", "linear warm-up steps", &job_config::warmup, 0, 10000000),
      double_key("optimizer.weight_decay", "AdamW weight decay on 2-D weights", &job_config::weight_decay, 0, 10),
      double_key("optimizer.beta1", "Adam beta1", &job_config::beta1, 0, 0.999999),
      double_key("optimizer.beta2", "Adam beta2", &job_config::beta2, 0, 0.999999999),
      double_key("optimizer.eps", "Adam epsilon", &job_config::eps, 0, 1),
      double_key("optimizer.clip", "global gradient-norm clip (0: off)", &job_config::clip, 0, 1e9),
      int_key("data.global_batch", "sequences (or images) per optimizer step", &job_config::global_batch, 1, 100000000),
      string_key("data.fortunes_dir", "fortunes corpus folder", &job_config::fortunes_dir),
      string_key("data.text", "gpt: a text of your own to train and evaluate on, a file or a folder of files (bytes "
                 "or data.tokenizer's pieces are the tokens; default: the fortunes corpus)", &job_config::text),
      string_key("data.val_text", "with --text: the validation windows' text, a file or a folder (then all of --text "
                 "trains; default: its last 10 %)", &job_config::val_text),
      string_key("data.tokenizer",
                 "decoders: a SentencePiece model (troupe tokenizer makes one), a Hugging Face tokenizer.json, or a "
                 "model folder's tokenizer: the text is encoded once into a token cache and trained on as tokens, "
                 "the model's vocabulary its size rounded up to a multiple of 128 (empty: the 256 byte values; "
                 "with --data and --model DIR: the folder's tokenizer)",
                 &job_config::tokenizer),
      list_key("data.data",
               "documents to train on, in order (one or more): a .jsonl file (a document per line), a Megatron "
               "indexed dataset's prefix (PREFIX.bin and PREFIX.idx, ids as stored), a folder (a document per "
               "file) or any other file (one document); the first 90 % of their tokens train, the rest validate",
               &job_config::data),
      list_key("data.val_data", "with --data: the validation documents (then all of --data trains)",
               &job_config::val_data),
      string_key("data.data_field", "JSON lines: the field that holds a document's text", &job_config::data_field),
      bool_key("data.document_attention",
               "with --data: a token attends only to the earlier tokens of its own document in its window, and "
               "positions count from 0 again after each EOS (Megatron's --reset-attention-mask "
               "--reset-position-ids)",
               &job_config::document_attention),
      string_key("data.cache_dir", "the token cache's folder (empty: $XDG_CACHE_HOME/troupe, else ~/.cache/troupe)",
                 &job_config::cache_dir),
      string_key("data.fmnist_dir", "Fashion-MNIST folder", &job_config::fmnist_dir),
      string_key("output.metrics", "JSON-lines metrics file (one line per step)", &job_config::metrics),
      string_key("output.save", "checkpoint to write (PyTorch state_dict; optimizer in FILE.optim)", &job_config::save),
      string_key("output.load", "checkpoint to resume from (written by --save)", &job_config::load),
      string_key("output.init", "initial weights: a PyTorch state_dict file", &job_config::init),
      int_key("output.checkpoint_interval", "also save every N steps (0: only at the end)", &job_config::checkpoint_interval, 0, 10000000),
      string_key("output.checkpoint_dir", "write checkpoint folders here (every checkpoint_interval steps and at the end)",
                 &job_config::checkpoint_dir),
      int_key("output.keep_checkpoints", "newest checkpoint folders kept in checkpoint_dir", &job_config::keep_checkpoints,
              1, 1000000),
      bool_key("output.checkpoint_async",
               "write interim checkpoint folders in the background: each stage takes a snapshot in host memory at "
               "the step boundary and its node writes it while the next steps run (the run's last checkpoint, "
               "and --save files, are written before it ends)",
               &job_config::checkpoint_async),
      int_key("output.checkpoint_async_memory",
              "MiB of host memory a node's checkpoint snapshots may hold (0: half of its available memory); a "
              "snapshot over it is written before training goes on",
              &job_config::checkpoint_async_memory, 0, 100000000),
      string_key("output.resume", "continue from a checkpoint folder (or checkpoint_dir's newest: auto)",
                 &job_config::resume),
      bool_key("output.strict_resume",
               "refuse a newest checkpoint that does not verify instead of taking the newest one that does",
               &job_config::strict_resume),
      string_key("output.trace", "Chrome trace JSON of every executed op (actors runtime)", &job_config::trace),
      string_key("faults.throw_at", "replica:stage:step[:late|:eval] - that stage actor throws in that step (0-based index; late: "
                 "when its updated parameters arrive; eval: in the evaluation after that step; testing)", &job_config::throw_at),
      int_key("faults.nan_at", "step (0-based index) whose losses the last stages make NaN (testing; -1: none)", &job_config::nan_at, -1,
              10000000),
      string_key("faults.kill_node", "node:step[+node:step...] - that node's process SIGKILLs itself as that step (0-based index) "
                 "begins (simulated nodes: its supervisor ends, with every actor of the node; testing)",
                 &job_config::kill_node),
      string_key("faults.freeze_node",
                 "node:step[+node:step...] - that simulated node goes silent as that step (0-based index) begins, as "
                 "a frozen or cut-off node process does: its stages run nothing more, and it is lost once its "
                 "connection times out (5 s), then rejoins from its buddy's copies (compute simulated with "
                 "simulated_nodes; testing)",
                 &job_config::freeze_node),
      string_key("faults.message",
                 "ACTION@replica:stage:step[:loss|:eval] - drop, duplicate, corrupt or delay (delay=SECONDS; "
                 "default 0.3) that stage's first tensor message of that step, or (:loss) the last stage's first "
                 "loss report, or (:eval) its first evaluation result after that step (0-based; testing)",
                 &job_config::message),
      string_key("faults.stall",
                 "stage:rank:step - that optimizer shard never starts its reduce-scatter of that step (testing)",
                 &job_config::stall),
      string_key("faults.freeze",
                 "replica:stage:step[:SECONDS] - that stage actor's thread blocks for SECONDS (default 15) at "
                 "its second op of that step: an actor that stops answering (0-based; testing)",
                 &job_config::freeze),
      string_key("faults.kill_in_write",
                 "node:step[:SECONDS] - that node's process SIGKILLs itself SECONDS (default 0) after its background "
                 "write of the checkpoint after that step (0-based index) begins (testing)",
                 &job_config::kill_in_write),
      int_key("faults.attempt", "the launch the faults fire in (0: the first; 1: the first restart; ...)",
              &job_config::fault_attempt, 0, 1000000),
  };
  return defs;
}

const key_def& find_key(const std::string& key) {
  for (const auto& d : key_defs()) {
    const auto& n = d.key.name;
    if (n == key || n.substr(n.find('.') + 1) == key) return d;
  }
  std::string known;
  for (const auto& d : key_defs()) known += (known.empty() ? "" : ", ") + d.key.name;
  throw config_error("unknown configuration key '" + key + "' (known keys: " + known + ")");
}

/// Flattens a TOML document into (dotted key, text value) pairs.
void flatten(const toml::table& table, const std::string& prefix, const std::string& path,
             std::vector<std::pair<std::string, std::string>>& out) {
  for (const auto& [k, node] : table) {
    const std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const auto* t = node.as_table()) {
      flatten(*t, key, path, out);
    } else if (const auto* s = node.as_string()) {
      out.emplace_back(key, s->get());
    } else if (const auto* i = node.as_integer()) {
      out.emplace_back(key, std::to_string(i->get()));
    } else if (const auto* f = node.as_floating_point()) {
      out.emplace_back(key, fmt_double(f->get()));
    } else if (const auto* a = node.as_array(); a && !a->empty() && a->front().is_string()) {
      std::string v;  // a list of strings: one per line
      for (const auto& e : *a) {
        const auto* es = e.as_string();
        if (!es) throw config_error(path + ": " + key + ": expected an array of strings");
        if (es->get().find('\n') != std::string::npos) throw config_error(path + ": " + key + ": a newline in a path");
        v += (v.empty() ? "" : "\n") + es->get();
      }
      out.emplace_back(key, v);
    } else if (const auto* a = node.as_array()) {
      std::string v;
      for (const auto& e : *a) {
        const auto* ei = e.as_integer();
        if (!ei) throw config_error(path + ": " + key + ": expected an array of integers");
        v += (v.empty() ? "" : ",") + std::to_string(ei->get());
      }
      out.emplace_back(key, v);
    } else if (const auto* b = node.as_boolean()) {
      out.emplace_back(key, b->get() ? "true" : "false");
    } else {
      throw config_error(path + ": " + key + ": unsupported value type");
    }
  }
}

}  // namespace

std::string config_key::flag() const {
  std::string f = name.substr(name.find('.') + 1);
  std::replace(f.begin(), f.end(), '_', '-');
  return "--" + f;
}

const std::vector<config_key>& config_keys() {
  static const std::vector<config_key> keys = [] {
    std::vector<config_key> out;
    for (const auto& d : key_defs()) out.push_back(d.key);
    return out;
  }();
  return keys;
}

std::string config_reference() {
  const job_config d;  // gpt-tiny's defaults
  std::string out =
      "# Configuration reference\n\n"
      "<!-- Generated by `build/troupe config-reference` from the table that also makes the flags, reads\n"
      "     the TOML file and prints --help (compute/config/job_config.cpp, key_defs); tests/integration/cli_test.sh\n"
      "     checks that this file equals its output. Do not edit by hand. -->\n\n"
      "A job's configuration is the workload's defaults, then the TOML file (`--config FILE`), then\n"
      "flags. Every key is a TOML key in its section and a flag: the key's last part, `_` written\n"
      "`-` (`parallel.data_parallel` is `--data-parallel`). Defaults are gpt-tiny's; the other workloads\n"
      "change some of them (`compute/config/job_config.cpp`, `defaults_for`). Fault keys are\n"
      "for testing; `TROUPE_FAULTS=\"key=value,...\"` sets them too ([faults](faults.md)).\n";
  std::string section;
  for (const auto& k : key_defs()) {
    const auto& n = k.key.name;
    const auto sec = n.substr(0, n.find('.'));
    if (sec != section) {
      out += "\n## [" + sec + "]\n\n| key | flag | default | meaning |\n| --- | --- | --- | --- |\n";
      section = sec;
    }
    auto help = k.key.help;
    for (std::size_t i = 0; (i = help.find('|', i)) != std::string::npos; i += 2) help.replace(i, 1, "\\|");
    out += "| `" + n.substr(n.find('.') + 1) + "` | `" + k.key.flag() + "` | `" + k.get(d) + "` | " + help + " |\n";
  }
  return out;
}

job_config job_config::defaults_for(const std::string& workload) {
  job_config c;
  if (workload == "gpt-tiny") return c;
  if (workload == "llama-tiny" || workload == "moe-tiny") {  // gpt-tiny's data and training, Llama's architecture
    c.workload = workload;
    return c;
  }
  if (workload == "gpt-small" || workload == "llama-small" || workload == "moe-small") {  // for GPUs
    c.workload = workload;
    c.steps = 200;
    c.global_batch = 16;
    c.microbatches = 4;
    c.lr = 6e-4;
    c.min_lr = 6e-5;
    c.warmup = 20;
    c.eval_interval = 0;
    return c;
  }
  if (workload == "fmnist-mlp") {
    c.workload = workload;
    c.steps = 937;  // one epoch of 60 000 images in batches of 64 (partial batch dropped)
    c.global_batch = 64;
    c.microbatches = 4;  // micro-batch 16
    c.lr = c.min_lr = 1e-3;
    c.warmup = 0;
    c.weight_decay = 0;
    c.beta2 = 0.999;
    c.clip = 0;
    c.eval_interval = 0;
    return c;
  }
  throw config_error("unknown workload '" + workload + "' (expected " + workload_names + ")");
}

void job_config::set(const std::string& key, const std::string& value, const std::string& origin) {
  const auto& def = find_key(key);
  try {
    def.set(*this, value);
  } catch (const std::invalid_argument& e) {
    throw config_error(origin + ": " + def.key.name + " = '" + value + "': " + e.what());
  }
}

namespace {

/// What parallel.shard and parallel.shard_group need of the job (validate's).
void check_sharding(const job_config& c) {
  auto fail = [](const std::string& msg) { throw config_error("invalid configuration: " + msg); };
  shard_level level;
  try {
    level = parse_shard_level(c.shard);
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
  if (c.fsdp_unit != "block" && c.fsdp_unit != "chunk")
    fail("fsdp_unit '" + c.fsdp_unit + "': one of block (each transformer block gathered and reduced on its own) "
         "or chunk (a stage's chunk at once)");
  const int d = c.data_parallel * c.context_parallel;
  const std::string ranks = c.context_parallel > 1 ? " data-parallel x context-parallel ranks" : " data-parallel ranks";
  if (c.shard_group != 0 && (c.shard_group > d || d % c.shard_group != 0))
    fail("shard_group " + std::to_string(c.shard_group) + " must divide the " + std::to_string(d) + ranks +
         " (groups of that many ranks shard the state, replicated across the groups), or be 0 (the whole group)");
  if (c.shard_group != 0 && c.shard_group < d) {
    const std::string hybrid = "shard_group " + std::to_string(c.shard_group) + " (hybrid sharding)";
    if (c.runtime == "local") fail(hybrid + " runs in the actor runtime (--runtime actors)");
    if (c.device.rfind("cuda", 0) == 0)
      fail(hybrid + " on " + c.device + ": its collectives run over the group's point-to-point by tag, which NCCL "
           "does not match (--device cpu, or shard_group 0)");
    if (c.expert_parallel > 1 && (c.shard_group * c.tensor_parallel) % c.expert_parallel != 0)
      fail(hybrid + " with expert_parallel " + std::to_string(c.expert_parallel) +
           ": a shard group must hold whole expert-parallel groups, so that it holds every expert "
           "(expert_parallel must divide shard_group x tensor_parallel)");
  }
  if (level == shard_level::optimizer) return;
  const std::string what = "shard " + c.shard;
  if (c.runtime == "local") fail(what + " runs in the actor runtime (--runtime actors)");
  // (Dataflow: each replica runs its ops as their inputs come, in an order of its own. By
  // chunks (dataflow has one a stage) the replicas still meet once a step: the chunk
  // gathered at their first op, reduced after their last.)
  if (c.schedule == "dataflow" && c.fsdp_unit != "chunk")
    fail(what + " with schedule dataflow: each replica runs its ops in an order of its own, so their all-gathers "
         "and reduce-scatters pair up only once a step: fsdp_unit chunk (or a fixed schedule)");
  if (c.device.rfind("cuda", 0) == 0)
    fail(what + " on " + c.device + ": the stage's collectives are not yet on its CUDA stream (--device cpu)");
}

/// What context parallelism needs of the job (validate's).
void check_context_parallel(const job_config& c) {
  auto fail = [](const std::string& msg) { throw config_error("invalid configuration: " + msg); };
  try {
    parse_cp_comm(c.context_parallel_comm);
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
  const int C = c.context_parallel, T = c.tensor_parallel;
  if (C == 1) return;
  const std::string cp = "context_parallel " + std::to_string(C);
  if (!c.is_decoder()) fail(cp + ": fmnist-mlp has no sequences to split");
  const auto& g = c.model().decoder;
  if (g.seq_len % (2 * C) != 0)
    fail(cp + " needs seq_len " + std::to_string(g.seq_len) + " divisible by 2 x " + std::to_string(C) +
         " (each rank holds two of 2 x context_parallel equal chunks)");
  if (T > 1 && c.sequence_parallel && (g.seq_len / C) % T != 0)
    fail(cp + " with sequence parallelism needs seq_len / context_parallel (" + std::to_string(g.seq_len / C) +
         ") divisible by tensor_parallel " + std::to_string(T));
  if (c.context_parallel_comm == "a2a") {
    const int heads = g.n_head / T, kv = std::max(1, g.kv_heads() / T);
    if (heads % C != 0 || (kv % C != 0 && C % kv != 0))
      fail(cp + " with context_parallel_comm a2a trades heads for sequence: each tensor-parallel rank's " +
           std::to_string(heads) + " query heads and " + std::to_string(kv) +
           " key/value heads must divide by context_parallel (or the key/value heads divide it: replicated); "
           "p2p and allgather have no such limit");
  }
  if (c.runtime == "local") fail(cp + " runs in the actor runtime (--runtime actors)");
  if (c.device.rfind("cuda", 0) == 0)
    fail(cp + " on " + c.device + ": its ring's shifts run beside the stage on a thread without the stage's CUDA "
         "stream (not yet on GPUs; --device cpu)");
  if (c.schedule == "dataflow")
    fail(cp + " with schedule dataflow: the stage actors of a context-parallel group meet in every attention, so "
         "they run one fixed order (any schedule but dataflow)");
}

}  // namespace

void job_config::validate() const {
  auto fail = [](const std::string& msg) { throw config_error("invalid configuration: " + msg); };
  if (workload != "gpt-tiny" && workload != "gpt-small" && workload != "llama-tiny" && workload != "llama-small" &&
      workload != "moe-tiny" && workload != "moe-small" && workload != "fmnist-mlp")
    fail("unknown workload '" + workload + "' (expected " + workload_names + ")");
  auto check = [&](auto f) {  // parse errors of compute/runtime/device.hpp as configuration errors
    try {
      f();
    } catch (const std::invalid_argument& e) {
      fail(e.what());
    }
  };
  check([&] { parse_precision(precision); });
  check([&] { parse_recompute(recompute); });
  if (eval_mode != "pipeline" && eval_mode != "gather")
    fail("unknown eval_mode '" + eval_mode + "' (expected pipeline or gather)");
  if (!tokenizer.empty()) {
    if (!is_decoder()) fail("tokenizer " + tokenizer + " is for the decoder workloads (fmnist-mlp reads images)");
    try {
      tokenizer_info_of(tokenizer);
    } catch (const std::exception& e) {
      fail(e.what());
    }
  }
  if (workload == "fmnist-mlp" && has_model_keys())
    fail("the [model] keys shape the decoder workloads (fmnist-mlp's layers are fixed)");
  if (is_decoder()) {
    const auto g = model().decoder;
    if (g.head_size == 0 && g.d_model % g.n_head != 0)
      fail("d_model " + std::to_string(g.d_model) + " is not a multiple of heads (" + std::to_string(g.n_head) + ")");
    if (g.head_size > 0 && g.arch == decoder_arch::gpt2)
      fail("head_dim " + std::to_string(g.head_size) + " with architecture gpt2: its heads are d_model / heads");
    if (g.sliding_window > 0 && g.arch != decoder_arch::mistral)
      fail("sliding_window " + std::to_string(g.sliding_window) + " with architecture " + decoder_arch_name(g.arch) +
           ": the sliding window is mistral's");
    if (g.n_head % g.kv_heads() != 0)
      fail("heads " + std::to_string(g.n_head) + " is not a multiple of kv_heads (" + std::to_string(g.kv_heads()) +
           "): each key/value head serves a group of query heads");
    if (g.arch == decoder_arch::gpt2 && g.kv_heads() != g.n_head)
      fail("kv_heads " + std::to_string(g.kv_heads()) + " with architecture gpt2: its fused c_attn has one key/value "
           "head per query head (grouped-query attention is llama's)");
    if (g.arch != decoder_arch::gpt2 && g.head_dim() % 2 != 0)
      fail("head dimension " + std::to_string(g.head_dim()) + " (" + (g.head_size ? "head_dim" : "d_model / heads") +
           ") is odd: the rotary embedding rotates pairs");
    if (tokenizer.empty() && g.vocab < 256) fail("vocab " + std::to_string(g.vocab) + " is below the data's 256 byte values");
    if (g.n_experts > 0 && (g.arch == decoder_arch::gpt2 || g.arch == decoder_arch::qwen2))
      fail("experts " + std::to_string(g.n_experts) + " with architecture " + decoder_arch_name(g.arch) +
           ": the mixture of experts is Mixtral's (llama, mistral; --workload moe-tiny) or Qwen3-MoE's (qwen3)");
    if (g.n_experts > 0 && (g.moe_top_k < 1 || g.moe_top_k > g.n_experts))
      fail("moe_top_k " + std::to_string(g.moe_top_k) + " with " + std::to_string(g.n_experts) +
           " experts: expected 1 to " + std::to_string(g.n_experts));
    if (g.n_experts > 0 && tensor_parallel > 1 && !sequence_parallel)
      fail("experts with tensor_parallel " + std::to_string(tensor_parallel) +
           " need sequence_parallel = true (--sequence-parallel): each rank's experts compute on its part of "
           "the sequence (as Megatron asserts); without it every rank would hold the same tokens");
    if (g.vocab_used > g.vocab)
      fail("vocab " + std::to_string(g.vocab) + " is below the tokenizer's " + std::to_string(g.vocab_used) + " pieces");
  }
  if (moe_capacity_factor > 0 && (model().type != model_spec::kind::decoder || model().decoder.n_experts == 0))
    fail("moe_capacity_factor " + fmt_double(moe_capacity_factor) +
         ": the model has no experts (--workload moe-tiny, or --experts N)");
  if (expert_parallel > 1) {
    const auto& g = model().decoder;
    const std::string ep = "expert_parallel " + std::to_string(expert_parallel);
    if (model().type != model_spec::kind::decoder || g.n_experts == 0)
      fail(ep + ": the model has no experts (--workload moe-tiny, or --experts N)");
    if (g.n_experts % expert_parallel != 0)
      fail(ep + ": the " + std::to_string(g.n_experts) + " experts do not split over " +
           std::to_string(expert_parallel) + " ranks (expert_parallel must divide the experts)");
    if ((data_parallel * tensor_parallel) % expert_parallel != 0)
      fail(ep + " does not divide data_parallel x tensor_parallel " + std::to_string(data_parallel) + " x " +
           std::to_string(tensor_parallel) + ": an expert-parallel group is expert_parallel consecutive ranks of "
           "the dense layout (Megatron's folding)");
    if (runtime != "local" && schedule == "dataflow")
      fail(ep + " with schedule dataflow: the stage actors of an expert-parallel group meet in every expert "
           "layer's all-to-all, so they run one fixed order (any schedule but dataflow)");
  }
  if (tensor_parallel > 1) {
    try {
      check_tensor_parallel(model(), tensor_parallel, sequence_parallel);
    } catch (const model_error& e) {
      fail(e.what());
    }
    const std::string tp = "tensor_parallel " + std::to_string(tensor_parallel);
    if (runtime != "local" && schedule == "dataflow")
      fail(tp + " with schedule dataflow: the stage actors of a tensor-parallel group meet in every layer's "
           "collectives, so they run one fixed order (any schedule but dataflow)");
  }
  if (context_parallel > 1 || context_parallel_comm != "p2p") check_context_parallel(*this);
  check_sharding(*this);
  if (!text.empty() && workload == "fmnist-mlp")
    fail("text " + text + " is a corpus for the decoder workloads (fmnist-mlp reads Fashion-MNIST)");
  if (!val_text.empty() && text.empty())
    fail("val_text " + val_text + " validates a text of your own: give its training text too (data.text)");
  if (!val_data.empty() && data.empty())
    fail("val_data " + val_data.front() + " validates documents: give the training documents too (--data)");
  if (document_attention && !uses_documents())
    fail("document_attention resets attention at the documents of --data (--text is one stream, without "
         "documents)");
  if (uses_documents()) {
    if (!is_decoder()) fail("data " + data.front() + " is documents for the decoder workloads (fmnist-mlp reads images)");
    if (!text.empty())
      fail("data " + data.front() + " and text " + text + ": documents (--data) or one text stream (--text), not both");
    bool text_documents = false;  // that need the tokenizer (a Megatron dataset's ids are stored)
    for (const auto* list : {&data, &val_data})
      for (const auto& path : *list) {
        try {
          text_documents = text_documents || data_format_of(path) != data_format::megatron;
        } catch (const std::exception& e) {
          fail(e.what());
        }
      }
    const auto tok = text_tokenizer();
    if (text_documents && tok.empty())
      fail("documents need a tokenizer: --model DIR (its tokenizer.json or tokenizer.model), or --tokenizer" +
           std::string(hf_model.empty() ? "" : " (" + hf_model + " has neither tokenizer.json nor tokenizer.model)"));
    if (document_attention && tok.empty() && document_eos(hf_model, -1) < 0)
      fail("document_attention needs the documents' EOS token, which ends each one: --model DIR (config.json's "
           "eos_token_id) or --tokenizer");
    if (!tok.empty()) {
      try {
        const auto info = tokenizer_info_of(tok);
        if ((text_documents || document_attention) && document_eos(hf_model, info.eos) < 0)
          fail("tokenizer " + tok + " has no EOS token (config.json's eos_token_id, tokenizer_config.json's "
               "eos_token): documents end with one");
        if (is_decoder() && info.size > model().decoder.vocab)
          fail("tokenizer " + tok + " has " + std::to_string(info.size) + " ids, more than the model's vocab_size " +
               std::to_string(model().decoder.vocab));
      } catch (const data_error& e) {
        fail(e.what());
      }
    }
  }
  if (recompute != "none" && workload == "fmnist-mlp")
    fail("recompute " + recompute + " applies to the transformer blocks of the decoder workloads (fmnist-mlp has none)");
  // The plain loop is the fp32 reference on the CPU: asking it for more would be ignored.
  if (runtime == "local" && precision != "fp32")
    fail("precision " + precision + " needs the actors runtime (the local loop computes in fp32)");
  if (runtime == "local" && device.rfind("cuda", 0) == 0)
    fail("device " + device + " needs the actors runtime (the local loop runs on the CPU)");
  check([&] {
    if (device != "auto") resolve_device(device);  // throws: unknown name, or no usable GPU
  });
  if (global_batch % (data_parallel * microbatches) != 0)
    fail("global_batch " + std::to_string(global_batch) + " is not divisible by data_parallel (" +
         std::to_string(data_parallel) + ") x microbatches (" + std::to_string(microbatches) + ")");
  if (min_lr > lr) fail("min_lr " + fmt_double(min_lr) + " is above lr " + fmt_double(lr));
  if (runtime != "actors" && runtime != "local") fail("unknown runtime '" + runtime + "' (expected actors or local)");
  if (compute != "real" && compute != "simulated")
    fail("unknown compute '" + compute + "' (expected real or simulated)");
  if (simulated_nodes > 1 && compute != "simulated")
    fail("simulated_nodes " + std::to_string(simulated_nodes) + " needs compute simulated (real nodes are node "
         "processes: launch/troupe train --nodes N)");
  if (!freeze_node.empty() && compute != "simulated")
    fail("faults.freeze_node silences a simulated node (compute simulated, simulated_nodes above 1); a node "
         "process is frozen with SIGSTOP (kill -STOP), or cut off by its network");
  if (schedule == "dataflow") {
    if (chunks != 1) fail("dataflow takes no virtual chunks (got chunks " + std::to_string(chunks) + ")");
    if (runtime != "actors") fail("the dataflow schedule needs the actors runtime");
  } else {
    bool splits = false;
    try {
      splits = make_schedule(parse_schedule_kind(schedule), pipeline, microbatches, chunks).split_backward();
    } catch (const schedule_error& e) {
      fail(e.what());
    }
    if (split_backward && !splits)
      fail("split_backward applies to the dataflow schedule (zero-bubble always splits the backward; " + schedule +
           " keeps it whole)");
  }
  if (runtime == "local" && !trace.empty()) fail("trace needs the actors runtime");
  const int n_layers = model().n_layers();
  if (split.empty() && n_layers < pipeline * chunks)
    fail(workload + " has " + std::to_string(n_layers) + " layers, too few for " +
         std::to_string(pipeline) + " stages x " + std::to_string(chunks) + " chunks");
  if (!split.empty()) {
    int sum = 0;
    for (int x : split) sum += x;
    if (int(split.size()) != pipeline * chunks || sum != n_layers)
      fail("split must list " + std::to_string(pipeline * chunks) + " layer counts summing to " +
           std::to_string(n_layers));
  }
  if (!load.empty() && !init.empty()) fail("give either load (resume) or init (initial weights), not both");
  if (!resume.empty() && (!load.empty() || !init.empty()))
    fail("give either resume (a checkpoint folder) or load / init, not both");
  if (resume == "auto" && checkpoint_dir.empty()) fail("resume = \"auto\" needs checkpoint_dir");
  if (runtime == "local" && (!checkpoint_dir.empty() || !resume.empty()))
    fail("checkpoint_dir and resume need the actors runtime (the local loop has save and load)");
  fault_plan::parse(faults());  // the [faults] keys parse
}

model_spec job_config::model() const {
  if (workload == "fmnist-mlp") return model_spec::fmnist_mlp();
  const auto own = workload == "gpt-small"     ? model_spec::gpt_small()
                   : workload == "llama-tiny"  ? model_spec::llama_tiny()
                   : workload == "llama-small" ? model_spec::llama_small()
                   : workload == "moe-tiny"    ? model_spec::moe_tiny()
                   : workload == "moe-small"   ? model_spec::moe_small()
                                               : model_spec::gpt_tiny();
  auto spec = own;
  if (folder_decoder) {
    spec.decoder = *folder_decoder;
    // (a rotary folder gives no sequence length: the workload's, unless model.seq_len sets it)
    if (spec.decoder.arch != decoder_arch::gpt2) spec.decoder.seq_len = own.decoder.seq_len;
  }
  auto& g = spec.decoder;
  if (!architecture.empty()) g.arch = parse_decoder_arch(architecture);
  if (head_dim > 0) g.head_size = head_dim;
  if (sliding_window > 0) g.sliding_window = sliding_window;
  if (layers > 0) g.n_layer = layers;
  if (heads > 0) g.n_head = heads;
  if (kv_heads > 0) g.n_kv_head = kv_heads;
  if (d_model > 0) g.d_model = d_model;
  if (seq_len > 0) g.seq_len = seq_len;
  if (!tokenizer.empty()) {  // the tokenizer's pieces, the rows padded to a multiple of 128
    g.vocab_used = tokenizer_info_of(tokenizer).size;
    g.vocab = padded_vocab(g.vocab_used);
  }
  if (vocab > 0) g.vocab = vocab;
  if (rope_theta > 0) g.rope_theta = rope_theta;
  if (norm_eps > 0) g.norm_eps = norm_eps;
  // The workload's MLP width scaled with the model's (gpt: 4 x d_model).
  if (!folder_decoder) g.d_ff = d_ff > 0 ? d_ff : int(std::int64_t(own.decoder.d_ff) * g.d_model / own.decoder.d_model);
  g.tie_embeddings = tie_embeddings == "auto" ? g.arch == decoder_arch::gpt2 : tie_embeddings == "true";
  if (experts > 0) g.n_experts = experts;
  if (moe_top_k > 0) g.moe_top_k = moe_top_k;
  if (moe_d_ff > 0) g.moe_d_ff = moe_d_ff;
  if (moe_every > 0) g.moe_every = moe_every;
  if (moe_aux_loss_coeff >= 0) g.moe_aux_coeff = moe_aux_loss_coeff;
  if (moe_capacity_factor > 0) g.moe_capacity_factor = moe_capacity_factor;
  return spec;
}

void job_config::take_model_from_folder() {
  const std::string where = "train.model = '" + hf_model + "'";
  if (!is_decoder()) throw config_error(where + ": a Hugging Face model is a decoder; " + workload + " is not");
  hf_model_shape shape;
  try {
    shape = read_hf_model_shape(hf_model);
  } catch (const std::exception& e) {
    throw config_error(where + ": " + e.what());
  }
  const auto& g = shape.decoder;
  std::vector<std::string> differ;
  auto take = [&](auto& mine, auto theirs, auto unset, const char* key, const char* hf_key) {
    if (mine != unset && mine != theirs) {
      std::ostringstream o;
      o << "model." << key << " " << mine << " (config.json's " << hf_key << " " << theirs << ")";
      differ.push_back(o.str());
    }
    mine = theirs;
  };
  const bool llama = g.arch != decoder_arch::gpt2;
  const std::string arch = decoder_arch_name(g.arch);
  if (!architecture.empty() && architecture != arch)
    differ.push_back("model.architecture " + architecture + " (config.json's model_type " + shape.model_type + ")");
  architecture = arch;
  take(layers, g.n_layer, 0, "layers", llama ? "num_hidden_layers" : "n_layer");
  take(heads, g.n_head, 0, "heads", llama ? "num_attention_heads" : "n_head");
  take(d_model, g.d_model, 0, "d_model", llama ? "hidden_size" : "n_embd");
  take(d_ff, g.d_ff, 0, "d_ff", llama ? "intermediate_size" : "n_inner");
  take(vocab, g.vocab, 0, "vocab", "vocab_size");
  take(norm_eps, g.norm_eps, 0.0, "norm_eps", llama ? "rms_norm_eps" : "layer_norm_epsilon");
  const std::string tied = g.tie_embeddings ? "true" : "false";
  take(tie_embeddings, tied, std::string("auto"), "tie_embeddings", "tie_word_embeddings");
  if (llama) {
    take(kv_heads, g.kv_heads(), 0, "kv_heads", "num_key_value_heads");
    take(rope_theta, g.rope_theta, 0.0, "rope_theta", "rope_theta");
    if (g.head_size > 0) take(head_dim, g.head_size, 0, "head_dim", "head_dim");
    if (g.sliding_window > 0) take(sliding_window, g.sliding_window, 0, "sliding_window", "sliding_window");
  }
  if (g.n_experts > 0) {
    take(experts, g.n_experts, 0, "experts", "num_local_experts");
    take(moe_top_k, g.moe_top_k, 0, "moe_top_k", "num_experts_per_tok");
    take(moe_d_ff, g.expert_d_ff(), 0, "moe_d_ff",
         shape.model_type == "qwen3_moe" ? "moe_intermediate_size" : "intermediate_size");
    if (moe_every > 0 && moe_every != g.moe_every)
      differ.push_back("model.moe_every " + std::to_string(moe_every) + " (the " + shape.model_type +
                       " folder's experts are in every " + std::to_string(g.moe_every) + " block" +
                       (g.moe_every > 1 ? "s" : "") + ")");
    moe_every = g.moe_every;
    // The load-balancing term's weight is training's, not the model's: the job's own when set.
    if (moe_aux_loss_coeff < 0) moe_aux_loss_coeff = g.moe_aux_coeff;
  } else if (experts > 0) {
    differ.push_back("model.experts " + std::to_string(experts) + " (config.json's " + shape.model_type +
                     " model is dense)");
  }
  // gpt2's position table has seq_len rows: the folder's n_positions.
  if (!llama) take(seq_len, shape.max_positions, 0, "seq_len", "n_positions");
  folder_decoder = g;
  if (!differ.empty()) {
    std::string msg = where + ": the job's [model] keys disagree with the folder: ";
    for (std::size_t i = 0; i < differ.size(); ++i) msg += (i ? "; " : "") + differ[i];
    throw config_error(msg);
  }
  const int tokens = model().decoder.seq_len;
  if (shape.max_positions > 0 && tokens > shape.max_positions)
    throw config_error(where + ": model.seq_len " + std::to_string(tokens) + " is above the folder's " +
                       "max_position_embeddings " + std::to_string(shape.max_positions));
}

std::string job_config::model_label() const {
  if (!has_model_keys()) return workload;
  const auto g = model().decoder;
  const bool arch_ties = g.arch == decoder_arch::gpt2;
  std::string text = std::string(" (") + decoder_arch_name(g.arch) + ", " + std::to_string(g.n_layer) + " layers, d_model " +
                     std::to_string(g.d_model) + ", " + std::to_string(g.n_head) + " heads";
  if (g.kv_heads() != g.n_head) text += ", " + std::to_string(g.kv_heads()) + " kv heads";
  text += ", d_ff " + std::to_string(g.d_ff) + ", seq_len " + std::to_string(g.seq_len);
  if (g.n_experts > 0)
    text += ", " + std::to_string(g.n_experts) + " experts of d_ff " + std::to_string(g.expert_d_ff()) + ", top-" +
            std::to_string(g.moe_top_k);
  if (g.n_experts > 0 && g.moe_capacity_factor > 0) text += ", capacity factor " + fmt_double(g.moe_capacity_factor);
  if (g.vocab != 256) text += ", vocab " + std::to_string(g.vocab);
  if (g.tie_embeddings != arch_ties) text += g.tie_embeddings ? ", tied embeddings" : ", untied embeddings";
  char params[64];
  std::snprintf(params, sizeof params, ": %.2f M parameters)", double(parameter_count(model())) / 1e6);
  return (hf_model.empty() ? workload : hf_model) + text + params;
}

std::string job_config::text_tokenizer() const {
  if (!tokenizer.empty() || !uses_documents() || hf_model.empty()) return tokenizer;
  return troupe::tokenizer::in_folder(hf_model) ? hf_model : "";
}

std::string job_config::data_label() const {
  const std::string tokens = tokenizer.empty() ? "" : " tokenized by " + tokenizer + " (" +
                             std::to_string(tokenizer_info_of(tokenizer).size) + " pieces)";
  if (uses_documents()) {
    const auto joined = [](const std::vector<std::string>& list) {
      std::string out;
      for (const auto& p : list) out += (out.empty() ? "" : ", ") + p;
      return out;
    };
    const auto paths = joined(data), valid = joined(val_data);
    const auto tok = text_tokenizer();
    return " on the documents of " + paths + (valid.empty() ? "" : ", validated on " + valid) +
           (tok.empty() ? "" : " tokenized by " + tok) + (document_attention ? ", attending within documents" : "");
  }
  if (text.empty()) return tokens;
  return " on the text in " + text + (val_text.empty() ? "" : ", validated on " + val_text) + tokens;
}

std::vector<std::pair<std::string, std::string>> job_config::values() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& d : key_defs()) out.emplace_back(d.key.name, d.get(*this));
  return out;
}

std::string job_config::to_toml() const {
  std::string out, section;
  for (const auto& d : key_defs()) {
    const auto& n = d.key.name;
    const auto sec = n.substr(0, n.find('.'));
    if (sec != section) {
      out += (section.empty() ? "[" : "\n[") + sec + "]\n";
      section = sec;
    }
    out += n.substr(n.find('.') + 1) + " = " + d.get(*this) + "\n";
  }
  return out;
}

namespace {

job_config from_settings(const std::vector<std::pair<std::string, std::string>>& from_file, const std::string& origin,
                         const std::vector<std::pair<std::string, std::string>>& overrides) {
  std::string workload = "gpt-tiny";
  for (const auto& [k, v] : from_file)
    if (find_key(k).key.name == "train.workload") workload = v;
  for (const auto& [k, v] : overrides)
    if (find_key(k).key.name == "train.workload") workload = v;
  job_config c = job_config::defaults_for(workload);
  for (const auto& [k, v] : from_file) c.set(k, v, origin);
  for (const auto& [k, v] : overrides) c.set(k, v, "command line");
  if (!c.hf_model.empty()) c.take_model_from_folder();
  c.validate();
  return c;
}

[[noreturn]] void throw_parse_error(const toml::parse_error& e, const std::string& origin) {
  std::ostringstream msg;
  msg << "cannot read config " << origin << ": " << e.description() << " (line " << e.source().begin.line
      << ", column " << e.source().begin.column << ")";
  throw config_error(msg.str());
}

}  // namespace

job_config load_job_config(const std::string& toml_path,
                           const std::vector<std::pair<std::string, std::string>>& overrides) {
  std::vector<std::pair<std::string, std::string>> from_file;
  if (!toml_path.empty()) {
    try {
      auto doc = toml::parse_file(toml_path);
      flatten(doc, "", toml_path, from_file);
    } catch (const toml::parse_error& e) {
      throw_parse_error(e, toml_path);
    }
  }
  return from_settings(from_file, toml_path, overrides);
}

job_config job_config_from_toml(const std::string& text, const std::string& origin) {
  std::vector<std::pair<std::string, std::string>> settings;
  try {
    auto doc = toml::parse(text, origin);
    flatten(doc, "", origin, settings);
  } catch (const toml::parse_error& e) {
    throw_parse_error(e, origin);
  }
  return from_settings(settings, origin, {});
}

bool nodes_fit(int p, int d, int t, int nodes) {
  const int total = p * d * t;
  if (nodes < 1 || total % nodes != 0) return false;
  const int per = total / nodes;
  return per % t == 0 || t % per == 0;
}

elastic_layout shrink_layout(const job_config& cfg, int max_nodes, int min_nodes) {
  if (min_nodes < 1 || max_nodes < min_nodes)
    throw config_error("the nodes left (" + std::to_string(max_nodes) + ") are fewer than the minimum (" +
                       std::to_string(min_nodes) + ")");
  const int micro = cfg.microbatch_size();
  for (int nodes = max_nodes; nodes >= min_nodes; --nodes)
    for (int d = cfg.data_parallel; d >= 1; --d) {
      if (!nodes_fit(cfg.pipeline, d * cfg.context_parallel, cfg.tensor_parallel, nodes) ||
          cfg.global_batch % (micro * d) != 0)
        continue;
      job_config c = cfg;
      c.data_parallel = d;
      c.microbatches = cfg.global_batch / (micro * d);
      try {
        c.validate();  // e.g. an interleaved schedule's micro-batches must stay a multiple of the stages
      } catch (const config_error&) {
        continue;
      }
      return {nodes, d, c.microbatches};
    }
  throw config_error("no layout of pipeline " + std::to_string(cfg.pipeline) + " with at most " +
                     std::to_string(cfg.data_parallel) + " replicas of micro-batches of " + std::to_string(micro) +
                     " (global batch " + std::to_string(cfg.global_batch) + ") fits " +
                     (min_nodes == max_nodes ? std::to_string(min_nodes) + " node(s)"
                                             : "between " + std::to_string(min_nodes) + " and " +
                                                   std::to_string(max_nodes) + " nodes") +
                     (cfg.tensor_parallel > 1
                          ? " (the node count must divide pipeline x replicas, or spread each tensor-parallel group "
                            "over the same number of nodes)"
                          : " (the node count must divide pipeline x replicas)"));
}

}  // namespace troupe
