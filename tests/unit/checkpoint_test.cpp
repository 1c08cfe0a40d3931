#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <set>

#include "compute/checkpoint.hpp"
#include "compute/checkpoint_dir.hpp"
#include "compute/grad_buffer.hpp"
#include "compute/remove_tree.hpp"
#include "test_util.hpp"
#include "build_paths.hpp"

namespace troupe {

// remove_tree replaces std::filesystem::remove_all (see compute/remove_tree.hpp): nested
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
  EXPECT_TRUE(std::filesystem::is_empty(d + "/ck/deeper"));       // the probe file is gone
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

}  // namespace troupe
