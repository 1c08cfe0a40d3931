// The troupe command: `troupe train`, `troupe node` (also run as `troupe-node`: one node
// of a multi-process job, started by launch/troupe), `troupe generate`, `troupe eval`,
// `troupe schedule`, `troupe plan` (launch/plan_command.hpp), and launch/troupe's own
// `troupe elastic-layout` (for --min-nodes) and `troupe check-host` (whether a host of a
// --hostfile job can run a node).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "actors/node.hpp"
#include "actors/runtime.hpp"
#include "actors/supervisor_actor.hpp"
#include "actors/timeline_svg.hpp"
#include "actors/tp_groups.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "compute/data/data.hpp"
#include "compute/runtime/device.hpp"
#include "compute/trainer/generate.hpp"
#include "compute/checkpoint/hf_folder.hpp"
#include "compute/data/tokenizer.hpp"
#include "compute/data/documents.hpp"
#include "compute/runtime/host_memory.hpp"
#include "compute/config/job_config.hpp"
#include "compute/schedule/schedule.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "launch/blas_kernels.hpp"
#include "launch/cli_common.hpp"
#include "launch/plan_command.hpp"

using namespace troupe_cli;

namespace {

void print_schedule(const troupe::schedule& s, const troupe::simulation& sim, const std::string& format) {
  if (format == "json") {
    nlohmann::json ranks = nlohmann::json::array();
    for (const auto& ops : s.ranks) {
      nlohmann::json row = nlohmann::json::array();
      for (const auto& op : ops) {
        nlohmann::json o{{"op", troupe::op_letter(op.kind)}, {"mb", op.mb}, {"chunk", op.chunk}};
        if (op.split) o["split"] = true;
        if (op.paired) o["paired"] = true;
        row.push_back(std::move(o));
      }
      ranks.push_back(std::move(row));
    }
    nlohmann::json out{{"kind", troupe::to_string(s.kind)},
                       {"stages", s.stages},
                       {"microbatches", s.microbatches},
                       {"chunks", s.chunks},
                       {"ranks", ranks},
                       {"bubble", sim.bubble},
                       {"makespan", sim.makespan},
                       {"idle", sim.idle},
                       {"peak_activations", sim.peak_activations}};
    std::cout << out.dump() << "\n";
    return;
  }
  const char* mb = s.chunks > 1 ? "mb.chunk" : "mb";
  std::printf("%s: %d stages x %d micro-batches x %d chunks (F%s, B%s%s%s: micro-batch%s%s%s)\n",
              troupe::to_string(s.kind).c_str(), s.stages, s.microbatches, s.chunks, mb, mb,
              s.split_backward() ? ", W" : "", s.split_backward() ? mb : "", s.chunks > 1 ? ".chunk" : "",
              s.v_shape() ? "; chunks in a V: stage r runs virtual stages r and 2p-1-r" : "",
              s.kind == troupe::schedule_kind::combined_1f1b || s.kind == troupe::schedule_kind::dualpipev
                  ? "; F&B: an overlapped pair"
                  : "");
  for (int r = 0; r < s.stages; ++r)
    std::printf("stage %d | %s   (peak activations %d, idle %g)\n", r, troupe::order_text(s, r).c_str(),
                sim.peak_activations[r], sim.idle[r]);
  std::printf("bubble %.4f, makespan %g\n", sim.bubble, sim.makespan);
}

/// Edit distance between two words (insertions, deletions, substitutions).
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

/// The error for arguments `cmd` did not take: each unknown flag with the closest flag
/// of `cmd` (a typo, or a flag that starts with one: --warmup-steps -> --warmup), else
/// the unexpected words.
std::string extras_text(const CLI::App* cmd, const std::vector<std::string>& extras, const std::string& fallback) {
  std::string flags, words;
  for (const auto& a : extras) {
    if (a.rfind("--", 0) != 0) {
      words += (words.empty() ? "" : " ") + a;
      continue;
    }
    const std::string given = a.substr(0, a.find('='));
    std::string best;
    std::size_t best_d = std::string::npos;
    for (const auto* opt : cmd->get_options()) {
      for (const auto& n : opt->get_lnames()) {
        const std::string name = "--" + n;
        const bool stem = name.size() >= 5 && (given.rfind(name, 0) == 0 || name.rfind(given, 0) == 0);
        const std::size_t d = stem ? 0 : edit_distance(given, name);
        if (d < best_d) best_d = d, best = name;
      }
    }
    flags += (flags.empty() ? "" : "; ") + ("unknown flag " + given) +
             (best_d <= std::max<std::size_t>(2, given.size() / 4) ? " (did you mean " + best + "?)" : "");
  }
  const std::string see = "see troupe " + (cmd->get_parent() ? cmd->get_name() + " " : std::string()) + "--help";
  if (!flags.empty()) return flags + "; " + see;  // the words are likely their values
  if (!words.empty()) return "unexpected argument(s): " + words + "; " + see;
  return fallback;
}

/// `troupe check-host`: what a node of the job `cfg` needs on this host, checked the way
/// a node would meet it: the job's data (read whole: the summary ends with its
/// fingerprint, which launch/troupe compares between hosts), its device (a GPU that runs
/// a kernel), and the checkpoint it would resume from. Returns a one-line summary; throws
/// with the reason. `quick`: no kernel on the device (other nodes of the job may be using
/// it).
std::string check_host(const troupe::job_config& cfg, bool quick) {
  const auto data = troupe::training_data::identity(cfg);  // read, as a node would
  const auto device = troupe::resolve_device(troupe::node_device(cfg.device, 0, troupe::cuda_device_count()));
  if (device.is_cuda() && !quick) {
    // A GPU that is listed but broken (an Xid error, a lost device) fails here, not in a
    // node's first step.
    const auto a = torch::ones({256, 256}, torch::TensorOptions().device(device));
    if (a.mm(a).sum().item<double>() != 256.0 * 256 * 256)
      throw std::runtime_error("a matrix product on " + device.str() + " gave a wrong result");
  }
  // A restart resumes from checkpoint_dir (TROUPE_RESUME_AUTO=1, set by the launcher) and
  // every node reads its start state there: the folder must be on this host too.
  if (troupe_cli::read_environment().resume_auto && !cfg.checkpoint_dir.empty() &&
      !std::filesystem::is_directory(cfg.checkpoint_dir))
    throw std::runtime_error("checkpoint_dir " + cfg.checkpoint_dir +
                             " is not on this host (every node reads its start state there: it must be a folder "
                             "every host can read)");
  if (!cfg.resume.empty() && cfg.resume != "auto") troupe::find_checkpoint(cfg.resume);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return std::string("ready: ") + host + ", " + std::to_string(std::thread::hardware_concurrency()) +
         " cores, device " + device.str() + ", data " + data;
}

/// A trained model named by --checkpoint: a checkpoint folder (it records its model) or a
/// state_dict file (a --save file records its model; otherwise, or when they are given, the
/// flags say: workload and [model] keys).
struct trained_model {
  troupe::job_config cfg;
  troupe::state_dict state;
  std::string source;  ///< the file, or the folder and its step, for the log
  std::int64_t step = -1;  ///< the optimizer steps behind it (-1: a file does not say)
};

/// Flags that apply to a checkpoint folder too: where to run and where the data is.
bool applies_to_folders(const std::string& flag) {
  return flag == "--device" || flag == "--fortunes-dir" || flag == "--fmnist-dir" || flag == "--text" ||
         flag == "--val-text" || flag == "--eval-tokens";
}

/// The model flags of `troupe generate` and `eval` (model_source_key, or a --config).
bool model_source_key(const std::string& k);

/// `recorded` (a checkpoint's or a --save file's model) with where to run and the data
/// from the flags' configuration `cfg`.
troupe::job_config with_run_settings(troupe::job_config recorded, const config_flags& flags, const troupe::job_config& cfg) {
  recorded.device = cfg.device;
  recorded.fortunes_dir = cfg.fortunes_dir;
  recorded.fmnist_dir = cfg.fmnist_dir;
  recorded.eval_tokens = cfg.eval_tokens;
  const auto given = flags.given();  // the text the run trained on, unless the flag names another
  if (std::find(given.begin(), given.end(), "--text") != given.end()) recorded.text = cfg.text;
  if (std::find(given.begin(), given.end(), "--val-text") != given.end()) recorded.val_text = cfg.val_text;
  return recorded;
}

/// Whether the flags name a model (a workload, [model] keys, a folder, a tokenizer, a
/// --config): then a --save file's record of its model is not taken.
bool model_flags_given(const config_flags& flags) {
  if (!flags.config_path.empty()) return true;
  for (const auto& k : flags.keys)
    if (k.option->count() > 0 && k.key != "train.device" && model_source_key(k.key)) return true;
  return false;
}

/// Reads the model of `from` (a folder or a file); `cfg`: the flags' configuration.
/// Throws config_error for flags that do not apply to a folder.
trained_model load_trained_model(const config_flags& flags, const std::string& from, const troupe::job_config& cfg) {
  trained_model m;
  m.cfg = cfg;
  m.source = from;
  if (!std::filesystem::is_directory(from) || troupe::is_hf_folder(from)) {
    if (troupe::is_hf_folder(from) && m.cfg.hf_model.empty()) {  // its config.json gives the model
      m.cfg.hf_model = from;
      m.cfg.take_model_from_folder();
      m.cfg.validate();
    } else if (!troupe::is_hf_folder(from) && !model_flags_given(flags)) {
      if (auto recorded = troupe::saved_model_config(from)) {  // a --save file records its model
        m.cfg = with_run_settings(*recorded, flags, cfg);
        m.cfg.validate();
      }
    }
    const auto spec = m.cfg.model();
    m.state = troupe::read_initial_weights(from, spec);  // a state_dict file or a Hugging Face folder
    troupe::check_state(spec, m.state);  // before anything is logged or computed
    return m;
  }
  for (const auto& f : flags.given())
    if (!applies_to_folders(f))
      throw troupe::config_error("a checkpoint folder records its model: " + f +
                                 " does not apply (it is for a state_dict file)");
  const auto folder = troupe::find_checkpoint(from);
  m.cfg = with_run_settings(troupe::checkpoint_job_config(folder), flags, cfg);
  const auto ckpt = troupe::read_checkpoint_dir(folder, m.cfg);
  m.state = ckpt.model;
  m.step = ckpt.step;
  m.source = folder + " (after step " + std::to_string(ckpt.step) + ")";
  return m;
}

/// The flags of `troupe generate`: a file's model and where to run.
bool model_source_key(const std::string& k) {
  return k == "train.workload" || k == "train.model" || k == "train.device" || k.rfind("model.", 0) == 0 ||
         k == "data.tokenizer";
}

/// The flags of `troupe eval`: those and the data.
bool model_and_data_key(const std::string& k) {
  return model_source_key(k) || k == "data.fortunes_dir" || k == "data.fmnist_dir" || k == "data.text" ||
         k == "data.val_text";
}

/// Runs `body` with the model of --checkpoint `from`, after `check` (if given) of the
/// flags' configuration: bad flags or configuration, an unreadable or mis-shaped model or
/// missing data exit 2; any other failure 1.
int with_trained_model(const config_flags& flags, const std::string& from,
                       const std::function<int(trained_model&)>& body,
                       const std::function<void(troupe::job_config&)>& check = {}) {
  troupe::job_config cfg;
  trained_model m;
  try {
    cfg = flags.load();
    if (check) check(cfg);
    m = load_trained_model(flags, from, cfg);
  } catch (const std::invalid_argument& e) {  // config_error too
    return fail(exit_usage, e.what());
  } catch (const std::exception& e) {  // a model or data that cannot be read: bad input too
    return fail(troupe::exit_code_of(e), e.what());
  }
  try {
    return body(m);
  } catch (const std::exception& e) {  // (its data missing, too, is bad input)
    return fail(troupe::exit_code_of(e), e.what());
  }
}

struct generate_args {
  std::string from, prompt = "The ";
  troupe::sampling_options sampling;
};

/// `troupe generate`: the prompt and the bytes a trained gpt model adds, on stdout as they
/// come; where the model came from on stderr.
int run_generate_command(const config_flags& flags, const generate_args& a) {
  const auto gpt_only = [&](troupe::job_config& cfg) {
    troupe::check_sampling(a.sampling, a.prompt);
    if (cfg.model().type != troupe::model_spec::kind::decoder)
      throw troupe::config_error("generate needs a gpt workload, not " + cfg.workload);
  };
  const auto run = [&](trained_model& m) {
    const auto device = troupe::resolve_device(m.cfg.device);
    // The run's tokenizer, else the model folder's.
    const auto tok_name = !m.cfg.tokenizer.empty() || m.cfg.hf_model.empty() ? m.cfg.tokenizer
                          : troupe::tokenizer::in_folder(m.cfg.hf_model) ? m.cfg.hf_model
                                                                          : "";
    const char* unit = tok_name.empty() ? "bytes" : "pieces";
    spdlog::info("generating {} {} with {} from {} on {}: temperature {}, top-k {}, seed {}", a.sampling.tokens, unit,
                 m.cfg.model_label(), m.source, device.str(), a.sampling.temperature, a.sampling.top_k,
                 a.sampling.seed);
    std::fwrite(a.prompt.data(), 1, a.prompt.size(), stdout);
    std::fflush(stdout);
    const auto start = std::chrono::steady_clock::now();
    std::unique_ptr<troupe::tokenizer> tok;
    if (!tok_name.empty()) tok = std::make_unique<troupe::tokenizer>(tok_name);
    troupe::generate(
        m.cfg.model(), m.state, a.prompt, a.sampling, device,
        [](char c) {
          std::fputc(c, stdout);
          std::fflush(stdout);
        },
        tok.get());
    std::fputc('\n', stdout);
    std::fflush(stdout);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    spdlog::info("generated {} {} in {:.2f} s ({:.1f} {}/s; key/value cache {})", a.sampling.tokens, unit, s,
                 s > 0 ? a.sampling.tokens / s : 0.0, unit, a.sampling.kv_cache ? "on" : "off");
    return 0;
  };
  return with_trained_model(flags, a.from, run, gpt_only);
}

struct tokenizer_args {
  std::string text, val_text, fortunes_dir = troupe::text_corpus::default_dir, out;
  int vocab_size = 0;
};

/// `troupe tokenizer`: a SentencePiece BPE model trained on the lines of a corpus's
/// training split (WORKLOADS.md section 5's options).
int run_tokenizer_command(const tokenizer_args& a) {
  try {
    const auto corpus = a.text.empty()       ? troupe::text_corpus(a.fortunes_dir)
                        : a.val_text.empty() ? troupe::text_corpus::read_text(a.text)
                                             : troupe::text_corpus::read_text(a.text, a.val_text);
    const auto bytes = corpus.bytes(0, corpus.n_train());
    std::vector<std::string> lines;
    std::string line;
    for (const auto b : bytes) {
      if (b != '\n') {
        line.push_back(char(b));
      } else if (!line.empty()) {
        lines.push_back(std::move(line));
        line.clear();
      }
    }
    if (!line.empty()) lines.push_back(std::move(line));
    const auto start = std::chrono::steady_clock::now();
    troupe::tokenizer::train(lines, a.vocab_size, a.out);
    const troupe::tokenizer tok(a.out);
    spdlog::info("trained a BPE tokenizer of {} pieces on {} lines ({} bytes) of the training split of {} in {:.1f} s: "
                 "{} ({})",
                 tok.size(), lines.size(), bytes.size(), a.text.empty() ? "the fortunes corpus" : a.text,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), a.out,
                 tok.fingerprint());
    return 0;
  } catch (const std::exception& e) {
    return fail(troupe::exit_code_of(e), e.what());
  }
}

struct preprocess_args {
  std::vector<std::string> data;
  std::string model, tokenizer, field = "text", out;
  int threads = 0;
};

/// `troupe preprocess`: documents encoded into a Megatron indexed dataset, as Megatron's
/// preprocess_data.py --append-eod writes it (one sequence per document, EOS last).
int run_preprocess_command(const preprocess_args& a) {
  try {
    const std::string name = a.tokenizer.empty() ? a.model : a.tokenizer;
    if (name.empty()) throw troupe::config_error("preprocess needs a tokenizer: --model DIR or --tokenizer");
    const troupe::tokenizer tok(name);
    const int eos = troupe::document_eos(a.model, tok.eos_id());
    if (eos < 0)
      throw troupe::data_error("tokenizer " + name + " has no EOS token (config.json's eos_token_id, "
                               "tokenizer_config.json's eos_token): documents end with one");
    const int threads = a.threads > 0 ? a.threads : int(std::max(1u, std::thread::hardware_concurrency()));
    const auto start = std::chrono::steady_clock::now();
    std::uint64_t bytes = 0, documents = 0;
    for (const auto& path : a.data) {  // the files' bytes, for the rate
      if (troupe::data_format_of(path) == troupe::data_format::megatron)
        throw troupe::data_error("data " + path + " is already a Megatron dataset");
      for (const auto& file : troupe::text_corpus::text_files(path)) bytes += std::filesystem::file_size(file);
    }
    troupe::megatron_writer out(a.out, tok.size());
    for (const auto& path : a.data) {
      troupe::encode_documents(path, a.field, tok, eos, threads, [&](const std::vector<int>& ids) {
        out.add_document(ids);
        ++documents;
      });
    }
    out.finish();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    spdlog::info("wrote {}.bin and {}.idx: {} documents, {} tokens ({}) from {} bytes of text with {} ({}) in {:.1f} s "
                 "({:.1f} MB/s on {} threads)",
                 a.out, a.out, documents, out.tokens(), out.dtype_code() == 8 ? "uint16" : "int32", bytes, name,
                 tok.describe(), s, s > 0 ? double(bytes) / s / 1e6 : 0.0, threads);
    return 0;
  } catch (const std::exception& e) {
    return fail(troupe::exit_code_of(e), e.what());
  }
}

/// `troupe export`: a trained model as a Hugging Face folder (config.json, model.safetensors).
int run_export_command(const config_flags& flags, const std::string& from, const std::string& to,
                       const std::string& dtype) {
  const auto decoders_only = [&](troupe::job_config& cfg) {
    if (cfg.model().type != troupe::model_spec::kind::decoder)
      throw troupe::config_error("export writes the decoder workloads' models, not " + cfg.workload);
  };
  return with_trained_model(
      flags, from,
      [&](trained_model& m) {
        troupe::hf_export_options opts;
        opts.dtype = dtype == "bfloat16" ? torch::kBFloat16 : dtype == "float16" ? torch::kFloat16 : torch::kFloat32;
        opts.source = m.cfg.hf_model;  // its spelling, generation config and tokenizer files
        opts.tokenizer = m.cfg.tokenizer;
        const auto n = troupe::export_hf_folder(to, m.cfg.model(), m.state, opts);
        spdlog::info("exported {} from {} to {}: config.json, generation_config.json{} and model.safetensors ({} "
                     "tensors, {})",
                     m.cfg.model_label(), m.source, to, opts.source.empty() ? "" : ", the tokenizer files of " + opts.source,
                     n, dtype);
        return 0;
      },
      decoders_only);
}

/// `troupe eval`: a trained model's loss on its workload's evaluation set (the validation
/// windows of the fortunes corpus; the Fashion-MNIST test set, with accuracy), as the
/// training run's evaluations compute it; one JSON line on stdout.
int run_eval_command(const config_flags& flags, const std::string& from) {
  return with_trained_model(flags, from, [&](trained_model& m) {
    const auto device = troupe::resolve_device(m.cfg.device);
    const bool text = m.cfg.model().type == troupe::model_spec::kind::decoder;
    const auto set = troupe::training_data(m.cfg, troupe::training_data::use::evaluation).evaluation_set();
    spdlog::info("evaluating {} from {} on {}: {} {}{}", m.cfg.model_label(), m.source, device.str(),
                 set.input.size(0), text ? "validation windows" : "test images", m.cfg.data_label());
    const auto start = std::chrono::steady_clock::now();
    troupe::local_pipeline model(m.cfg.model(), m.state, 1, 1, {}, 1, device);
    const auto e = troupe::evaluate_model(model, set, text, 0, m.cfg.eval_tokens);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    nlohmann::json line{{"workload", m.cfg.workload}, {"checkpoint", from}};
    if (m.step >= 0) line["step"] = m.step;
    for (const auto& [key, value] : e.fields()) line[key] = value;
    if (text) {
      line["perplexity"] = std::exp(e.loss);
      line["bits_per_byte"] = e.bits_per_byte();
      spdlog::info("validation loss {:.4f} (perplexity {:.2f}, {:.3f} bits per byte) in {:.2f} s", e.loss,
                   std::exp(e.loss), e.bits_per_byte(), s);
    } else {
      spdlog::info("test loss {:.4f}, test accuracy {:.2f} % in {:.2f} s", e.loss, 100 * e.accuracy, s);
    }
    std::cout << line.dump() << std::endl;
    return 0;
  });
}

}  // namespace

int main(int argc, char** argv) {
  troupe_cli::end_with_launcher();  // (before anything else: it is kept across the re-exec below)
  troupe::run_with_blas_kernels(argv);
  troupe::tune_host_allocator();
  auto logger = spdlog::stderr_color_mt("troupe");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
  try {
    troupe_cli::read_environment();  // the process's one read of its environment (launch/environment.hpp)
  } catch (const troupe::config_error& e) {
    return fail(exit_usage, e.what());
  }

  CLI::App app{"Troupe: actor-based distributed training"};
  app.require_subcommand(1);

  // troupe train
  auto* train = app.add_subcommand("train", "train a model (default: gpt-tiny on fortunes)");
  config_flags train_flags;
  train_flags.add_to(train);

  // troupe node (troupe-node)
  auto* node = app.add_subcommand("node", "one node of a multi-process job (started by launch/troupe train --nodes N)");
  config_flags node_flags;
  node_flags.add_to(node);

  // troupe generate
  auto* gen = app.add_subcommand("generate", "continue a prompt with a trained gpt model");
  config_flags gen_flags;  // for a state_dict file: its model; and where to run
  gen_flags.add_to(gen, model_source_key);
  generate_args gen_args;
  const std::string checkpoint_help =
      "a checkpoint folder (--checkpoint-dir's, or one step folder; its model is recorded) or a "
      "state_dict file (--save's, --init's, torch.save's; give its workload and [model] keys)";
  gen->add_option("--checkpoint", gen_args.from, checkpoint_help)->required();
  gen->add_option("--prompt", gen_args.prompt, "the text to continue (default: 'The ')");
  gen->add_option("--tokens", gen_args.sampling.tokens, "bytes to generate (default 200)");
  gen->add_option("--temperature", gen_args.sampling.temperature,
                  "divides the logits: lower is more predictable; 0 takes the most likely byte (default 0.8)");
  gen->add_option("--top-k", gen_args.sampling.top_k, "sample among the k most likely bytes (default 0: all)");
  gen->add_option("--seed", gen_args.sampling.seed, "the sampler's seed (default 0): same seed, same text");
  gen->add_flag("--no-kv-cache{false}", gen_args.sampling.kv_cache,
                "run every byte's whole context through the model again (slower; the same text, to rounding)");

  // troupe eval
  auto* eval = app.add_subcommand("eval", "a trained model's loss on its workload's evaluation set");
  config_flags eval_flags;
  eval_flags.add_to(eval, [](const std::string& k) { return model_and_data_key(k) || k == "train.eval_tokens"; });
  std::string eval_from;
  eval->add_option("--checkpoint", eval_from, checkpoint_help)->required();

  // troupe tokenizer
  auto* tokc = app.add_subcommand("tokenizer", "train a SentencePiece BPE tokenizer on a corpus's training split "
                                               "(for --tokenizer; WORKLOADS.md section 5)");
  tokenizer_args tok_args;
  tokc->add_option("--text", tok_args.text, "a file or a folder of files (default: the fortunes corpus)");
  tokc->add_option("--val-text", tok_args.val_text, "with --text: its validation text (then all of --text trains)");
  tokc->add_option("--fortunes-dir", tok_args.fortunes_dir, "the fortunes corpus's folder");
  tokc->add_option("--vocab-size", tok_args.vocab_size, "pieces (at least the 256 byte pieces, 3 special ones and "
                                                        "every character of the text)")
      ->required()
      ->check(CLI::Range(260, 1 << 20));
  tokc->add_option("--out", tok_args.out, "the model file to write")->required();

  // troupe preprocess
  auto* pre = app.add_subcommand("preprocess", "encode documents into a Megatron indexed dataset (PREFIX.bin, "
                                               "PREFIX.idx) as Megatron's preprocess_data.py --append-eod does, for "
                                               "--data PREFIX (and for Megatron)");
  preprocess_args pre_args;
  pre->add_option("--data", pre_args.data, "documents: .jsonl files, folders, files (one or more, in order)")->required();
  pre->add_option("--model", pre_args.model, "the model folder whose tokenizer (and config.json's EOS) to use");
  pre->add_option("--tokenizer", pre_args.tokenizer, "a tokenizer.json, a SentencePiece model or a folder instead");
  pre->add_option("--data-field", pre_args.field, "JSON lines: the field that holds a document (default text)");
  pre->add_option("--threads", pre_args.threads, "encoding threads (default: every core)");
  pre->add_option("--out", pre_args.out, "the dataset's prefix to write")->required();

  // troupe export
  auto* exp = app.add_subcommand("export", "write a trained model as a Hugging Face folder (config.json, "
                                           "model.safetensors) that transformers' from_pretrained loads");
  config_flags exp_flags;  // for a state_dict file: its model
  exp_flags.add_to(exp, model_source_key);
  std::string exp_from, exp_to, exp_dtype = "float32";
  exp->add_option("checkpoint", exp_from, checkpoint_help)->required();
  exp->add_option("--to", exp_to, "the folder to write (made if missing)")->required();
  exp->add_option("--dtype", exp_dtype, "of the written tensors: float32 (default), bfloat16 or float16")
      ->check(CLI::IsMember({"float32", "bfloat16", "float16"}));

  // troupe elastic-layout (for launch/troupe --min-nodes): the job's layout on the hosts left
  auto* elastic = app.add_subcommand("elastic-layout",
                                     "the layout a job of these flags takes on fewer nodes (launch/troupe "
                                     "--min-nodes): prints 'nodes data_parallel microbatches', a line saying so, and "
                                     "the job's checkpoint_dir (an empty line: none)");
  config_flags elastic_flags;
  elastic_flags.add_to(elastic);
  int elastic_hosts = 0, elastic_min = 1;
  elastic->add_option("--hosts", elastic_hosts, "hosts left (at most this many nodes)")->required();
  elastic->add_option("--min-nodes", elastic_min, "the fewest nodes the job may run on");

  // troupe check-host (for launch/troupe --hostfile): can this host run a node of the job?
  auto* check = app.add_subcommand("check-host",
                                   "whether this host can run a node of a job of these flags (launch/troupe asks "
                                   "each host of a --hostfile job): exit 1 with the reason when not, 2 for a bad job");
  config_flags check_flags;
  check_flags.add_to(check, {}, false);
  bool check_quick = false;
  check->add_flag("--quick", check_quick, "no kernel on the device (the job may be running on it)");

  // troupe check-job (for launch/troupe): what can be checked before a multi-node job's
  // node processes start
  auto* check_job = app.add_subcommand("check-job",
                                       "whether a job of these flags can start on --nodes node processes (launch/troupe "
                                       "asks before it starts them): prints its checkpoint_dir (an empty line: none); "
                                       "exit 2 with the reason when it cannot");
  config_flags check_job_flags;
  check_job_flags.add_to(check_job);
  int check_job_nodes = 1;
  bool check_job_here = false;
  check_job->add_option("--nodes", check_job_nodes, "node processes")->required();
  check_job->add_flag("--here", check_job_here,
                      "node 0 runs on this machine: its data and output paths (checkpoint_dir free) too");

  // troupe schedule
  auto* sched = app.add_subcommand("schedule", "print a pipeline schedule and its simulated bubble");
  std::string kind = "1f1b", format = "table";
  int stages = 4, microbatches = 8, chunks = 0;
  troupe::op_costs costs;
  sched->add_option("--kind", kind, troupe::schedule_kind_names());
  sched->add_option("--stages", stages, "pipeline stages");
  sched->add_option("--microbatches", microbatches, "micro-batches");
  sched->add_option("--chunks", chunks, "virtual chunks per stage (default: the kind's, 2 for zbv and dualpipev)");
  sched->add_option("--format", format, "table, json, or svg (the simulated timeline)")
      ->check(CLI::IsMember({"table", "json", "svg"}));
  sched->add_option("--forward-cost", costs.forward, "simulated cost of one forward");
  sched->add_option("--backward-cost", costs.backward,
                    "simulated cost of one backward (kinds that split it: of its B and W together)");
  sched->add_option("--weight-cost", costs.weight, "the part of the backward cost that is W (default: half)")
      ->check(CLI::NonNegativeNumber);
  sched->add_option("--pair-cost", costs.pair,
                    "cost of an overlapped F&B pair (combined-1f1b, dualpipev; default: F + B, or the two "
                    "all-to-alls where longer)")
      ->check(CLI::NonNegativeNumber);
  sched->add_option("--alltoall-cost", costs.alltoall,
                    "an op's expert all-to-all time: waited for outside a pair, hidden behind the other op "
                    "inside one (default 0)")
      ->check(CLI::NonNegativeNumber);

  // troupe plan
  auto& plan_cmd = add_plan_command(app);

  // troupe trace-svg
  auto* trace_svg = app.add_subcommand("trace-svg", "draw one step of a run's trace (trace = true) as the "
                                                    "schedule drawing of `troupe schedule --format svg`");
  std::string trace_path, svg_out;
  long long svg_step = -1;
  int svg_replica = 0;
  trace_svg->add_option("trace", trace_path, "the Chrome trace (trace.json)")->required()->check(CLI::ExistingFile);
  trace_svg->add_option("--step", svg_step, "the step to draw (default: the trace's last)");
  trace_svg->add_option("--replica", svg_replica, "the data-parallel replica to draw (default 0)");
  trace_svg->add_option("-o,--output", svg_out, "write the SVG there (default: standard output)");

  // troupe config-reference: docs/configuration.md
  auto* reference = app.add_subcommand("config-reference", "print every configuration key as Markdown "
                                                           "(docs/configuration.md)");

  // troupe blas-core (for tests/run, tests/bench/run): the OpenBLAS kernels
  // this program computes with, which they export as OPENBLAS_CORETYPE.
  auto* blas_core = app.add_subcommand("blas-core", "print the OpenBLAS core type whose kernels this program "
                                                    "uses (nothing when the BLAS is not OpenBLAS)");

  // Run as `troupe-node`: the node subcommand.
  std::vector<std::string> args(argv + 1, argv + argc);
  const std::string self_name = argv[0];
  if (self_name.size() >= 11 && self_name.compare(self_name.size() - 11, 11, "troupe-node") == 0)
    args.insert(args.begin(), "node");
  std::reverse(args.begin(), args.end());  // CLI11 takes them in reverse order
  try {
    app.parse(args);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ExtrasError& e) {
    // CLI11's own message names them in the order it took them (the reverse of the
    // command line's, see above); remaining() gives the command line's.
    const auto subs = app.get_subcommands();
    return fail(exit_usage, extras_text(subs.empty() ? &app : subs.back(), app.remaining(true), e.what()));
  } catch (const CLI::ParseError& e) {
    return fail(exit_usage, e.what());
  }

  if (*blas_core) {
    const auto core = troupe::blas_core_in_use();
    if (!core.empty()) std::printf("%s\n", core.c_str());
    return 0;
  }
  if (*reference) {
    std::fputs(troupe::config_reference().c_str(), stdout);
    return 0;
  }
  if (*sched) {
    try {
      const auto s = troupe::make_schedule(troupe::parse_schedule_kind(kind), stages, microbatches, chunks);
      if (format == "svg")
        std::fputs(troupe::to_svg(troupe::timeline_of(s, costs)).c_str(), stdout);
      else
        print_schedule(s, troupe::simulate(s, costs), format);
      return 0;
    } catch (const troupe::schedule_error& e) {
      return fail(exit_usage, e.what());
    }
  }
  if (*plan_cmd.cmd) return run_plan(plan_cmd);
  if (*trace_svg) {
    try {
      std::ifstream in(trace_path);
      std::stringstream text;
      text << in.rdbuf();
      const auto svg = troupe::to_svg(troupe::timeline_of_trace(text.str(), svg_step, svg_replica));
      if (svg_out.empty()) {
        std::fputs(svg.c_str(), stdout);
      } else {
        std::ofstream out(svg_out);
        out << svg;
        if (!out) return fail(1, "cannot write " + svg_out);
      }
      return 0;
    } catch (const std::runtime_error& e) {
      return fail(exit_usage, trace_path + ": " + e.what());
    }
  }

  if (*elastic) {
    try {
      // The layout does not depend on the device, and the launcher's host may have no GPU
      // (where `device = "cuda"` would be refused).
      const auto cfg = elastic_flags.load({{"train.device", "cpu"}});
      const auto l = troupe::shrink_layout(cfg, elastic_hosts, elastic_min);
      std::printf("%d %d %d\n", l.nodes, l.data_parallel, l.microbatches);
      // The tensor-parallel width stays; it is named where there is one (its groups decide
      // which node counts fit).
      const std::string tp = cfg.tensor_parallel > 1 ? " x tensor-parallel " + std::to_string(cfg.tensor_parallel) : "";
      std::printf("pipeline %d x data-parallel %d%s of %d micro-batches -> pipeline %d x data-parallel %d%s of %d "
                  "micro-batches (of %d samples) on %d node(s)\n",
                  cfg.pipeline, cfg.data_parallel, tp.c_str(), cfg.microbatches, cfg.pipeline, l.data_parallel,
                  tp.c_str(), l.microbatches, cfg.microbatch_size(), l.nodes);
      std::printf("%s\n", cfg.checkpoint_dir.c_str());  // the launcher regrows only a job it can resume
      return 0;
    } catch (const troupe::config_error& e) {
      return fail(exit_usage, e.what());
    }
  }
  if (*check_job) {
    try {
      // (The device is node 0's to check: the launcher's machine may have no GPU.)
      auto cfg = check_job_flags.load(check_job_here ? std::vector<std::pair<std::string, std::string>>{}
                                                     : std::vector<std::pair<std::string, std::string>>{
                                                           {"train.device", "cpu"}});
      cfg.validate();
      troupe::job_slots(cfg, 0, check_job_nodes);
      if (check_job_here) {
        spdlog::set_level(spdlog::level::err);  // (node 0 warns about what it finds itself)
        troupe::training_data::check_available(cfg);
        troupe::check_output_paths(cfg);  // (its lock on checkpoint_dir ends with this process)
      }
      std::printf("%s\n", cfg.checkpoint_dir.c_str());  // what a restart would resume from
      return 0;
    } catch (const std::exception& e) {
      return fail(troupe::exit_code_of(e), e.what());
    }
  }
  if (*check) {
    if (!check_flags.config_path.empty() && !std::filesystem::is_regular_file(check_flags.config_path))
      return fail(1, "config file " + check_flags.config_path + " is not on this host (in " +
                         std::filesystem::current_path().string() + ")");
    troupe::job_config cfg;
    try {
      cfg = check_flags.load();
    } catch (const troupe::config_error& e) {
      // A job that is valid but for its device (a GPU asked for, none usable here) is
      // this host's fault (1); anything else is the job's (2).
      try {
        check_flags.load({{"train.device", "cpu"}});
      } catch (const troupe::config_error&) {
        return fail(exit_usage, e.what());
      }
      return fail(1, e.what());
    }
    try {
      std::printf("%s\n", check_host(cfg, check_quick).c_str());
      return 0;
    } catch (const std::exception& e) {
      return fail(1, e.what());
    }
  }
  if (*node) return run_node_command(node_flags);
  if (*gen) return run_generate_command(gen_flags, gen_args);
  if (*eval) return run_eval_command(eval_flags, eval_from);
  if (*exp) return run_export_command(exp_flags, exp_from, exp_to, exp_dtype);
  if (*tokc) return run_tokenizer_command(tok_args);
  if (*pre) return run_preprocess_command(pre_args);

  troupe::job_config cfg;
  try {
    cfg = train_flags.load();
  } catch (const troupe::config_error& e) {
    return fail(exit_usage, e.what());
  }
  try {
    install_stop_handlers(true);
    if (cfg.runtime == "local") return troupe::run_training(cfg, troupe::stop_requested, troupe::in_process_groups);
    troupe::actor_run_options opts;
    opts.final_state = false;  // nothing here reads it: --save and checkpoint_dir gather what they write
    opts.launch = troupe_cli::read_environment();
    const auto result = troupe::run_actor_training(cfg, opts);
    if (result.exit_code != 0) return run_ended(result.exit_code, result.error);
    return 0;
  } catch (const std::exception& e) {  // bad input (a missing folder, data, weights, checkpoint): 2
    return fail(troupe::exit_code_of(e), e.what());
  }
}
