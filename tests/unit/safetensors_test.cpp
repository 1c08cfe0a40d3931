// The safetensors format (compute/checkpoint/safetensors.cpp) against bytes built by hand from the
// format's description: an 8-byte little-endian header length, a JSON header of dtype,
// shape and data_offsets (and __metadata__), then the raw little-endian data.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "compute/checkpoint/safetensors.hpp"
#include "test_util.hpp"

namespace troupe {

namespace {

std::string le64(std::uint64_t n) {
  std::string s(8, '\0');
  for (int k = 0; k < 8; ++k) s[k] = char((n >> (8 * k)) & 0xff);
  return s;
}

/// Two tensors' data by hand: a = [1.5, -2.0] in F32, b = [[1.0, -0.5]] in BF16.
std::string hand_data() {
  std::string d;
  for (float x : {1.5f, -2.0f}) {
    char b[4];
    std::memcpy(b, &x, 4);  // (this machine is little-endian, as the format)
    d.append(b, 4);
  }
  d += std::string("\x80\x3f", 2);  // bf16 1.0 = 0x3F80
  d += std::string("\x00\xbf", 2);  // bf16 -0.5 = 0xBF00
  return d;
}

void write_bytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string error_of(const std::string& path) {
  try {
    read_safetensors(path);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(Safetensors, ReadsAFileBuiltByHand) {
  test::temp_dir dir;
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  write_bytes(dir / "hand.safetensors", le64(header.size()) + header + hand_data());
  const auto t = read_safetensors(dir / "hand.safetensors");
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].first, "a");  // in the data's order
  EXPECT_TRUE(torch::equal(t[0].second, torch::tensor({1.5f, -2.0f})));
  EXPECT_EQ(t[1].first, "b");
  EXPECT_EQ(t[1].second.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(t[1].second.sizes().vec(), (std::vector<std::int64_t>{1, 2}));
  EXPECT_TRUE(torch::equal(t[1].second.to(torch::kFloat32), torch::tensor({{1.0f, -0.5f}})));
}

TEST(Safetensors, WritesWhatTheFormatDescribes) {
  test::temp_dir dir;
  write_safetensors(dir / "w.safetensors",
                    {{"a", torch::tensor({1.5f, -2.0f})}, {"b", torch::tensor({{1.0f, -0.5f}}).to(torch::kBFloat16)}});
  const auto bytes = read_bytes(dir / "w.safetensors");
  ASSERT_GE(bytes.size(), 8u);
  std::uint64_t n = 0;
  for (int k = 0; k < 8; ++k) n |= std::uint64_t(std::uint8_t(bytes[k])) << (8 * k);
  EXPECT_EQ((8 + n) % 8, 0u) << "the data starts 8-byte aligned";
  ASSERT_EQ(bytes.size(), 8 + n + 12);
  const auto header = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(header.at("__metadata__"), (nlohmann::json{{"format", "pt"}}));
  EXPECT_EQ(header.at("a"), (nlohmann::json{{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}}));
  EXPECT_EQ(header.at("b"), (nlohmann::json{{"dtype", "BF16"}, {"shape", {1, 2}}, {"data_offsets", {8, 12}}}));
  EXPECT_EQ(bytes.substr(8 + n), hand_data());
}

TEST(Safetensors, BadFilesNameTheFileAndTheTensor) {
  test::temp_dir dir;
  const std::string header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const auto data = hand_data().substr(0, 8);
  write_bytes(dir / "truncated.safetensors", le64(header.size()) + header + data.substr(0, 5));
  EXPECT_NE(error_of(dir / "truncated.safetensors").find("tensor w: its data ends at byte 8, past the file's 5"),
            std::string::npos)
      << error_of(dir / "truncated.safetensors");
  write_bytes(dir / "short-header.safetensors", le64(1000) + header);
  EXPECT_NE(error_of(dir / "short-header.safetensors").find("truncated: the header says it is 1000 bytes long"),
            std::string::npos);
  const std::string broken = R"({"w":{"dtype":"F32",)";
  write_bytes(dir / "json.safetensors", le64(broken.size()) + broken + data);
  EXPECT_NE(error_of(dir / "json.safetensors").find("its header does not parse as JSON"), std::string::npos);
  const std::string f8 = R"({"w":{"dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8]}})";
  write_bytes(dir / "dtype.safetensors", le64(f8.size()) + f8 + data);
  EXPECT_NE(error_of(dir / "dtype.safetensors").find("tensor w: dtype F8_E4M3 is not one Troupe reads"),
            std::string::npos);
  const std::string shape = R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})";
  write_bytes(dir / "shape.safetensors", le64(shape.size()) + shape + data);
  EXPECT_NE(error_of(dir / "shape.safetensors").find("tensor w: data_offsets [0, 8) hold 8 bytes; its shape needs 12"),
            std::string::npos);
  write_bytes(dir / "tiny.safetensors", "abc");
  EXPECT_NE(error_of(dir / "tiny.safetensors").find("tiny.safetensors: truncated"), std::string::npos);
}

}  // namespace troupe
