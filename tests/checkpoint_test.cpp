#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "compute/checkpoint.hpp"
#include "compute/checkpoint_dir.hpp"
#include "compute/remove_tree.hpp"
#include "test_util.hpp"

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

}  // namespace troupe
