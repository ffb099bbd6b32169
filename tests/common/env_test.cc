// common/env: the registry of environment switches parses each declared variable once by its
// type; a bad value is ignored with a warning (the default applies); the table lists them all.
#include "common/env.h"

#include <map>
#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tpserve {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

EnvRegistry FromMap(std::map<std::string, std::string> vars) {
  return EnvRegistry([vars](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

TEST(EnvTest, UnsetVariablesTakeTheirDefaults) {
  const EnvRegistry r = FromMap({});
  EXPECT_FALSE(r.IsSet(env::kPdl));
  EXPECT_TRUE(r.Bool(env::kPdl));
  EXPECT_FALSE(r.Bool(env::kCublasLtAutotune));
  EXPECT_EQ(r.String(env::kLogLevel), "info");
  EXPECT_EQ(r.String(env::kPrefillTile), "128");
  EXPECT_EQ(r.Int(env::kLoadThreads), 0);
  EXPECT_EQ(r.String(env::kServer), "localhost:50051");
  EXPECT_EQ(r.String(env::kMpirun), "mpirun");
  EXPECT_THAT(r.warnings(), IsEmpty());
  EXPECT_THAT(r.changed(), IsEmpty());
}

TEST(EnvTest, ValidValuesAreParsedByType) {
  const EnvRegistry r = FromMap({{"TPSERVE_PDL", "0"},
                                 {"TPSERVE_CUBLASLT_AUTOTUNE", "true"},
                                 {"TPSERVE_LOG_LEVEL", "debug"},
                                 {"TPSERVE_PREFILL_TILE", "64"},
                                 {"TPSERVE_LOAD_THREADS", "12"},
                                 {"TPSERVE_RANK", "3"},
                                 {"CUDA_VISIBLE_DEVICES", ""}});
  EXPECT_TRUE(r.IsSet(env::kPdl));
  EXPECT_FALSE(r.Bool(env::kPdl));
  EXPECT_TRUE(r.Bool(env::kCublasLtAutotune));
  EXPECT_EQ(r.String(env::kLogLevel), "debug");
  EXPECT_EQ(r.String(env::kPrefillTile), "64");
  EXPECT_EQ(r.Int(env::kLoadThreads), 12);
  EXPECT_EQ(r.Int(env::kRank), 3);
  // Set but empty is not unset: no GPU is visible.
  EXPECT_TRUE(r.IsSet(env::kCudaVisibleDevices));
  EXPECT_EQ(r.String(env::kCudaVisibleDevices), "");
  EXPECT_THAT(r.warnings(), IsEmpty());
  // Every TPSERVE_* switch set to a non-default value is reported (for the log), the launchers'
  // variables are not.
  EXPECT_THAT(r.changed(), SizeIs(6));
  for (const std::string& c : r.changed()) EXPECT_THAT(c, HasSubstr("TPSERVE_"));
}

TEST(EnvTest, BadValuesAreIgnoredWithAWarningAndTheDefault) {
  const EnvRegistry r = FromMap({{"TPSERVE_PDL", "maybe"},
                                 {"TPSERVE_LOG_LEVEL", "verbose"},
                                 {"TPSERVE_PREFILL_TILE", "96"},
                                 {"TPSERVE_LOAD_THREADS", "-2"},
                                 {"TPSERVE_WORLD_SIZE", "0"},
                                 {"SLURM_PROCID", "x"}});
  EXPECT_FALSE(r.IsSet(env::kPdl));
  EXPECT_TRUE(r.Bool(env::kPdl));
  EXPECT_EQ(r.String(env::kLogLevel), "info");
  EXPECT_EQ(r.String(env::kPrefillTile), "128");
  EXPECT_EQ(r.Int(env::kLoadThreads), 0);
  EXPECT_FALSE(r.IsSet(env::kWorldSize));
  EXPECT_EQ(r.Int(env::kWorldSize), 1);
  EXPECT_FALSE(r.IsSet(env::kSlurmProcid));
  ASSERT_THAT(r.warnings(), SizeIs(6));
  EXPECT_THAT(r.warnings()[0], HasSubstr("TPSERVE_LOG_LEVEL='verbose' is ignored"));
  EXPECT_THAT(r.warnings()[0], HasSubstr("debug|info|warning|error"));
  const std::string all =
      r.warnings()[1] + r.warnings()[2] + r.warnings()[3] + r.warnings()[4] + r.warnings()[5];
  EXPECT_THAT(all, HasSubstr("TPSERVE_PDL='maybe' is ignored"));
  EXPECT_THAT(all, HasSubstr("TPSERVE_PREFILL_TILE='96'"));
  EXPECT_THAT(all, HasSubstr("TPSERVE_LOAD_THREADS='-2' is ignored: expects an integer in [0,"));
  EXPECT_THAT(all, HasSubstr("using the default '1'"));
  EXPECT_THAT(r.changed(), IsEmpty());
}

TEST(EnvTest, TableListsEveryDeclaredVariableOnce) {
  const EnvRegistry r = FromMap({{"TPSERVE_PDL", "0"}});
  const std::string table = r.Table();
  std::set<std::string> names;
  for (const EnvVar* v : DeclaredEnvVars()) {
    EXPECT_TRUE(names.insert(v->name).second) << v->name << " declared twice";
    EXPECT_THAT(table, HasSubstr(v->name));
    EXPECT_THAT(table, HasSubstr(v->meaning));
  }
  EXPECT_THAT(table, HasSubstr("NAME"));
  EXPECT_THAT(table, HasSubstr("CURRENT"));
  EXPECT_THAT(table, HasSubstr("(unset)"));
  EXPECT_THAT(table, HasSubstr("benchmarks only"));
}

TEST(EnvTest, ProcessRegistryReadsTheEnvironmentOnce) {
  // The process registry is parsed on first use: what the environment held then, later changes
  // are not seen (a switch has one value for the life of the process).
  const bool before = EnvIsSet(env::kOpProfile);
  setenv("TPSERVE_OP_PROFILE", before ? "" : "1", 1);
  EXPECT_EQ(EnvIsSet(env::kOpProfile), before);
  unsetenv("TPSERVE_OP_PROFILE");
}

}  // namespace
}  // namespace tpserve
