// The cuBLASLt algorithm table (kernels/cuda/gemm_table.h): parsing, lookup, the refusals of bad
// tables with their reasons, and the built-in table compiled from kernels/cuda/cublaslt_table.json.
// Which algorithm a plan takes from it is checked on the GPU (cuda_ops_test, CudaGemmTableTest).
#include "kernels/cuda/gemm_table.h"

#include <set>
#include <string>
#include <tuple>

#include <gtest/gtest.h>

#include "nlohmann/json.hpp"

namespace tpserve::cuda {
namespace {

using Json = nlohmann::json;

Json Entry() {
  return Json{{"device", "NVIDIA H200"},
              {"sms", 132},
              {"cublaslt", 130100},
              {"m", 64},
              {"n", 12288},
              {"k", 4096},
              {"bias", false},
              {"alignment", 256},
              {"candidate", 3},
              {"config", "id=66 tile=0"},
              {"first_us", 30.1},
              {"best_us", 28.2}};
}

std::string Table(const Json& entries) { return Json{{"entries", entries}}.dump(); }

TEST(GemmTableTest, ParsesAndFindsOnlyTheExactProblemOnTheSameGpu) {
  Json second = Entry();
  second["m"] = 128;
  second["candidate"] = 1;
  absl::StatusOr<LtTable> t = LtTable::Parse(Table(Json::array({Entry(), second})), "test");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->entries().size(), 2u);
  const LtTableEntry* e = t->Find("NVIDIA H200", 132, 130100, 64, 12288, 4096, false, 256);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->candidate, 3);
  EXPECT_EQ(e->config, "id=66 tile=0");
  const LtTableEntry* e2 = t->Find("NVIDIA H200", 132, 130100, 128, 12288, 4096, false, 256);
  ASSERT_NE(e2, nullptr);
  EXPECT_EQ(e2->candidate, 1);
  // Any other key: no entry.
  EXPECT_EQ(t->Find("NVIDIA H100 80GB HBM3", 132, 130100, 64, 12288, 4096, false, 256), nullptr);
  EXPECT_EQ(t->Find("NVIDIA H200", 114, 130100, 64, 12288, 4096, false, 256), nullptr);
  EXPECT_EQ(t->Find("NVIDIA H200", 132, 130000, 64, 12288, 4096, false, 256), nullptr);
  EXPECT_EQ(t->Find("NVIDIA H200", 132, 130100, 63, 12288, 4096, false, 256), nullptr);
  EXPECT_EQ(t->Find("NVIDIA H200", 132, 130100, 64, 4096, 4096, false, 256), nullptr);
  EXPECT_EQ(t->Find("NVIDIA H200", 132, 130100, 64, 12288, 11008, false, 256), nullptr);
  EXPECT_EQ(t->Find("NVIDIA H200", 132, 130100, 64, 12288, 4096, true, 256), nullptr);
  EXPECT_EQ(t->Find("NVIDIA H200", 132, 130100, 64, 12288, 4096, false, 16), nullptr);
  EXPECT_EQ(t->CountFor("NVIDIA H200", 132, 130100), 2);
  EXPECT_EQ(t->CountFor("NVIDIA H200", 132, 130101), 0);
  EXPECT_EQ(t->source(), "test");
}

TEST(GemmTableTest, AnEmptyTableFindsNothing) {
  absl::StatusOr<LtTable> t = LtTable::Parse(R"({"entries": []})", "empty");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->Find("NVIDIA H200", 132, 130100, 64, 12288, 4096, false, 256), nullptr);
}

// Each bad table is refused with a message that names the source, the entry and what is wrong.
TEST(GemmTableTest, RefusesBadTablesWithTheReason) {
  struct Case {
    std::string json, expect;
  };
  auto with = [](const char* key, const Json& value) {
    Json e = Entry();
    e[key] = value;
    return Table(Json::array({e}));
  };
  auto without = [](const char* key) {
    Json e = Entry();
    e.erase(key);
    return Table(Json::array({e}));
  };
  const Case cases[] = {
      {"{\"entries\": [", "not valid JSON"},
      {"[]", "\"entries\" array"},
      {R"({"entries": {}})", "\"entries\" array"},
      {Table(Json::array({Json(3)})), "entry 0: not an object"},
      {without("device"), "entry 0: no \"device\""},
      {with("device", ""), "\"device\" is \"\""},
      {without("config"), "no \"config\""},
      {with("bias", 1), "\"bias\" must be true or false"},
      {without("m"), "no \"m\""},
      {with("m", 0), "\"m\" = 0 is outside"},
      {with("n", "12288"), "\"n\" is \"12288\", not an integer"},
      {with("k", 1.5), "\"k\" is 1.5, not an integer"},
      {with("candidate", -1), "\"candidate\" = -1 is outside"},
      {with("alignment", 48), "\"alignment\" = 48 is not a power of two"},
      {with("alignment", 512), "\"alignment\" = 512 is outside"},
      {with("sms", 0), "\"sms\" = 0 is outside"},
      {Table(Json::array({Entry(), Entry()})),
       "entry 1: a second entry for NVIDIA H200 M=64 N=12288 K=4096"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.json);
    absl::StatusOr<LtTable> t = LtTable::Parse(c.json, "bad.json");
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find("cuBLASLt table bad.json"), std::string::npos)
        << t.status();
    EXPECT_NE(t.status().message().find(c.expect), std::string::npos) << t.status();
  }
}

// Two sweeps' tables: the entries both chose alike (same problem, GPU, candidate and
// configuration) are kept, their times averaged; a disagreement on any of those drops the entry.
TEST(GemmTableTest, AgreementKeepsTheChoicesBothSweepsMadeAlike) {
  Json same = Entry();  // first_us 30.1, best_us 28.2
  Json same2 = Entry();
  same2["first_us"] = 30.3;
  same2["best_us"] = 28.0;
  Json other_cand = Entry();
  other_cand["m"] = 128;
  Json other_cand2 = other_cand;
  other_cand2["candidate"] = 4;
  Json other_config = Entry();
  other_config["m"] = 8;
  Json other_config2 = other_config;
  other_config2["config"] = "id=66 tile=1";
  Json only_a = Entry();
  only_a["m"] = 16;
  const std::string a = Table(Json::array({same, other_cand, other_config, only_a}));
  const std::string b = Table(Json::array({other_config2, other_cand2, same2}));
  absl::StatusOr<std::string> agreed = LtTable::Agreement(a, b, "two sweeps");
  ASSERT_TRUE(agreed.ok()) << agreed.status();
  const Json doc = Json::parse(*agreed);
  EXPECT_EQ(doc["about"], "two sweeps");
  ASSERT_EQ(doc["entries"].size(), 1u) << doc.dump();
  const Json& e = doc["entries"][0];
  EXPECT_EQ(e["m"], 64);
  EXPECT_EQ(e["candidate"], 3);
  EXPECT_EQ(e["sweeps"], 2);
  EXPECT_DOUBLE_EQ(e["first_us"].get<double>(), 30.2);
  EXPECT_DOUBLE_EQ(e["best_us"].get<double>(), 28.1);
  // The result is a table LtTable reads.
  absl::StatusOr<LtTable> t = LtTable::Parse(*agreed, "agreed");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_NE(t->Find("NVIDIA H200", 132, 130100, 64, 12288, 4096, false, 256), nullptr);
  // A bad input is an error, not an empty table.
  EXPECT_FALSE(LtTable::Agreement("{", b, "x").ok());
  EXPECT_FALSE(LtTable::Agreement(a, R"({"entries": [1]})", "x").ok());
}

// The compiled-in table parses, and each entry is a choice worth making: not the heuristic's own
// first (candidate 0), on a GPU named, with a measured gain recorded beside it.
TEST(GemmTableTest, TheBuiltinTableParsesAndEachEntryBeatsTheFirstChoice) {
  absl::StatusOr<LtTable> t = LtTable::Parse(LtTable::BuiltinJson(), "built-in");
  ASSERT_TRUE(t.ok()) << t.status();
  const Json doc = Json::parse(LtTable::BuiltinJson());
  ASSERT_EQ(doc["entries"].size(), t->entries().size());
  for (size_t i = 0; i < t->entries().size(); ++i) {
    const LtTableEntry& e = t->entries()[i];
    const Json& raw = doc["entries"][i];
    SCOPED_TRACE(raw.dump());
    EXPECT_GT(e.candidate, 0);
    ASSERT_TRUE(raw.contains("first_us") && raw.contains("best_us"));
    EXPECT_LT(raw["best_us"].get<double>(), raw["first_us"].get<double>());
  }
}

}  // namespace
}  // namespace tpserve::cuda
