// common/flags: parsing against a declaration table (kinds, ranges, unknown flags, positional
// arguments, --help) and the generated usage.
#include "common/flags.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tpserve {
namespace {

using ::testing::HasSubstr;

const CommandSpec& TestSpec() {
  static const CommandSpec* const spec = new CommandSpec{
      "tpserve test",
      "A command for the tests.",
      {StringFlag("model", "DIR", "model directory"), IntFlag("port", 0, 65535, "port", "P"),
       FloatFlag("fraction", 0, 1, "a fraction", "F", /*min_exclusive=*/true),
       FloatFlag("seconds", 0.5, 10, "a duration", "S"), BoolFlag("verbose", "say more"),
       Repeated(StringFlag("stop", "STR", "a stop string"))},
      "notes at the end"};
  return *spec;
}

std::string ErrorOf(const std::vector<std::string>& args) {
  auto f = Flags::Parse(TestSpec(), args);
  EXPECT_FALSE(f.ok());
  if (f.ok()) return "";
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(f.status().message());
}

TEST(FlagsTest, ParsesEveryKindInBothForms) {
  auto f = Flags::Parse(TestSpec(), {"--model", "m", "--port=80", "--fraction", "0.25",
                                     "--seconds=0.5", "--verbose"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE(f->help());
  EXPECT_EQ(f->GetOr("model", ""), "m");
  EXPECT_EQ(f->GetInt("port", 1), 80);
  EXPECT_DOUBLE_EQ(f->GetDouble("fraction", 1), 0.25);
  EXPECT_DOUBLE_EQ(f->GetDouble("seconds", 1), 0.5);
  EXPECT_TRUE(f->Flag("verbose"));
}

TEST(FlagsTest, AbsentFlagsGiveTheFallback) {
  auto f = Flags::Parse(TestSpec(), {});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE(f->Has("port"));
  EXPECT_EQ(f->GetInt("port", 50051), 50051);
  EXPECT_DOUBLE_EQ(f->GetDouble("fraction", 0.9), 0.9);
  EXPECT_FALSE(f->Flag("verbose"));
  EXPECT_FALSE(f->Required("model").ok());
  EXPECT_THAT(std::string(f->Required("model").status().message()), HasSubstr("--model"));
}

TEST(FlagsTest, BoolAcceptsExplicitTrueAndFalse) {
  auto f = Flags::Parse(TestSpec(), {"--verbose", "--verbose=false"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE(f->Flag("verbose"));
  f = Flags::Parse(TestSpec(), {"--verbose=1"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->Flag("verbose"));
  EXPECT_THAT(ErrorOf({"--verbose=yes"}), HasSubstr("--verbose takes no value"));
}

TEST(FlagsTest, OutOfRangeIntNamesFlagValueAndRange) {
  const std::string e = ErrorOf({"--port", "70000"});
  EXPECT_THAT(e, HasSubstr("--port"));
  EXPECT_THAT(e, HasSubstr("'70000'"));
  EXPECT_THAT(e, HasSubstr("[0, 65535]"));
  EXPECT_THAT(ErrorOf({"--port=-1"}), HasSubstr("[0, 65535]"));
}

TEST(FlagsTest, MalformedNumbersAreErrors) {
  EXPECT_THAT(ErrorOf({"--port", "80x"}), HasSubstr("expects an integer in [0, 65535], got '80x'"));
  EXPECT_THAT(ErrorOf({"--port", "1.5"}), HasSubstr("'1.5'"));
  EXPECT_THAT(ErrorOf({"--port", ""}), HasSubstr("--port"));
  EXPECT_THAT(ErrorOf({"--fraction", "most"}), HasSubstr("expects a number in (0, 1], got 'most'"));
  EXPECT_THAT(ErrorOf({"--fraction", "nan"}), HasSubstr("'nan'"));
  EXPECT_THAT(ErrorOf({"--fraction", "inf"}), HasSubstr("'inf'"));
}

TEST(FlagsTest, FloatRangeBoundsAreExactlyAsDeclared) {
  EXPECT_THAT(ErrorOf({"--fraction", "0"}), HasSubstr("(0, 1]"));
  EXPECT_THAT(ErrorOf({"--fraction", "1.0001"}), HasSubstr("(0, 1]"));
  EXPECT_TRUE(Flags::Parse(TestSpec(), {"--fraction", "1"}).ok());
  EXPECT_THAT(ErrorOf({"--seconds", "0.49"}), HasSubstr("[0.5, 10]"));
  EXPECT_TRUE(Flags::Parse(TestSpec(), {"--seconds", "10"}).ok());
}

TEST(FlagsTest, UnknownFlagMissingValueAndPositionalAreRefused) {
  EXPECT_THAT(ErrorOf({"--bogus", "1"}), HasSubstr("unknown flag --bogus"));
  EXPECT_THAT(ErrorOf({"--model"}), HasSubstr("--model needs a value"));
  EXPECT_THAT(ErrorOf({"--model", "m", "extra"}), HasSubstr("unexpected argument 'extra'"));
  EXPECT_THAT(ErrorOf({"--"}), HasSubstr("unexpected argument '--'"));
  EXPECT_THAT(ErrorOf({"-v"}), HasSubstr("unexpected argument '-v'"));
}

TEST(FlagsTest, HelpStopsParsingButNotAsAValue) {
  for (const char* h : {"--help", "-h"}) {
    auto f = Flags::Parse(TestSpec(), {"--port", "80", h, "--bogus"});
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_TRUE(f->help());
  }
  auto f = Flags::Parse(TestSpec(), {"--model", "--help"});  // a model named "--help"
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE(f->help());
  EXPECT_EQ(f->GetOr("model", ""), "--help");
}

TEST(FlagsTest, UsageListsEveryFlagWithRangeAndMeaning) {
  const std::string u = Usage(TestSpec());
  EXPECT_THAT(u, HasSubstr("usage: tpserve test"));
  EXPECT_THAT(u, HasSubstr("A command for the tests."));
  for (const FlagSpec& f : TestSpec().flags) {
    EXPECT_THAT(u, HasSubstr("--" + f.name)) << u;
    EXPECT_THAT(u, HasSubstr(f.meaning)) << u;
  }
  EXPECT_THAT(u, HasSubstr("--port P"));
  EXPECT_THAT(u, HasSubstr("port [0, 65535]"));
  EXPECT_THAT(u, HasSubstr("a fraction (0, 1]"));
  EXPECT_THAT(u, HasSubstr("--help"));
  EXPECT_THAT(u, HasSubstr("notes at the end"));
}

TEST(FlagsTest, RepeatedFlagKeepsEveryValueInOrder) {
  auto f = Flags::Parse(TestSpec(), {"--stop", "a", "--stop=b", "--port", "1", "--port", "2"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_THAT(f->GetAll("stop"), ::testing::ElementsAre("a", "b"));
  EXPECT_EQ(f->GetInt("port", 0), 2);  // not repeated: the last one counts
  EXPECT_TRUE(f->GetAll("model").empty());
  EXPECT_THAT(Usage(TestSpec()), HasSubstr("a stop string (may be repeated)"));
}

TEST(FlagsTest, TokenIdListsRefuseEmptyEntries) {
  auto ids = ParseTokenIds("prompt-ids", "1, 2,3");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ::testing::ElementsAre(1, 2, 3));
  for (const char* bad : {"1,,2", "", "1,2,", "1,x"}) {
    auto r = ParseTokenIds("prompt-ids", bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_THAT(r.status().message(), HasSubstr("--prompt-ids")) << bad;
  }
}

TEST(FlagsTest, ServerPortMustBeInRange) {
  for (const char* ok : {"localhost:50051", "10.0.0.1:1", "[::1]:65535", "unix:/tmp/tpserve.sock",
                         "dns:///svc.local:443", "host"}) {
    EXPECT_TRUE(CheckServerAddress("server", ok).ok()) << ok;
  }
  for (const char* bad : {"localhost:115687", "localhost:0", "[::1]:65536"}) {
    const absl::Status s = CheckServerAddress("server", bad);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_THAT(s.message(), HasSubstr("outside [1, 65535]")) << bad;
  }
}

}  // namespace
}  // namespace tpserve
