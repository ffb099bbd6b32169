// Randomized fuzzing of the safetensors header parser: thousands of mutated and generated
// files, each placed right before a PROT_NONE guard page so that any read past the image
// faults. Accepted files must satisfy the format's invariants, and reading every tensor they
// declare must stay inside the image.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/testing/test_files.h"

namespace tpserve {
namespace {

constexpr size_t kMaxImage = 1 << 16;

// A buffer whose end touches an inaccessible page.
class GuardedBuffer {
 public:
  GuardedBuffer() {
    page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    body_ = (kMaxImage + page_ - 1) / page_ * page_;
    base_ = static_cast<char*>(mmap(nullptr, body_ + 2 * page_, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    EXPECT_NE(base_, MAP_FAILED);
    EXPECT_EQ(mprotect(base_, page_, PROT_NONE), 0);                  // front guard
    EXPECT_EQ(mprotect(base_ + page_ + body_, page_, PROT_NONE), 0);  // back guard
  }
  ~GuardedBuffer() { munmap(base_, body_ + 2 * page_); }
  // Copies `bytes` so that its last byte is the last accessible byte.
  const char* Place(const std::string& bytes) {
    char* end = base_ + page_ + body_;
    char* start = end - bytes.size();
    std::memcpy(start, bytes.data(), bytes.size());
    return start;
  }

 private:
  size_t page_ = 0;
  size_t body_ = 0;
  char* base_ = nullptr;
};

std::string Image(const std::string& header, size_t data_size) {
  return testing_util::SafetensorsImage(header, std::string(data_size, '\x3c'));
}

// A valid file of a few tensors, as the mutation seed.
std::string ValidImage(std::mt19937_64& rng) {
  const char* dtypes[] = {"F32", "BF16", "F16", "I64", "U8"};
  const int sizes[] = {4, 2, 2, 8, 1};
  nlohmann::json h = nlohmann::json::object();
  h["__metadata__"] = {{"format", "pt"}};
  uint64_t off = 0;
  int n = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < n; ++i) {
    int k = static_cast<int>(rng() % 5);
    std::vector<int64_t> shape;
    int64_t numel = 1;
    for (int d = 0, nd = static_cast<int>(rng() % 3); d < nd; ++d) {
      shape.push_back(static_cast<int64_t>(rng() % 5));
      numel *= shape.back();
    }
    uint64_t bytes = static_cast<uint64_t>(numel) * sizes[k];
    h["t" + std::to_string(i)] = {
        {"dtype", dtypes[k]}, {"shape", shape}, {"data_offsets", {off, off + bytes}}};
    off += bytes;
  }
  return Image(h.dump(), off);
}

nlohmann::json RandomScalar(std::mt19937_64& rng) {
  switch (rng() % 9) {
    case 0:
      return static_cast<int64_t>(rng() % 64);
    case 1:
      return -static_cast<int64_t>(rng() % 64);
    case 2:
      return rng();  // huge unsigned
    case 3:
      return static_cast<double>(rng() % 1000) / 7.0;
    case 4:
      return "F32";
    case 5:
      return nullptr;
    case 6:
      return true;
    case 7:
      return std::string(rng() % 5, 'x');
    default:
      return static_cast<int64_t>(1) << (rng() % 63);
  }
}

nlohmann::json RandomValue(std::mt19937_64& rng, int depth) {
  if (depth > 3 || rng() % 3 == 0) return RandomScalar(rng);
  if (rng() % 2) {
    nlohmann::json a = nlohmann::json::array();
    for (int i = 0, n = static_cast<int>(rng() % 4); i < n; ++i)
      a.push_back(RandomValue(rng, depth + 1));
    return a;
  }
  nlohmann::json o = nlohmann::json::object();
  const char* keys[] = {"dtype", "shape", "data_offsets", "__metadata__", "x"};
  for (int i = 0, n = static_cast<int>(rng() % 4); i < n; ++i) {
    o[keys[rng() % 5]] = RandomValue(rng, depth + 1);
  }
  return o;
}

// A header with plausible structure but random numbers and types.
std::string GeneratedImage(std::mt19937_64& rng) {
  const char* dtypes[] = {"F32", "BF16", "F16", "I64", "BOOL", "F8_E4M3", "Q8", "", "f32"};
  nlohmann::json h = nlohmann::json::object();
  const uint64_t data_size = rng() % 200;
  for (int i = 0, n = static_cast<int>(rng() % 5); i < n; ++i) {
    nlohmann::json e = nlohmann::json::object();
    if (rng() % 10) e["dtype"] = dtypes[rng() % 9];
    if (rng() % 10) {
      nlohmann::json shape = nlohmann::json::array();
      for (int d = 0, nd = static_cast<int>(rng() % 4); d < nd; ++d) {
        shape.push_back(rng() % 8 ? nlohmann::json(rng() % 10) : RandomScalar(rng));
      }
      e["shape"] = rng() % 20 ? shape : RandomValue(rng, 2);
    }
    if (rng() % 10) {
      uint64_t b = rng() % (data_size + 2);
      uint64_t len = rng() % 40;
      // Half the time, a length that matches the shape, so later checks (range, overlap) run.
      const std::map<std::string, uint64_t> sizes = {{"F32", 4}, {"BF16", 2}, {"F16", 2},
                                                     {"I64", 8}, {"BOOL", 1}, {"F8_E4M3", 1}};
      if (rng() % 2 && e.contains("dtype") && sizes.count(e["dtype"].get<std::string>()) &&
          e.contains("shape") && e["shape"].is_array()) {
        uint64_t n = sizes.at(e["dtype"].get<std::string>());
        for (const auto& d : e["shape"]) n *= d.is_number_unsigned() ? d.get<uint64_t>() : 1;
        len = n;
      }
      e["data_offsets"] = rng() % 10 ? nlohmann::json({b, b + len})
                                     : nlohmann::json({RandomScalar(rng), RandomScalar(rng)});
    }
    h[rng() % 8 ? "t" + std::to_string(rng() % 4) : "__metadata__"] =
        rng() % 15 ? e : RandomValue(rng, 1);
  }
  return Image(h.dump(), data_size);
}

std::string Mutate(std::string img, std::mt19937_64& rng) {
  for (int m = 0, n = 1 + static_cast<int>(rng() % 4); m < n && !img.empty(); ++m) {
    const size_t pos = rng() % img.size();
    switch (rng() % 7) {
      case 0:
        img[pos] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1:
        img[pos] = "{}[]\",:0123456789-e."[rng() % 20];
        break;
      case 2:
        img.erase(pos, 1 + rng() % 8);
        break;
      case 3:
        img.insert(pos, std::string(1 + rng() % 4, "{\"[0,"[rng() % 5]));
        break;
      case 4:
        img.resize(rng() % (img.size() + 1));  // truncate
        break;
      case 5: {  // rewrite the length prefix
        if (img.size() >= 8) {
          uint64_t n8 = rng() % 3 == 0 ? rng() : rng() % (img.size() + 16);
          std::memcpy(img.data(), &n8, 8);
        }
        break;
      }
      default:
        img.append(rng() % 16, '\0');  // trailing bytes
        break;
    }
  }
  return img;
}

// Checks the invariants of an accepted file and reads every tensor from the guarded image.
void CheckAccepted(const std::vector<SafetensorsTensorInfo>& tensors, const char* image,
                   size_t size) {
  uint64_t header = 0;
  std::memcpy(&header, image, 8);
  ASSERT_LE(8 + header, size);
  const uint64_t data_size = size - 8 - header;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  std::vector<float> out;
  for (const auto& t : tensors) {
    ASSERT_LE(t.begin, t.end);
    ASSERT_LE(t.end, data_size) << t.name;
    if (t.end > t.begin) ranges.push_back({t.begin, t.end});
    if (t.has_dtype &&
        (t.dtype == DType::kF32 || t.dtype == DType::kBF16 || t.dtype == DType::kF16)) {
      ASSERT_EQ(static_cast<uint64_t>(t.numel()) * DTypeSize(t.dtype), t.end - t.begin);
      out.resize(t.numel());
      ASSERT_TRUE(
          ConvertElements(t.dtype, image + 8 + header + t.begin, DType::kF32, out.data(), t.numel())
              .ok());
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) ASSERT_GE(ranges[i].first, ranges[i - 1].second);
}

TEST(SafetensorsFuzzTest, RandomAndMutatedHeadersNeverCrashOrOverread) {
  GuardedBuffer guard;
  std::mt19937_64 rng(20261202);
  const auto start = std::chrono::steady_clock::now();
  int accepted = 0, rejected = 0, iterations = 0;
  const char* kReasons[] = {"not valid JSON", "header length", "too short", "dtype",
                            "shape",          "data_offsets",  "overlap",   "must be"};
  std::map<std::string, int> reasons;
  for (; iterations < 200000; ++iterations) {
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(15)) break;
    std::string img;
    switch (iterations % 4) {
      case 0:
        img = Mutate(ValidImage(rng), rng);
        break;
      case 1:
        img = GeneratedImage(rng);
        break;
      case 2:
        img = Mutate(GeneratedImage(rng), rng);
        break;
      default: {
        img.resize(rng() % 64);
        for (char& c : img) c = static_cast<char>(rng());
        if (img.size() >= 8 && rng() % 2) {
          uint64_t n = rng() % (img.size() - 7);
          std::memcpy(img.data(), &n, 8);
        }
        break;
      }
    }
    if (img.size() > kMaxImage) img.resize(kMaxImage);
    const char* p = guard.Place(img);
    auto r = ParseSafetensorsBytes(p, img.size(), "fuzz.safetensors");
    if (r.ok()) {
      ++accepted;
      CheckAccepted(*r, p, img.size());
      if (::testing::Test::HasFatalFailure()) {
        FAIL() << "invariant broken for image of " << img.size() << " bytes";
      }
    } else {
      ++rejected;
      const std::string msg(r.status().message());
      bool known = false;
      for (const char* k : kReasons) {
        if (msg.find(k) != std::string::npos) {
          ++reasons[k];
          known = true;
          break;
        }
      }
      if (!known) ++reasons["other"];
      ASSERT_NE(std::string(r.status().message()).find("fuzz.safetensors"), std::string::npos)
          << r.status();
    }
  }
  EXPECT_GT(iterations, 5000);  // a slow (sanitizer) build may stop at the time limit
  EXPECT_GT(accepted, 100);
  EXPECT_GT(rejected, 100);
  std::printf("fuzz: %d images, %d accepted, %d rejected\n", iterations, accepted, rejected);
  for (const auto& [reason, count] : reasons) std::printf("  %-16s %d\n", reason.c_str(), count);
  // On a full run every validation stage is reached, not only the JSON parser.
  if (iterations >= 100000) {
    for (const char* k :
         {"not valid JSON", "header length", "dtype", "shape", "data_offsets", "overlap"}) {
      EXPECT_GT(reasons[k], 0) << k;
    }
  }
}

TEST(SafetensorsFuzzTest, DeeplyNestedHeaderIsRejectedWithoutStackOverflow) {
  GuardedBuffer guard;
  for (int depth : {1000, 30000}) {
    std::string header = "{\"a\": " + std::string(depth, '[') + std::string(depth, ']') + "}";
    std::string img = Image(header, 0);
    const char* p = guard.Place(img);
    auto r = ParseSafetensorsBytes(p, img.size(), "deep.safetensors");
    EXPECT_FALSE(r.ok());
  }
}

}  // namespace
}  // namespace tpserve
