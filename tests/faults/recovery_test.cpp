// Checkpoint folders and resuming: a run cut by a failure and resumed from its newest
// checkpoint ends bit-identical to a run that never stopped; bad checkpoints are refused
// with a clear message.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "test_util.hpp"

namespace troupe {

namespace {

job_config small_job() {
  auto c = test::small_config(6);
  c.pipeline = 2;
  c.data_parallel = 2;
  c.microbatches = 4;
  c.global_batch = 16;  // half the default: micro-batches of 2 samples, the same faults in less CPU time
  c.eval_interval = 0;
  c.max_step_retries = 0;  // failures end the run (exit 75), as in a multi-node job
  return c;
}

actor_run_result run(const job_config& c) {
  actor_run_options quiet;
  quiet.quiet = true;
  return run_actor_training(c, quiet);
}

std::vector<nlohmann::json> metrics_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

/// (step, loss) of every step line of a metrics log.
std::vector<std::pair<int, double>> losses_of(const std::vector<nlohmann::json>& lines) {
  std::vector<std::pair<int, double>> out;
  for (const auto& j : lines)
    if (j.contains("loss")) out.emplace_back(j.at("step").get<int>(), j.at("loss").get<double>());
  return out;
}

std::string error_of(const std::string& folder, const job_config& c) {
  try {
    read_checkpoint_dir(folder, c);
  } catch (const checkpoint_error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Recovery, ResumeFromTheNewestCheckpointFolderIsBitIdentical) {
  test::temp_dir dir;
  auto c = small_job();
  c.metrics = dir / "straight.jsonl";
  const auto straight = run(c);
  ASSERT_EQ(straight.exit_code, 0) << straight.error;

  // Checkpoints after steps 2 and 4 (1-based); a stage throws inside step index 3, so
  // step index 2 ran and was logged after the newest checkpoint: it runs again.
  auto faulty = c;
  faulty.metrics = dir / "cut.jsonl";
  faulty.checkpoint_dir = dir / "ckpt";
  faulty.checkpoint_interval = 2;
  faulty.throw_at = "0:1:3";
  const auto cut = run(faulty);
  ASSERT_EQ(cut.exit_code, exit_recoverable) << cut.error;
  ASSERT_EQ(cut.losses.size(), 3u);
  EXPECT_EQ(find_checkpoint(dir / "ckpt"), dir / "ckpt/step-00000002");

  auto resumed_cfg = faulty;
  resumed_cfg.throw_at.clear();
  resumed_cfg.resume = "auto";
  const auto resumed = run(resumed_cfg);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.error;
  EXPECT_EQ(test::max_abs_diff(resumed.final_state, straight.final_state), 0.0);
  ASSERT_EQ(resumed.losses.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(resumed.losses[i], straight.losses[2 + i]) << i;

  // The metrics log reads as one run: every step once, the same losses, and a line that
  // says where the run resumed and how many steps it ran twice.
  const auto lines = metrics_lines(dir / "cut.jsonl");
  EXPECT_EQ(losses_of(lines), losses_of(metrics_lines(dir / "straight.jsonl")));
  int resumes = 0;
  for (const auto& j : lines)
    if (j.value("event", "") == "resume") {
      ++resumes;
      EXPECT_EQ(j.at("step"), 2);
      EXPECT_EQ(j.at("replayed_steps"), 1);
    }
  EXPECT_EQ(resumes, 1);

  // The final checkpoint: per-stage files PyTorch reads, whose union is the model.
  const auto last = find_checkpoint(dir / "ckpt");
  EXPECT_EQ(last, dir / "ckpt/step-00000006");
  const std::string cmd = "/usr/bin/python3 -c \"import torch, json, sys; d = sys.argv[1];"
                          " m = json.load(open(d + '/manifest.json')); n = 0\n"
                          "for f in m['files']:\n"
                          "  sd = torch.load(d + '/' + f['name'])\n"
                          "  n += len(sd) if f['kind'] == 'parameters' else 0\n"
                          "print(m['step'], n)\" " + last + " > " + (dir / "out.txt");
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream in(dir / "out.txt");
  int step = 0, n = 0;
  in >> step >> n;
  EXPECT_EQ(step, 6);
  EXPECT_EQ(n, int(straight.final_state.size()));
  // Without a usable 'latest' (a crash right after a folder was renamed into place) the
  // newest complete folder is taken.
  std::ofstream(dir / "ckpt/latest") << "step-00000099\n";
  EXPECT_EQ(find_checkpoint(dir / "ckpt"), last);
  std::filesystem::remove(dir / "ckpt/latest");
  EXPECT_EQ(find_checkpoint(dir / "ckpt"), last);
  // Older folders beyond keep_checkpoints (3) are gone; no temporary folder is left (the
  // job's lock, .lock, stays).
  int folders = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir / "ckpt")) {
    if (e.path().filename() != ".lock") {
      EXPECT_NE(e.path().filename().string().front(), '.') << e.path();
    }
    folders += e.is_directory();
  }
  EXPECT_EQ(folders, 3);
}

TEST(Recovery, ACheckpointResumesWithAnotherLayoutByParameterName) {
  test::temp_dir dir;
  auto c = small_job();
  const auto straight = run(c);
  ASSERT_EQ(straight.exit_code, 0) << straight.error;
  auto first = c;
  first.steps = 6;
  first.checkpoint_dir = dir / "ckpt";
  first.checkpoint_interval = 3;
  first.throw_at = "0:0:4";
  ASSERT_EQ(run(first).exit_code, exit_recoverable);
  auto other = c;  // one stage, no data parallelism: the shards are re-cut by name
  other.pipeline = 1;
  other.data_parallel = 1;
  other.resume = dir / "ckpt";
  const auto resumed = run(other);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.error;
  EXPECT_LE(test::max_abs_diff(resumed.final_state, straight.final_state), 1e-5);
}

TEST(Recovery, WrongOrDamagedCheckpointsAreRefusedClearly) {
  test::temp_dir dir;
  auto c = small_job();
  c.d_model = c.seq_len = 0;  // gpt-tiny's own shape: a manifest from before the [model] keys implies it
  c.steps = 2;
  c.checkpoint_dir = dir / "ckpt";
  ASSERT_EQ(run(c).exit_code, 0);
  const auto folder = find_checkpoint(dir / "ckpt");

  auto other_lr = c;
  other_lr.lr = 2e-3;
  const auto lr_error = error_of(folder, other_lr);
  EXPECT_NE(lr_error.find("another training configuration"), std::string::npos) << lr_error;
  EXPECT_NE(lr_error.find("optimizer.lr"), std::string::npos) << lr_error;

  // The number of heads does not show in the weights: the manifest's model shape does.
  auto other_heads = c;
  other_heads.heads = 8;
  const auto heads_error = error_of(folder, other_heads);
  EXPECT_NE(heads_error.find("model.heads 4 (checkpoint) vs 8 (this run)"), std::string::npos) << heads_error;
  auto same_shape = c;  // gpt-tiny's own shape, spelt out
  same_shape.layers = 8;
  same_shape.heads = 4;
  EXPECT_EQ(error_of(folder, same_shape), "");
  {  // a manifest written before the [model] keys: its workload's own shape
    const auto path = folder + "/manifest.json";
    auto manifest = nlohmann::json::parse(std::ifstream(path));
    for (const char* k : {"model.layers", "model.heads", "model.d_model", "model.d_ff", "model.seq_len"}) {
      ASSERT_TRUE(manifest.at("config").contains(k)) << k;
      manifest["config"].erase(k);
    }
    std::ofstream(path) << manifest.dump(2);
    EXPECT_EQ(error_of(folder, same_shape), "");
    EXPECT_NE(error_of(folder, other_heads).find("model.heads 4 (checkpoint) vs 8 (this run)"), std::string::npos);
  }

  auto mlp = job_config::defaults_for("fmnist-mlp");
  mlp.steps = 2;
  EXPECT_NE(error_of(folder, mlp).find("train.workload"), std::string::npos) << error_of(folder, mlp);

  std::filesystem::create_directories(dir / "empty");
  try {
    find_checkpoint(dir / "empty");
    ADD_FAILURE() << "an empty folder was taken for a checkpoint";
  } catch (const checkpoint_error& e) {
    EXPECT_NE(std::string(e.what()).find("not a Troupe checkpoint"), std::string::npos) << e.what();
  }

  // A truncated file: the manifest's size and CRC-32 catch it; the run refuses to start.
  const auto file = folder + "/stage-1.pt";
  std::filesystem::resize_file(file, std::filesystem::file_size(file) - 100);
  const auto truncated = error_of(folder, c);
  EXPECT_NE(truncated.find("stage-1.pt is truncated or corrupt"), std::string::npos) << truncated;
  auto resume = c;
  resume.steps = 2;
  resume.checkpoint_dir.clear();
  resume.resume = folder;
  EXPECT_THROW(run(resume), checkpoint_error);

  auto bad = c;
  bad.runtime = "local";
  EXPECT_THROW(bad.validate(), config_error);  // checkpoint folders need the actors runtime
  auto conflict = c;
  conflict.resume = folder;
  conflict.init = folder + "/stage-0.pt";
  EXPECT_THROW(conflict.validate(), config_error);
}

// Duplicated and delayed tensor messages and loss reports (control messages to the
// coordinator): the duplicate is recognised and dropped, the late one simply waited for;
// the results do not change at all.
TEST(Recovery, DuplicateAndDelayedMessagesChangeNothing) {
  auto c = small_job();
  c.steps = 3;
  const auto straight = run(c);
  ASSERT_EQ(straight.exit_code, 0) << straight.error;
  for (const char* fault : {"duplicate@0:0:1", "duplicate@1:1:2", "delay@0:1:1", "delay@1:0:0",
                            "duplicate@1:1:1:loss", "delay@0:1:2:loss"}) {
    auto f = c;
    f.message = fault;
    const auto got = run(f);
    ASSERT_EQ(got.exit_code, 0) << fault << ": " << got.error;
    EXPECT_EQ(test::max_abs_diff(got.final_state, straight.final_state), 0.0) << fault;
    EXPECT_EQ(got.losses, straight.losses) << fault;
  }
}

// A corrupt tensor (caught by its checksum) or a lost one (caught by the hang watchdog,
// which names it, or by the step timeout, whichever comes first: the watchdog's limit is 5
// s or 4 median steps, the step timeout 6 s) aborts the step before anything is applied;
// resuming from the checkpoint repairs the run bit for bit. (A 2 s step timeout was
// shorter than a healthy step of this job beside CI's other entries on a slow day.)
TEST(Recovery, ACorruptOrLostMessageAbortsTheStepAndAResumeRepairsIt) {
  test::temp_dir dir;
  auto c = small_job();
  c.steps = 4;
  c.checksum = true;
  const auto straight = run(c);
  ASSERT_EQ(straight.exit_code, 0) << straight.error;
  struct fault_case {
    const char* fault;
    std::vector<std::string> detected;  // one of these
  };
  for (const auto& [fault, detected] :
       {fault_case{"corrupt@0:0:2", {"checksum mismatch"}}, fault_case{"corrupt@1:1:1", {"checksum mismatch"}},
        fault_case{"drop@0:1:2",
                   {"was sent and never received: a lost message", "did not finish within 6 s"}}}) {
    auto f = c;
    f.checkpoint_dir = dir / (std::string("ckpt-") + fault);
    f.checkpoint_interval = 1;
    f.step_timeout = 6;
    f.message = fault;
    const auto cut = run(f);
    ASSERT_EQ(cut.exit_code, exit_recoverable) << fault << ": " << cut.error;
    EXPECT_TRUE(std::any_of(detected.begin(), detected.end(),
                            [&](const std::string& d) { return cut.error.find(d) != std::string::npos; }))
        << fault << ": " << cut.error;
    const auto failed_step = std::size_t(fault[std::string(fault).size() - 1] - '0');
    ASSERT_EQ(cut.losses.size(), failed_step) << fault << ": nothing of the failed step is committed";
    f.message.clear();
    f.resume = "auto";
    const auto resumed = run(f);
    ASSERT_EQ(resumed.exit_code, 0) << fault << ": " << resumed.error;
    EXPECT_EQ(test::max_abs_diff(resumed.final_state, straight.final_state), 0.0) << fault;
  }
}

// One process: a failed step is retried in place. The supervisor kills every actor and
// rebuilds them from the in-memory snapshots of the state before the step (fresh
// in-process communicators); the step runs again and the run ends bit-identical, with an
// abort and a retry line in the metrics log for each retry, without exiting. (A lost
// message or a stall is found by the step timeout: 5 s, so that a step slowed down by
// the tests around it is not taken for one; were it, it would be one more retry.)
TEST(Recovery, AFailedStepIsRetriedInPlaceInOneProcess) {
  test::temp_dir dir;
  auto c = small_job();
  c.steps = 4;
  c.checksum = true;
  c.step_timeout = 5;
  c.max_step_retries = 2;
  const auto straight = run(c);
  ASSERT_EQ(straight.exit_code, 0) << straight.error;
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{{"throw_at", "0:1:2"},
                                                                                  {"throw_at", "1:0:0"},
                                                                                  {"throw_at", "0:0:1:late"},
                                                                                  {"throw_at", "1:1:3:late"},
                                                                                  {"message", "corrupt@0:0:1"},
                                                                                  {"message", "drop@1:1:3"},
                                                                                  {"message", "drop@0:1:2:loss"},
                                                                                  {"stall", "1:0:2"}}) {
    auto f = c;
    f.set("faults." + key, value, "test");
    f.metrics = dir / (key + value + ".jsonl");
    const auto got = run(f);
    ASSERT_EQ(got.exit_code, 0) << key << " " << value << ": " << got.error;
    EXPECT_EQ(test::max_abs_diff(got.final_state, straight.final_state), 0.0) << value;
    EXPECT_EQ(got.losses, straight.losses) << value;
    int aborts = 0, retries = 0;
    for (const auto& j : metrics_lines(f.metrics)) {
      aborts += j.value("event", "") == "abort" && j.at("retry_in_place") == true;
      retries += j.value("event", "") == "retry";
    }
    EXPECT_GE(aborts, 1) << value;
    EXPECT_EQ(retries, aborts) << value;
  }
}

// Gradient buckets: the shards own a piece of every bucket; a retry in place restores
// them from the snapshots, and a checkpoint of such shards resumes without buckets (by
// parameter name), both ending as the run that never failed. The step timeout: 6 s, as
// above.
TEST(Recovery, ShardsOfGradientBucketsRetryInPlaceAndResumeByName) {
  test::temp_dir dir;
  auto c = small_job();
  c.steps = 4;
  c.step_timeout = 6;
  c.max_step_retries = 2;
  c.bucket_size = 20000;
  const auto straight = run(c);
  ASSERT_EQ(straight.exit_code, 0) << straight.error;
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"throw_at", "0:1:2"}, {"throw_at", "1:1:2:late"}, {"stall", "1:0:2"}}) {
    auto f = c;
    f.set("faults." + key, value, "test");
    const auto got = run(f);
    ASSERT_EQ(got.exit_code, 0) << key << " " << value << ": " << got.error;
    EXPECT_EQ(test::max_abs_diff(got.final_state, straight.final_state), 0.0) << value;
    EXPECT_EQ(got.losses, straight.losses) << value;
  }
  auto first = c;
  first.checkpoint_dir = dir / "ckpt";
  first.checkpoint_interval = 2;
  first.max_step_retries = 0;
  first.throw_at = "0:0:3";
  ASSERT_EQ(run(first).exit_code, exit_recoverable);
  auto other = c;  // one bucket per chunk now: the shards are re-cut by name
  other.bucket_size = 0;
  other.resume = dir / "ckpt";
  const auto resumed = run(other);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.error;
  EXPECT_EQ(test::max_abs_diff(resumed.final_state, straight.final_state), 0.0)
      << "d = 2: the same sums with one bucket or several";
}

// Checkpoints written in the background (checkpoint_async, the default): the folders hold
// the very files a synchronous write makes (the same bytes, the same CRC-32 in each
// manifest), the run itself is unchanged, the steps that ran while a folder was written say
// so in the metrics log, and a run resumed from a background folder ends bit-identical.
// Snapshots over the memory bound (checkpoint_async_memory) are not taken: those stages
// write before training goes on, and the folders are the same again.
TEST(Recovery, BackgroundCheckpointsWriteTheSameFoldersAndResumeBitIdentical) {
  test::temp_dir dir;
  auto sync = small_job();
  sync.checkpoint_interval = 2;
  sync.keep_checkpoints = 10;
  sync.checkpoint_async = false;
  sync.checkpoint_dir = dir / "sync";
  sync.metrics = dir / "sync.jsonl";
  const auto straight = run(sync);
  ASSERT_EQ(straight.exit_code, 0) << straight.error;

  const auto snapshots_in = [](const std::string& trace) {
    std::ifstream in(trace);
    const auto json = nlohmann::json::parse(in);
    int n = 0;
    for (const auto& e : json.at("traceEvents")) n += e.value("name", "") == "checkpoint snapshot";
    return n;
  };
  const auto files_of = [](const std::string& folder) {
    std::ifstream in(folder + "/manifest.json");
    return nlohmann::json::parse(in).at("files");
  };
  struct variant {
    std::string name;
    int memory_mib;
    int snapshots;  // "checkpoint snapshot" events in the trace
  };
  // Steps 2 and 4 in the background (both stages), step 6 (the run's last) synchronously.
  // A bound of 1 MiB is below each stage's state (the embedding alone is 12 MiB).
  for (const auto& v : {variant{"async", 0, 2 * 2}, variant{"bounded", 1, 0}}) {
    auto c = sync;
    c.checkpoint_async = true;
    c.checkpoint_async_memory = v.memory_mib;
    c.checkpoint_dir = dir / v.name;
    c.metrics = dir / (v.name + ".jsonl");
    c.trace = dir / (v.name + ".json");
    const auto got = run(c);
    ASSERT_EQ(got.exit_code, 0) << v.name << ": " << got.error;
    EXPECT_EQ(test::max_abs_diff(got.final_state, straight.final_state), 0.0) << v.name;
    EXPECT_EQ(got.losses, straight.losses) << v.name;
    EXPECT_EQ(snapshots_in(c.trace), v.snapshots) << v.name;
    for (const char* step : {"step-00000002", "step-00000004", "step-00000006"})
      EXPECT_EQ(files_of(c.checkpoint_dir + "/" + step), files_of(sync.checkpoint_dir + "/" + step))
          << v.name << " " << step;
    // Step index 2 began while step 2's folder was written (the coordinator goes on as soon
    // as the snapshots are taken), step index 4 while step 4's was; the step after each
    // perhaps too (the write may still run), none before step 2's.
    std::map<int, int> writing;  // step index: the checkpoint being written as it began
    for (const auto& j : metrics_lines(c.metrics))
      if (j.contains("loss") && j.contains("checkpoint_writing"))
        writing[j.at("step").get<int>()] = j.at("checkpoint_writing").get<int>();
    if (v.snapshots > 0) {
      EXPECT_EQ(writing[2], 2) << v.name;
      EXPECT_EQ(writing[4], 4) << v.name;
      for (const auto& [step, folder] : writing) EXPECT_EQ(folder, step - step % 2) << v.name << " " << step;
    } else {
      EXPECT_TRUE(writing.empty()) << v.name;
    }
    EXPECT_FALSE(std::filesystem::exists(c.checkpoint_dir + "/.step-00000004.tmp"));
  }

  auto resumed_cfg = sync;
  resumed_cfg.checkpoint_dir = dir / "resumed";
  resumed_cfg.metrics.clear();
  resumed_cfg.resume = dir / "async/step-00000004";
  const auto resumed = run(resumed_cfg);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.error;
  EXPECT_EQ(test::max_abs_diff(resumed.final_state, straight.final_state), 0.0);
  ASSERT_EQ(resumed.losses.size(), 2u);
  EXPECT_EQ(resumed.losses[1], straight.losses[5]);
}

}  // namespace troupe
