// safetensors: writer/reader round trip in every dtype, row and column slices, and every bad
// file giving an error that names the file and the tensor.
#include "common/safetensors.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/test_files.h"

namespace tpserve {
namespace {

using ::testing::HasSubstr;
using testing_util::FreshTempDir;
using testing_util::SafetensorsImage;
using testing_util::WriteFile;

const DType kFloatTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

// Host storage for a tensor of `dtype` holding `values` (rounded to the dtype).
struct HostTensor {
  std::vector<char> bytes;
  Tensor view;
  HostTensor(const std::vector<float>& values, std::initializer_list<int64_t> shape, DType dtype) {
    bytes.resize(values.size() * DTypeSize(dtype));
    EXPECT_TRUE(
        ConvertElements(DType::kF32, values.data(), dtype, bytes.data(), values.size()).ok());
    view = Tensor(bytes.data(), shape, dtype);
  }
};

std::vector<float> RandomValues(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// What reading `v` stored as `stored` into `out` must give, as fp32.
float Expected(float v, DType stored, DType out) {
  float s = stored == DType::kF32    ? v
            : stored == DType::kBF16 ? Bf16ToF32(F32ToBf16(v))
                                     : F16ToF32(F32ToF16(v));
  return out == DType::kF32    ? s
         : out == DType::kBF16 ? Bf16ToF32(F32ToBf16(s))
                               : F16ToF32(F32ToF16(s));
}

std::vector<float> ToF32(const std::vector<char>& bytes, DType dtype) {
  size_t n = bytes.size() / DTypeSize(dtype);
  std::vector<float> out(n);
  EXPECT_TRUE(ConvertElements(dtype, bytes.data(), DType::kF32, out.data(), n).ok());
  return out;
}

void ExpectErrorMentions(const absl::Status& s, std::initializer_list<std::string> parts) {
  ASSERT_FALSE(s.ok());
  for (const auto& p : parts) EXPECT_THAT(std::string(s.message()), HasSubstr(p)) << s;
}

TEST(SafetensorsTest, RoundTripEveryDtypeWithRowAndColumnSlices) {
  const std::string dir = FreshTempDir();
  const int64_t rows = 7, cols = 10;
  const auto mat = RandomValues(rows * cols, 1);
  const auto vec = RandomValues(13, 2);
  const auto cube = RandomValues(3 * 4 * 5, 3);
  for (DType stored : kFloatTypes) {
    const std::string path = dir + "/t_" + std::string(DTypeName(stored)) + ".safetensors";
    HostTensor m(mat, {rows, cols}, stored), v(vec, {13}, stored), c(cube, {3, 4, 5}, stored);
    ASSERT_TRUE(WriteSafetensors(path, {{"mat", m.view}, {"vec", v.view}, {"cube", c.view}},
                                 {{"format", "pt"}})
                    .ok());
    auto f = SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_EQ((*f)->tensors().size(), 3u);
    const SafetensorsTensorInfo* info = (*f)->Find("mat");
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->shape, (std::vector<int64_t>{rows, cols}));
    EXPECT_TRUE(info->has_dtype);
    EXPECT_EQ(info->dtype, stored);
    auto raw = (*f)->RawBytes("mat");
    ASSERT_TRUE(raw.ok());
    EXPECT_EQ(0, std::memcmp(raw->data(), m.bytes.data(), m.bytes.size()));

    for (DType out : kFloatTypes) {
      SCOPED_TRACE(std::string(DTypeName(stored)) + " -> " + std::string(DTypeName(out)));
      const size_t es = DTypeSize(out);
      // Whole tensors.
      std::vector<char> buf(rows * cols * es);
      ASSERT_TRUE((*f)->Read("mat", {rows, cols}, out, buf.data()).ok());
      auto got = ToF32(buf, out);
      for (size_t i = 0; i < mat.size(); ++i) ASSERT_EQ(got[i], Expected(mat[i], stored, out)) << i;
      std::vector<char> vbuf(13 * es);
      ASSERT_TRUE((*f)->Read("vec", {13}, out, vbuf.data()).ok());
      got = ToF32(vbuf, out);
      for (size_t i = 0; i < vec.size(); ++i) ASSERT_EQ(got[i], Expected(vec[i], stored, out));

      // Rows [2, 5) of the matrix and row 1 of the 3-D tensor.
      std::vector<char> rbuf(3 * cols * es);
      ASSERT_TRUE((*f)->ReadRows("mat", {rows, cols}, 2, 3, out, rbuf.data()).ok());
      got = ToF32(rbuf, out);
      for (int64_t r = 0; r < 3; ++r) {
        for (int64_t c2 = 0; c2 < cols; ++c2) {
          ASSERT_EQ(got[r * cols + c2], Expected(mat[(r + 2) * cols + c2], stored, out));
        }
      }
      std::vector<char> cbuf(20 * es);
      ASSERT_TRUE((*f)->ReadRows("cube", {3, 4, 5}, 1, 1, out, cbuf.data()).ok());
      got = ToF32(cbuf, out);
      for (int i = 0; i < 20; ++i) ASSERT_EQ(got[i], Expected(cube[20 + i], stored, out));
      // Rows of a vector are elements.
      std::vector<char> ebuf(4 * es);
      ASSERT_TRUE((*f)->ReadRows("vec", {13}, 9, 4, out, ebuf.data()).ok());
      got = ToF32(ebuf, out);
      for (int i = 0; i < 4; ++i) ASSERT_EQ(got[i], Expected(vec[9 + i], stored, out));

      // Columns [3, 7) of the matrix: [rows, 4].
      std::vector<char> colbuf(rows * 4 * es);
      ASSERT_TRUE((*f)->ReadCols("mat", {rows, cols}, 3, 4, out, colbuf.data()).ok());
      got = ToF32(colbuf, out);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c2 = 0; c2 < 4; ++c2) {
          ASSERT_EQ(got[r * 4 + c2], Expected(mat[r * cols + 3 + c2], stored, out));
        }
      }
      // Slices of all shards put together give the whole tensor (tp = 2 on columns).
      std::vector<char> left(rows * 5 * es), right(rows * 5 * es);
      ASSERT_TRUE((*f)->ReadCols("mat", {rows, cols}, 0, 5, out, left.data()).ok());
      ASSERT_TRUE((*f)->ReadCols("mat", {rows, cols}, 5, 5, out, right.data()).ok());
      for (int64_t r = 0; r < rows; ++r) {
        ASSERT_EQ(0, std::memcmp(left.data() + r * 5 * es, buf.data() + r * cols * es, 5 * es));
        ASSERT_EQ(0,
                  std::memcmp(right.data() + r * 5 * es, buf.data() + (r * cols + 5) * es, 5 * es));
      }
    }
  }
}

TEST(SafetensorsTest, SliceAndShapeErrorsNameTensorAndFile) {
  const std::string dir = FreshTempDir();
  const std::string path = dir + "/m.safetensors";
  HostTensor m(RandomValues(12, 4), {3, 4}, DType::kBF16);
  HostTensor v(RandomValues(5, 5), {5}, DType::kBF16);
  ASSERT_TRUE(WriteSafetensors(path, {{"w", m.view}, {"b", v.view}}).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok());
  std::vector<float> buf(64);
  ExpectErrorMentions((*f)->Read("w", {4, 3}, DType::kF32, buf.data()),
                      {path, "'w'", "[3, 4]", "expected [4, 3]"});
  ExpectErrorMentions((*f)->Read("nope", {3, 4}, DType::kF32, buf.data()), {path, "'nope'"});
  ExpectErrorMentions((*f)->ReadRows("w", {3, 4}, 2, 2, DType::kF32, buf.data()),
                      {path, "'w'", "rows [2, 4)"});
  ExpectErrorMentions((*f)->ReadRows("w", {3, 4}, -1, 1, DType::kF32, buf.data()), {"'w'"});
  ExpectErrorMentions((*f)->ReadCols("w", {3, 4}, 3, 2, DType::kF32, buf.data()),
                      {path, "'w'", "columns [3, 5)"});
  ExpectErrorMentions((*f)->ReadCols("b", {5}, 0, 1, DType::kF32, buf.data()),
                      {path, "'b'", "2-D"});
  ExpectErrorMentions((*f)->Read("w", {3, 4}, DType::kI32, buf.data()), {"'w'"});
  // Empty slices are fine.
  EXPECT_TRUE((*f)->ReadRows("w", {3, 4}, 3, 0, DType::kF32, buf.data()).ok());
}

TEST(SafetensorsTest, NonFloatDtypeIsListedButNotLoadable) {
  const std::string dir = FreshTempDir();
  const std::string path = dir + "/ids.safetensors";
  std::vector<int64_t> ids = {1, 2, 3};
  std::vector<int32_t> i32 = {4, 5};
  ASSERT_TRUE(WriteSafetensors(path, {{"ids", Tensor(ids.data(), {3}, DType::kI64)},
                                      {"small", Tensor(i32.data(), {2}, DType::kI32)}})
                  .ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->Find("ids")->dtype_name, "I64");
  float out[3];
  ExpectErrorMentions((*f)->Read("ids", {3}, DType::kF32, out), {path, "'ids'", "I64"});
  auto raw = (*f)->RawBytes("ids");
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ(0, std::memcmp(raw->data(), ids.data(), 24));
}

TEST(SafetensorsTest, WriterRejectsWrongByteCounts) {
  const std::string dir = FreshTempDir();
  auto w = SafetensorsWriter::Create(dir + "/w.safetensors", {{"a", DType::kF32, {2}}});
  ASSERT_TRUE(w.ok());
  float data[3] = {1, 2, 3};
  EXPECT_FALSE((*w)->Append(data, 12).ok());
  ASSERT_TRUE((*w)->Append(data, 4).ok());
  ExpectErrorMentions((*w)->Finish(), {"w.safetensors", "4 of the 8"});
  auto dup = SafetensorsWriter::Create(dir + "/d.safetensors",
                                       {{"a", DType::kF32, {2}}, {"a", DType::kF32, {2}}});
  EXPECT_FALSE(dup.ok());
}

TEST(SafetensorsTest, HeaderIsPaddedAndOrdered) {
  const std::string dir = FreshTempDir();
  const std::string path = dir + "/p.safetensors";
  std::vector<float> a = {1, 2, 3};
  ASSERT_TRUE(WriteSafetensors(path, {{"a", Tensor(a.data(), {3}, DType::kF32)}}).ok());
  const std::string bytes = testing_util::ReadFile(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + n + 12);
  EXPECT_EQ(bytes[8], '{');
}

// ---- Bad files: each error names the file, and the tensor where there is one. ----

class BadSafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = FreshTempDir(); }
  absl::Status OpenBytes(const std::string& bytes) {
    path_ = dir_ + "/bad.safetensors";
    WriteFile(path_, bytes);
    auto f = SafetensorsFile::Open(path_);
    return f.status();
  }
  std::string dir_;
  std::string path_;
};

TEST_F(BadSafetensorsTest, MissingFile) {
  auto f = SafetensorsFile::Open(dir_ + "/none.safetensors");
  ExpectErrorMentions(f.status(), {dir_ + "/none.safetensors"});
}

TEST_F(BadSafetensorsTest, ShorterThanEightBytes) {
  ExpectErrorMentions(OpenBytes(""), {"bad.safetensors", "too short"});
  ExpectErrorMentions(OpenBytes("abc"), {"bad.safetensors", "3 bytes"});
}

TEST_F(BadSafetensorsTest, HeaderLongerThanFile) {
  std::string img = SafetensorsImage("{}", "");
  img[0] = 100;
  ExpectErrorMentions(OpenBytes(img), {"bad.safetensors", "header length 100", "larger"});
  std::string huge(8, '\xff');
  ExpectErrorMentions(OpenBytes(huge + "{}"), {"bad.safetensors", "larger than the file"});
}

TEST_F(BadSafetensorsTest, TruncatedDataSection) {
  std::vector<float> a(100, 1.0f), b(100, 2.0f);
  const std::string good = dir_ + "/good.safetensors";
  ASSERT_TRUE(WriteSafetensors(good, {{"a", Tensor(a.data(), {100}, DType::kF32)},
                                      {"b", Tensor(b.data(), {10, 10}, DType::kF32)}})
                  .ok());
  std::string bytes = testing_util::ReadFile(good);
  ExpectErrorMentions(OpenBytes(bytes.substr(0, bytes.size() - 4)),
                      {"bad.safetensors", "'b'", "past the end"});
}

TEST_F(BadSafetensorsTest, BadJson) {
  ExpectErrorMentions(OpenBytes(SafetensorsImage("{\"a\": {\"dtype\": ", "")),
                      {"bad.safetensors", "not valid JSON"});
  ExpectErrorMentions(OpenBytes(SafetensorsImage("[1, 2, 3]", "")),
                      {"bad.safetensors", "JSON object"});
  ExpectErrorMentions(OpenBytes(SafetensorsImage("{\"a\": 5}", "")),
                      {"bad.safetensors", "'a'", "object"});
}

TEST_F(BadSafetensorsTest, UnsupportedDtype) {
  ExpectErrorMentions(OpenBytes(SafetensorsImage(
                          R"({"w": {"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 2]}})",
                          std::string(2, '\0'))),
                      {"bad.safetensors", "'w'", "Q4_K"});
}

TEST_F(BadSafetensorsTest, MissingOrMalformedFields) {
  ExpectErrorMentions(OpenBytes(SafetensorsImage(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})",
                                                 std::string(4, '\0'))),
                      {"'w'", "dtype"});
  ExpectErrorMentions(OpenBytes(SafetensorsImage(
                          R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})",
                          std::string(4, '\0'))),
                      {"'w'", "shape"});
  ExpectErrorMentions(
      OpenBytes(SafetensorsImage(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})",
                                 std::string(4, '\0'))),
      {"'w'", "data_offsets"});
  ExpectErrorMentions(
      OpenBytes(SafetensorsImage(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})",
                                 std::string(4, '\0'))),
      {"'w'", "end before begin"});
}

TEST_F(BadSafetensorsTest, ShapeDoesNotMatchOffsets) {
  ExpectErrorMentions(OpenBytes(SafetensorsImage(
                          R"({"w": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 20]}})",
                          std::string(24, '\0'))),
                      {"bad.safetensors", "'w'", "[3, 4]", "24 bytes", "hold 20"});
  // A huge shape must not overflow into a matching size.
  ExpectErrorMentions(
      OpenBytes(SafetensorsImage(
          R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}})",
          "")),
      {"'w'"});
}

TEST_F(BadSafetensorsTest, OutOfRangeOffsets) {
  ExpectErrorMentions(OpenBytes(SafetensorsImage(
                          R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                          std::string(8, '\0'))),
                      {"bad.safetensors", "'w'", "past the end"});
  ExpectErrorMentions(
      OpenBytes(SafetensorsImage(
          R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [18446744073709551615, 7]}})",
          std::string(8, '\0'))),
      {"bad.safetensors", "'w'"});
}

TEST_F(BadSafetensorsTest, OverlappingTensors) {
  ExpectErrorMentions(OpenBytes(SafetensorsImage(
                          R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                          std::string(12, '\0'))),
                      {"bad.safetensors", "'a'", "'b'", "overlap"});
}

TEST_F(BadSafetensorsTest, MetadataAndEmptyTensorsAreFine) {
  auto s = OpenBytes(SafetensorsImage(
      R"({"__metadata__": {"format": "pt"},
          "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
          "w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}})",
      std::string(4, '\0')));
  EXPECT_TRUE(s.ok()) << s;
}

TEST(ParseSafetensorsBytesTest, ParsesFromMemory) {
  const std::string img = SafetensorsImage(
      R"({"w": {"dtype": "F32", "shape": [2, 1], "data_offsets": [0, 8]}})", std::string(8, 'x'));
  auto t = ParseSafetensorsBytes(img.data(), img.size(), "mem");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 1u);
  EXPECT_EQ((*t)[0].name, "w");
  EXPECT_EQ((*t)[0].numel(), 2);
  EXPECT_EQ((*t)[0].end, 8u);
}

}  // namespace
}  // namespace tpserve
