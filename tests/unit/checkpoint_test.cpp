#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <set>

#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "compute/optim/grad_buffer.hpp"
#include "compute/runtime/remove_tree.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "test_util.hpp"
#include "build_paths.hpp"

namespace troupe {

// remove_tree replaces std::filesystem::remove_all (see compute/runtime/remove_tree.hpp): nested
// folders go, a symbolic link goes without what it points to, a missing path is no error.
TEST(Checkpoint, RemoveTreeRemovesFoldersButNotWhatLinksPointTo) {
  test::temp_dir dir;
  std::filesystem::create_directories(dir / "a/b/c");
  std::ofstream(dir / "a/b/c/f") << "x";
  std::ofstream(dir / "a/g") << "y";
  std::ofstream(dir / "kept") << "z";
  std::filesystem::create_symlink(dir / "kept", dir / "a/b/link");
  std::filesystem::create_directory_symlink(dir.path, dir / "a/loop");
  EXPECT_TRUE(remove_tree(dir / "a"));
  EXPECT_FALSE(std::filesystem::exists(dir / "a"));
  EXPECT_TRUE(std::filesystem::exists(dir / "kept"));
  EXPECT_TRUE(remove_tree(dir / "a"));  // gone already
  EXPECT_TRUE(remove_tree(dir / "kept"));  // a plain file
  EXPECT_FALSE(std::filesystem::exists(dir / "kept"));
}

TEST(Checkpoint, RoundTripKeepsNamesOrderAndValues) {
  test::temp_dir dir;
  const auto state = initial_state(model_spec::gpt_tiny(), 1234);
  save_state_dict(dir / "model.pt", state);
  const auto back = load_state_dict(dir / "model.pt");
  ASSERT_EQ(back.size(), state.size());
  for (std::size_t i = 0; i < state.size(); ++i) {
    EXPECT_EQ(back[i].first, state[i].first);
    EXPECT_TRUE(torch::equal(back[i].second, state[i].second)) << state[i].first;
  }
  // Atomic write: nothing but the file itself is left in the folder.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

// weights_only=True: PyTorch >= 2.6's default; it refuses files with TorchScript type tags.
TEST(Checkpoint, PythonTorchLoadReadsItWithGpt2Names) {
  test::temp_dir dir;
  save_state_dict(dir / "model.pt", initial_state(model_spec::gpt_tiny(), 1234));
  const std::string cmd = "/usr/bin/python3 -c \"import torch; sd = torch.load('" + (dir / "model.pt") +
                          "', weights_only=True); assert list(sd)[:3] == ['wte.weight', 'wpe.weight', 'h.0.ln_1.weight'], list(sd)[:3];"
                          " assert tuple(sd['h.7.mlp.c_fc.weight'].shape) == (512, 128); print(len(sd))\" > " +
                          (dir / "out.txt");
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream in(dir / "out.txt");
  int n = 0;
  in >> n;
  EXPECT_EQ(n, 2 + 8 * 12 + 2);
}

// A --save file records its model (saved_model_toml) in an archive record torch.load
// passes over: the configuration it gives back builds the same model, a head_dim and a
// family of its own included; a file without the record gives none.
TEST(Checkpoint, ASaveFileRecordsItsModel) {
  test::temp_dir dir;
  auto c = test::small_config(2);
  c.runtime = "local";
  c.architecture = "qwen3";
  c.workload = "llama-tiny";
  c.head_dim = 24;
  c.layers = 2;
  c.validate();
  local_trainer t(c);
  t.step();
  t.save_checkpoint(dir / "model.pt");
  const auto recorded = saved_model_config(dir / "model.pt");
  ASSERT_TRUE(recorded.has_value());
  const auto g = recorded->model().decoder, mine = c.model().decoder;
  EXPECT_EQ(recorded->model().name(), "qwen3");
  EXPECT_EQ(g.head_dim(), 24);
  EXPECT_EQ(std::vector<int>({g.n_layer, g.n_head, g.kv_heads(), g.d_model, g.d_ff, g.seq_len, g.vocab}),
            std::vector<int>({mine.n_layer, mine.n_head, mine.kv_heads(), mine.d_model, mine.d_ff, mine.seq_len, mine.vocab}));
  check_state(recorded->model(), load_state_dict(dir / "model.pt"));
  const std::string cmd = "/usr/bin/python3 -c \"import torch; sd = torch.load('" + (dir / "model.pt") +
                          "', weights_only=True); assert 'model.layers.1.self_attn.q_norm.weight' in sd, list(sd)\"";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << "torch.load of a file with the record";
  save_state_dict(dir / "plain.pt", t.state());
  EXPECT_FALSE(saved_model_config(dir / "plain.pt").has_value());
  EXPECT_FALSE(saved_model_config(dir / "missing.pt").has_value());
}

// Files as users write them (tests/support/python/save_state_dicts.py): torch.save of a
// module's state_dict (an OrderedDict with _metadata), non-contiguous and shared tensors,
// bf16/fp16/fp64, PyTorch 2.x's archive layout. Each tensor must hold exactly the values
// Python printed, in the file's order and dtype; what is no state_dict is refused by name.
TEST(Checkpoint, PythonFilesAsUsersSaveThem) {
  test::temp_dir dir;
  const std::string cmd = std::string("/usr/bin/python3 ") + troupe::test::source_dir +
                          "/tests/support/python/save_state_dicts.py " + dir.path.string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  for (const std::string stem : {"module", "views", "half", "renamed"}) {
    const auto got = load_state_dict(dir / (stem + ".pt"));
    std::ifstream in(dir / (stem + ".expected"));
    std::size_t i = 0;
    for (std::string line; std::getline(in, line); ++i) {
      std::istringstream words(line);
      std::string name, dtype, w;
      words >> name >> dtype;
      std::vector<std::int64_t> shape;
      while (words >> w && w != ":") shape.push_back(std::stoll(w));
      std::vector<double> values;
      for (double x; words >> x;) values.push_back(x);
      ASSERT_LT(i, got.size()) << stem;
      const auto& [got_name, t] = got[i];
      EXPECT_EQ(got_name, name) << stem;
      const std::map<std::string, torch::ScalarType> dtypes{
          {"float32", torch::kFloat32}, {"bfloat16", torch::kBFloat16}, {"float16", torch::kHalf}, {"float64", torch::kFloat64}};
      EXPECT_EQ(t.scalar_type(), dtypes.at(dtype)) << stem << " " << name;
      EXPECT_EQ(t.sizes().vec(), shape) << stem << " " << name;
      EXPECT_TRUE(t.is_contiguous()) << stem << " " << name;
      const auto want = torch::tensor(values, torch::kFloat64).reshape(shape);
      EXPECT_TRUE(torch::equal(t.to(torch::kFloat64), want)) << stem << " " << name;
    }
    EXPECT_EQ(i, got.size()) << stem;
    EXPECT_GT(i, 0u) << stem;
  }
  // Tensors that shared a storage in the file are apart here: writing one leaves the other.
  auto views = load_state_dict(dir / "views.pt");
  const auto again = views[4].second.clone();
  views[3].second.fill_(-1);
  EXPECT_TRUE(torch::equal(views[4].second, again));
  const std::vector<std::pair<std::string, std::string>> refused{
      {"bad-nested.pt", "its entry 'model' is a dict, not a tensor"},
      {"bad-list.pt", "it holds a list, not a state_dict"},
      {"bad-big-endian.pt", "big-endian"},
      {"bad-torchscript.pt", "TorchScript"},
  };
  for (const auto& [file, words] : refused) {
    try {
      load_state_dict(dir / file);
      ADD_FAILURE() << file << " was read";
    } catch (const checkpoint_error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
    }
  }
}

TEST(Checkpoint, TruncatedOrForeignFilesGiveClearErrors) {
  test::temp_dir dir;
  save_state_dict(dir / "model.pt", initial_state(model_spec::gpt_tiny(), 1234));
  const auto size = std::filesystem::file_size(dir / "model.pt");
  std::filesystem::resize_file(dir / "model.pt", size / 2);
  EXPECT_THROW(load_state_dict(dir / "model.pt"), checkpoint_error);
  std::ofstream(dir / "text.pt") << "not a checkpoint";
  EXPECT_THROW(load_state_dict(dir / "text.pt"), checkpoint_error);
  EXPECT_THROW(load_state_dict(dir / "missing.pt"), checkpoint_error);
  try {
    load_state_dict(dir / "missing.pt");
  } catch (const checkpoint_error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.pt"), std::string::npos);
  }
}

TEST(Checkpoint, FailedWriteLeavesTheOldFileIntact) {
  test::temp_dir dir;
  const auto state = initial_state(model_spec::fmnist_mlp(), 1);
  save_state_dict(dir / "model.pt", state);
  EXPECT_THROW(save_state_dict(dir / "no-such-folder/model.pt", state), checkpoint_error);
  EXPECT_EQ(load_state_dict(dir / "model.pt").size(), state.size());
  // A producer that fails half-way through a streamed write: its error, the old file, no
  // temporary file.
  EXPECT_THROW(write_file_atomically(dir / "model.pt",
                                     [](const byte_sink& sink) {
                                       sink("PK", 2);
                                       throw std::runtime_error("producer failed");
                                     }),
               std::runtime_error);
  EXPECT_EQ(load_state_dict(dir / "model.pt").size(), state.size());
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

// Where a run would write: checked before it trains, each bad path named with its key.
TEST(Checkpoint, OutputPathsAreCheckedBeforeTraining) {
  test::temp_dir dir;
  const std::string d = dir.path.string();
  auto error_of = [](std::vector<std::pair<std::string, std::string>> keys) -> std::string {
    try {
      check_output_paths(load_job_config("", keys));
    } catch (const config_error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(error_of({{"save", d + "/m.pt"}, {"metrics", d + "/m.jsonl"}, {"trace", d + "/t.json"},
                      {"checkpoint_dir", d + "/ck/deeper"}}),
            "");
  EXPECT_TRUE(std::filesystem::is_directory(d + "/ck/deeper"));  // made now
  // the probe file is gone; the job's lock stays (lock_checkpoint_dir)
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(d + "/ck/deeper")) left.push_back(e.path().filename());
  EXPECT_EQ(left, std::vector<std::string>{".lock"});
  EXPECT_EQ(error_of({{"save", d + "/nope/m.pt"}}), "output.save = '" + d + "/nope/m.pt': folder " + d + "/nope does not exist");
  EXPECT_EQ(error_of({{"save", d}}), "output.save = '" + d + "' is a folder, not a file");
  EXPECT_NE(error_of({{"metrics", d + "/nope/m.jsonl"}}).find("output.metrics"), std::string::npos);
  EXPECT_NE(error_of({{"trace", d + "/nope/t.json"}}).find("output.trace"), std::string::npos);
  std::ofstream(d + "/file") << "x";
  EXPECT_NE(error_of({{"checkpoint_dir", d + "/file/ck"}}).find("output.checkpoint_dir = '" + d + "/file/ck': cannot create it"),
            std::string::npos);
  EXPECT_EQ(error_of({}), "");  // nothing to write
}

namespace {

// gpt-tiny's parameters as two stages' state_dicts (the first half, the second half), and
// AdamW moments 0.5 and 0.25 for every one.
std::vector<state_dict> two_stages(const state_dict& model) {
  std::vector<state_dict> stages(2);
  for (std::size_t i = 0; i < model.size(); ++i) stages[i < model.size() / 2 ? 0 : 1].push_back(model[i]);
  return stages;
}

named_moments moments_of(const state_dict& model) {
  named_moments moments;
  for (const auto& [name, t] : model) {
    moments.exp_avg[name] = torch::full({t.numel()}, 0.5);
    moments.exp_avg_sq[name] = torch::full({t.numel()}, 0.25);
  }
  return moments;
}

}  // namespace

// A step folder in three calls, as the distributed runtime writes it: each stage's files
// come from its own process (write_stage_files), the manifest from the coordinator's. The
// coordinator finds every stage's files where it sees them, or writes nothing.
TEST(Checkpoint, AStepFolderIsFinishedOnlyWithEveryStagesFiles) {
  test::temp_dir dir;
  const std::string root = dir / "ck";
  auto cfg = load_job_config("", {{"pipeline", "2"}, {"steps", "4"}});
  const auto model = initial_state(model_spec::gpt_tiny(), 7);
  const auto stages = two_stages(model);
  const auto moments = moments_of(model);
  auto write_stage = [&](const std::string& tmp, int k) {
    return write_stage_files(tmp, k, stages[k], optimizer_state_dict(moments, stages[k], 2));
  };
  auto leftovers = [&] {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(root)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  };

  // Whole: read back as one model, the moments by name, latest naming it.
  auto tmp = begin_checkpoint_dir(root, 2);
  auto files = write_stage(tmp, 1);
  const auto first = write_stage(tmp, 0);
  files.insert(files.end(), first.begin(), first.end());  // in any order
  const auto folder = finish_checkpoint_dir(root, cfg, files, 2, 3);
  EXPECT_EQ(folder, root + "/step-00000002");
  EXPECT_EQ(leftovers(), (std::vector<std::string>{"latest", "step-00000002"}));
  const auto back = read_checkpoint_dir(folder, cfg);
  EXPECT_EQ(back.step, 2);
  ASSERT_EQ(back.params.size(), model.size());
  for (const auto& [name, t] : model) {
    EXPECT_TRUE(torch::equal(back.params.at(name), t)) << name;
    EXPECT_EQ(back.optim.at("exp_avg_sq." + name).sum().item<double>(), 0.25 * t.numel()) << name;
  }

  // A stage's files missing (its process wrote them elsewhere), or not as big as written:
  // no step folder, no temporary one, and latest still names step 2.
  tmp = begin_checkpoint_dir(root, 3);
  files = write_stage(tmp, 0);
  try {
    finish_checkpoint_dir(root, cfg, files, 3, 3);
    ADD_FAILURE() << "finished without stage 1";
  } catch (const checkpoint_error& e) {
    EXPECT_NE(std::string(e.what()).find("no stage-1.pt was written"), std::string::npos) << e.what();
  }
  EXPECT_EQ(leftovers(), (std::vector<std::string>{"latest", "step-00000002"}));
  tmp = begin_checkpoint_dir(root, 3);
  files = write_stage(tmp, 0);
  const auto second = write_stage(tmp, 1);
  files.insert(files.end(), second.begin(), second.end());
  std::filesystem::resize_file(tmp + "/optim-stage-1.pt", 100);
  try {
    finish_checkpoint_dir(root, cfg, files, 3, 3);
    ADD_FAILURE() << "finished with a truncated file";
  } catch (const checkpoint_error& e) {
    EXPECT_NE(std::string(e.what()).find("optim-stage-1.pt was written (" + std::to_string(second[1].bytes) +
                                         " bytes) but " + tmp + "/optim-stage-1.pt has 100 bytes (with nodes on "
                                         "several hosts, checkpoint_dir must be one folder they all share)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(leftovers(), (std::vector<std::string>{"latest", "step-00000002"}));
  EXPECT_EQ(find_checkpoint(root), folder);
  // A write given up: its temporary folder goes.
  begin_checkpoint_dir(root, 4);
  EXPECT_EQ(leftovers().size(), 3u);
  abandon_checkpoint_dir(root, 4);
  EXPECT_EQ(leftovers(), (std::vector<std::string>{"latest", "step-00000002"}));
}

// A node process resuming reads only its stages' parameters and moments (read_checkpoint_dir
// with keep), yet every file is still checked: a corrupt file, or a parameter missing from
// a file of which it keeps nothing, fails the read as it fails a whole one.
TEST(Checkpoint, AReadKeepingSomeParametersStillChecksEveryFile) {
  test::temp_dir dir;
  auto cfg = load_job_config("", {{"pipeline", "2"}, {"steps", "4"}});
  const auto model = initial_state(model_spec::gpt_tiny(), 7);
  const auto stages = two_stages(model);
  const auto moments = moments_of(model);
  auto folder_of = [&](const std::string& root, const state_dict& first) {
    const auto tmp = begin_checkpoint_dir(root, 2);
    auto files = write_stage_files(tmp, 0, first, optimizer_state_dict(moments, first, 2));
    const auto second = write_stage_files(tmp, 1, stages[1], optimizer_state_dict(moments, stages[1], 2));
    files.insert(files.end(), second.begin(), second.end());
    return finish_checkpoint_dir(root, cfg, files, 2, 3);
  };
  const auto folder = folder_of(dir / "ck", stages[0]);
  std::set<std::string> mine;
  for (const auto& [name, t] : stages[1]) mine.insert(name);
  const auto keep = [&](const std::string& name) { return mine.count(name) > 0; };

  const auto back = read_checkpoint_dir(folder, cfg, keep);
  EXPECT_EQ(back.step, 2);
  ASSERT_EQ(back.model.size(), stages[1].size());
  for (std::size_t i = 0; i < stages[1].size(); ++i) {
    EXPECT_EQ(back.model[i].first, stages[1][i].first);
    EXPECT_TRUE(torch::equal(back.model[i].second, stages[1][i].second)) << stages[1][i].first;
  }
  EXPECT_EQ(back.params.size(), mine.size());
  EXPECT_EQ(back.optim.size(), 2 * mine.size() + 1);  // both moments of each, and "step"
  for (const auto& name : mine) EXPECT_EQ(back.optim.at("exp_avg." + name).sum().item<double>(), 0.5 * back.params.at(name).numel());

  auto fails = [&](const std::string& folder, const std::string& expected) {
    try {
      read_checkpoint_dir(folder, cfg, keep);
      ADD_FAILURE() << "read " << folder;
    } catch (const checkpoint_error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  const auto missing = stages[0].front().first;
  const auto short_folder = folder_of(dir / "short", state_dict(stages[0].begin() + 1, stages[0].end()));
  fails(short_folder, "missing " + missing);
  {  // a byte of stage 0's parameters changed (its size unchanged)
    std::fstream f(folder + "/stage-0.pt", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(200);
    const char byte = char(f.get());
    f.seekp(200);
    f.put(char(~byte));
  }
  fails(folder, "stage-0.pt is truncated or corrupt");
}

// The two files of one --save carry the same mark (step and id): a model beside another
// save's optimizer state, which a crash between the two renames leaves, is refused with
// both steps named. Files without marks (written by hand, or by older builds) still load.
TEST(Checkpoint, AMixedSavePairIsRefusedNamingBothSteps) {
  test::temp_dir dir;
  const auto spec = model_spec::gpt_tiny();
  const auto model = initial_state(spec, 7);
  const auto moments = moments_of(model);
  save_state_dict_pair(dir / "a.pt", model, optimizer_state_dict(moments, model, 2), 2);
  save_state_dict_pair(dir / "b.pt", model, optimizer_state_dict(moments, model, 4), 4);
  int files = 0;  // nothing but the four files: no temporary one
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) files += e.is_regular_file();
  EXPECT_EQ(files, 4);
  EXPECT_EQ(read_checkpoint(dir / "a.pt", spec, 10).step, 2);
  EXPECT_EQ(read_pair_mark(read_file_bytes(dir / "b.pt")).step, 4);
  auto refusal = [&](const std::string& path) -> std::string {
    try {
      read_checkpoint(path, spec, 10);
    } catch (const checkpoint_error& e) {
      return e.what();
    }
    return "";
  };
  std::filesystem::copy_file(dir / "b.pt.optim", dir / "a.pt.optim", std::filesystem::copy_options::overwrite_existing);
  EXPECT_NE(refusal(dir / "a.pt").find("a.pt (of step 2) and " + dir / "a.pt.optim (of step 4) are not the two files "
                                                                        "of one --save"),
            std::string::npos)
      << refusal(dir / "a.pt");
  // Same step, another save (another run's pair at the same step): refused too.
  save_state_dict_pair(dir / "c.pt", model, optimizer_state_dict(moments, model, 4), 4);
  std::filesystem::copy_file(dir / "c.pt.optim", dir / "b.pt.optim", std::filesystem::copy_options::overwrite_existing);
  EXPECT_NE(refusal(dir / "b.pt").find("(of step 4) and " + dir / "b.pt.optim (of step 4) are not"), std::string::npos);
  // One marked, one not.
  save_state_dict(dir / "c.pt", model);
  EXPECT_NE(refusal(dir / "c.pt").find("c.pt (of no --save (no pair mark)) and"), std::string::npos) << refusal(dir / "c.pt");
  // Neither marked: as before.
  save_state_dict(dir / "c.pt.optim", optimizer_state_dict(moments, model, 3));
  EXPECT_EQ(read_checkpoint(dir / "c.pt", spec, 10).step, 3);
}

// --resume from a checkpoint root: a 'latest' that names no step folder (NUL bytes, a
// folder, a path) and a newest step folder that does not verify are passed over with a
// warning, the bad folder kept aside (corrupt-step-N); strict_resume refuses instead; a
// root whose folders all fail is refused, never started afresh over.
TEST(Checkpoint, ResumeFallsBackToTheNewestFolderThatVerifies) {
  test::temp_dir dir;
  const std::string root = dir / "ck";
  auto cfg = load_job_config("", {{"pipeline", "2"}, {"steps", "4"}, {"checkpoint_dir", root}});
  const auto model = initial_state(model_spec::gpt_tiny(), 7);
  const auto stages = two_stages(model);
  const auto moments = moments_of(model);
  for (const std::int64_t step : {2, 3}) {
    const auto tmp = begin_checkpoint_dir(root, step);
    auto files = write_stage_files(tmp, 0, stages[0], optimizer_state_dict(moments, stages[0], step));
    const auto second = write_stage_files(tmp, 1, stages[1], optimizer_state_dict(moments, stages[1], step));
    files.insert(files.end(), second.begin(), second.end());
    finish_checkpoint_dir(root, cfg, files, step, 3);
  }
  auto resolved = [&](job_config c, bool restarted = false) {
    resolve_resume(c, restarted);
    return c.resume;
  };
  cfg.resume = "auto";
  EXPECT_EQ(resolved(cfg), root + "/step-00000003");
  for (const std::string junk : {std::string("\0\0\0\0", 4), std::string("../elsewhere\n"), std::string("step-9\n")}) {
    std::ofstream(root + "/latest", std::ios::binary) << junk;
    EXPECT_EQ(resolved(cfg), root + "/step-00000003");
  }
  std::filesystem::remove(root + "/latest");
  std::filesystem::create_directory(root + "/latest");
  EXPECT_EQ(resolved(cfg), root + "/step-00000003");
  EXPECT_EQ(find_checkpoint(root), root + "/step-00000003");
  std::filesystem::resize_file(root + "/step-00000003/optim-stage-1.pt", 100);
  auto strict = cfg;
  strict.strict_resume = true;
  try {
    resolved(strict);
    ADD_FAILURE() << "strict_resume took a corrupt folder";
  } catch (const checkpoint_error& e) {
    EXPECT_NE(std::string(e.what()).find("step-00000003: optim-stage-1.pt is truncated or corrupt"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(std::filesystem::exists(root + "/step-00000003"));
  EXPECT_EQ(resolved(cfg, true), root + "/step-00000002");  // (a restart by the launcher)
  EXPECT_TRUE(std::filesystem::exists(root + "/corrupt-step-00000003/optim-stage-1.pt"));
  EXPECT_EQ(read_checkpoint_dir(resolved(cfg), cfg).step, 2);
  // A named root too; a step folder named by itself is taken as it is (read whole later).
  auto named = cfg;
  named.resume = root;
  EXPECT_EQ(resolved(named), root + "/step-00000002");
  named.resume = root + "/corrupt-step-00000003";
  EXPECT_EQ(resolved(named), root + "/corrupt-step-00000003");
  std::filesystem::resize_file(root + "/step-00000002/stage-0.pt", 10);
  for (int again = 0; again < 2; ++again) {  // nothing moved: a second run refuses too
    try {
      resolved(cfg);
      ADD_FAILURE() << "started over folders that all fail";
    } catch (const checkpoint_error& e) {
      EXPECT_NE(std::string(e.what()).find("no checkpoint in " + root + " verifies"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(std::filesystem::exists(root + "/step-00000002/manifest.json"));
  }
}

// A checkpoint folder is locked by the job that writes it: flock on DIR/.lock, which says
// who holds it; another process cannot take it while this one lives.
TEST(Checkpoint, ACheckpointFolderIsLockedForItsJob) {
  test::temp_dir dir;
  std::filesystem::create_directories(dir / "ck");
  lock_checkpoint_dir(dir / "ck");
  lock_checkpoint_dir(dir / "ck");  // again: nothing
  std::ifstream in(dir / "ck/.lock");
  std::string holder;
  std::getline(in, holder);
  EXPECT_EQ(holder.rfind("pid " + std::to_string(::getpid()) + " on ", 0), 0u) << holder;
  EXPECT_NE(std::system(("flock -n " + dir / "ck/.lock" + " true").c_str()), 0);  // another process: refused
  std::filesystem::create_directories(dir / "free");
  std::ofstream(dir / "free/.lock") << "pid 1 on gone, since then\n";  // a dead job's: no lock held
  EXPECT_EQ(std::system(("flock -n " + dir / "free/.lock" + " true").c_str()), 0);
  lock_checkpoint_dir(dir / "free");
}

}  // namespace troupe
