// The troupe command: `troupe train` and `troupe schedule`.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdio>
#include <deque>
#include <iostream>

#include "actors/runtime.hpp"
#include "compute/checkpoint.hpp"
#include "compute/data.hpp"
#include "compute/job_config.hpp"
#include "compute/schedule.hpp"
#include "compute/trainer.hpp"

namespace {

constexpr int exit_usage = 2;  ///< bad arguments or configuration

int fail(int code, const std::string& msg) {
  std::fprintf(stderr, "troupe: error: %s\n", msg.c_str());
  return code;
}

void print_schedule(const troupe::schedule& s, const troupe::simulation& sim, const std::string& format) {
  if (format == "json") {
    nlohmann::json ranks = nlohmann::json::array();
    for (const auto& ops : s.ranks) {
      nlohmann::json row = nlohmann::json::array();
      for (const auto& op : ops)
        row.push_back({{"op", op.kind == troupe::op_kind::forward ? "F" : "B"}, {"mb", op.mb}, {"chunk", op.chunk}});
      ranks.push_back(std::move(row));
    }
    nlohmann::json out{{"kind", troupe::to_string(s.kind)},
                       {"stages", s.stages},
                       {"microbatches", s.microbatches},
                       {"chunks", s.chunks},
                       {"ranks", ranks},
                       {"bubble", sim.bubble},
                       {"makespan", sim.makespan},
                       {"peak_activations", sim.peak_activations}};
    std::cout << out.dump() << "\n";
    return;
  }
  std::printf("%s: %d stages x %d micro-batches x %d chunks (F%s, B%s: micro-batch%s)\n",
              troupe::to_string(s.kind).c_str(), s.stages, s.microbatches, s.chunks,
              s.chunks > 1 ? "mb.chunk" : "mb", s.chunks > 1 ? "mb.chunk" : "mb", s.chunks > 1 ? ".chunk" : "");
  for (int r = 0; r < s.stages; ++r) {
    std::printf("stage %d |", r);
    for (const auto& op : s.ranks[r]) std::printf(" %s", troupe::to_string(op, s.chunks > 1).c_str());
    std::printf("   (peak activations %d)\n", sim.peak_activations[r]);
  }
  std::printf("bubble %.4f, makespan %.1f\n", sim.bubble, sim.makespan);
}

}  // namespace

int main(int argc, char** argv) {
  auto logger = spdlog::stderr_color_mt("troupe");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");

  CLI::App app{"Troupe: actor-based distributed training"};
  app.require_subcommand(1);

  // troupe train
  auto* train = app.add_subcommand("train", "train a model (default: gpt-tiny on fortunes)");
  std::string config_path;
  train->add_option("--config", config_path, "job config (TOML); flags override it")->check(CLI::ExistingFile);
  std::deque<std::pair<CLI::Option*, std::string>> key_options;  // stable addresses
  for (const auto& key : troupe::config_keys()) {
    key_options.emplace_back(nullptr, "");
    key_options.back().first = train->add_option(key.flag(), key_options.back().second, key.help + " [" + key.name + "]");
  }

  // troupe schedule
  auto* sched = app.add_subcommand("schedule", "print a pipeline schedule and its simulated bubble");
  std::string kind = "1f1b", format = "table";
  int stages = 4, microbatches = 8, chunks = 1;
  double f_cost = 1.0, b_cost = 2.0;
  sched->add_option("--kind", kind, "gpipe, 1f1b or interleaved-1f1b");
  sched->add_option("--stages", stages, "pipeline stages");
  sched->add_option("--microbatches", microbatches, "micro-batches");
  sched->add_option("--chunks", chunks, "virtual chunks per stage (interleaved-1f1b)");
  sched->add_option("--format", format, "table or json")->check(CLI::IsMember({"table", "json"}));
  sched->add_option("--forward-cost", f_cost, "simulated cost of one forward");
  sched->add_option("--backward-cost", b_cost, "simulated cost of one backward");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(exit_usage, e.what());
  }

  if (*sched) {
    try {
      const auto s = troupe::make_schedule(troupe::parse_schedule_kind(kind), stages, microbatches, chunks);
      print_schedule(s, troupe::simulate(s, f_cost, b_cost), format);
      return 0;
    } catch (const troupe::schedule_error& e) {
      return fail(exit_usage, e.what());
    }
  }

  troupe::job_config cfg;
  try {
    std::vector<std::pair<std::string, std::string>> overrides;
    for (std::size_t i = 0; i < key_options.size(); ++i)
      if (key_options[i].first->count() > 0)
        overrides.emplace_back(troupe::config_keys()[i].name, key_options[i].second);
    cfg = troupe::load_job_config(config_path, overrides);
  } catch (const troupe::config_error& e) {
    return fail(exit_usage, e.what());
  }
  try {
    if (cfg.runtime == "local") return troupe::run_training(cfg);
    const auto result = troupe::run_actor_training(cfg);
    if (result.exit_code != 0) return fail(result.exit_code, result.error);
    return 0;
  } catch (const troupe::data_error& e) {
    return fail(1, e.what());
  } catch (const troupe::checkpoint_error& e) {
    return fail(1, e.what());
  } catch (const troupe::model_error& e) {
    return fail(1, e.what());
  } catch (const std::exception& e) {
    return fail(1, e.what());
  }
}
