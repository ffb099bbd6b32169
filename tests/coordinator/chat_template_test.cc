// Unit tests of the chat-template interpreter: each construct, Python semantics where Jinja
// defers to Python, whitespace control, load-time errors for unsupported constructs, render
// errors and raise_exception, limits, and loading from a model directory.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "coordinator/chat_template/chat_template.h"
#include "coordinator/chat_template/jinja.h"

namespace tpserve {
namespace {

using jinja::Template;
using jinja::Value;
using OrderedJson = nlohmann::ordered_json;

// Renders `src` with variables from a JSON object; returns the text or "ERROR: message".
std::string R(const std::string& src, const std::string& vars_json = "{}") {
  auto t = Template::Parse(src);
  if (!t.ok()) return "LOAD ERROR: " + std::string(t.status().message());
  auto out = (*t)->Render(Value::FromJson(OrderedJson::parse(vars_json)));
  if (!out.ok()) return "ERROR: " + std::string(out.status().message());
  return *out;
}

std::string LoadError(const std::string& src) {
  auto t = Template::Parse(src);
  if (t.ok()) return "(loaded)";
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(t.status().message());
}

TEST(ChatTemplateInterpreter, OutputCommentsAndText) {
  EXPECT_EQ(R("a{{ 'b' }}c{# gone #}d"), "abcd");
  EXPECT_EQ(R("{{ x }}|{{ y }}", R"({"x": "hi"})"), "hi|");  // undefined prints nothing
  EXPECT_EQ(R("{{ 1 }} {{ 2.5 }} {{ 3.0 }} {{ true }} {{ none }} {{ 1e-5 if false else 0.0001 }}"),
            "1 2.5 3.0 True None 0.0001");
  EXPECT_EQ(R("{{ [1, 'a', none] }} {{ {'k': 'v'} }}"), "[1, 'a', None] {'k': 'v'}");
  EXPECT_EQ(R("{{ \"it's\" }} {{ 'tab\\there' }} {{ '\\u00e9\\n' }}"), "it's tab\there é\n");
  EXPECT_EQ(R("line\n"), "line");  // one trailing newline dropped (keep_trailing_newline off)
  EXPECT_EQ(R("line\n\n"), "line\n");
}

TEST(ChatTemplateInterpreter, WhitespaceControlTrimAndLstripBlocks) {
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: indentation before it goes.
  EXPECT_EQ(R("{% if true %}\n  x\n  {% endif %}\ny"), "  x\ny");
  EXPECT_EQ(R("a  {%- if true -%}  b  {%- endif -%}  c"), "abc");
  EXPECT_EQ(R("a  {{- 'b' -}}  c"), "abc");
  EXPECT_EQ(R("a \n {{ 'b' }} \n c"), "a \n b \n c");  // expressions keep their whitespace
  EXPECT_EQ(R("x {% if true %}y{% endif %}"), "x y");  // not at line start: no lstrip
  EXPECT_EQ(R("a\n    {# c #}\nb"), "a\nb");
  EXPECT_EQ(R("{%+ if true %}x{% endif %}"), "x");
}

TEST(ChatTemplateInterpreter, IfElifElse) {
  const std::string t = "{% if n == 1 %}one{% elif n == 2 %}two{% else %}many{% endif %}";
  EXPECT_EQ(R(t, R"({"n": 1})"), "one");
  EXPECT_EQ(R(t, R"({"n": 2})"), "two");
  EXPECT_EQ(R(t, R"({"n": 7})"), "many");
  EXPECT_EQ(R("{% if x %}y{% endif %}"), "");
  EXPECT_EQ(R("{% if [] or {} or '' or 0 %}t{% else %}f{% endif %}"), "f");
}

TEST(ChatTemplateInterpreter, ForLoops) {
  EXPECT_EQ(R("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ x }}"
              "{{ 'F' if loop.first }}{{ 'L' if loop.last }}{{ loop.length }}"
              "{{ loop.revindex }};{% endfor %}",
              R"({"xs": ["a", "b"]})"),
            "10aF22;21bL21;");
  EXPECT_EQ(R("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(R("{% for x in xs|reverse %}{{ x }}{% endfor %}", R"({"xs": [1, 2, 3]})"), "321");
  EXPECT_EQ(
      R("{% for k, v in d.items() %}{{ k }}={{ v }},{% endfor %}", R"({"d": {"b": 1, "a": 2}})"),
      "b=1,a=2,");  // insertion order, as in Python
  EXPECT_EQ(R("{% for k, v in d|items %}{{ k }}{{ v }}{% endfor %}", R"({"d": {"x": 1}})"), "x1");
  EXPECT_EQ(R("{% for k in d %}{{ k }}{% endfor %}", R"({"d": {"x": 1, "y": 2}})"), "xy");
  EXPECT_EQ(
      R("{% for x in xs if x > 1 %}{{ x }}{{ loop.index }}{% endfor %}", R"({"xs": [1, 2, 3]})"),
      "2132");  // the condition filters before loop.* counts
  EXPECT_EQ(R("{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}"
              "{% break %}{% endif %}{{ x }}{% endfor %}",
              R"({"xs": [1, 2, 3, 4, 5]})"),
            "13");
  EXPECT_EQ(R("{% for a in [1, 2] %}{% for b in 'xy' %}{{ a }}{{ b }}{{ loop.index }} "
              "{% endfor %}{{ loop.index }}|{% endfor %}"),
            "1x1 1y2 1|2x1 2y2 2|");
  // A set inside a loop does not leak out of it (Jinja scoping).
  EXPECT_EQ(R("{% set x = 0 %}{% for i in [1, 2] %}{% set x = i %}{% endfor %}{{ x }}"), "0");
  EXPECT_EQ(R("{% for i in range(3) %}{{ i }}{% endfor %}{% for i in range(1, 7, 2) %}{{ i }}"
              "{% endfor %}"),
            "012135");
  EXPECT_EQ(R("{% for x in none %}{% endfor %}"), "ERROR: line 1: 'none' object is not iterable");
}

TEST(ChatTemplateInterpreter, SetNamespaceAndMacros) {
  EXPECT_EQ(R("{% set a = 'x' ~ 1 %}{{ a }}"), "x1");
  EXPECT_EQ(R("{% set a, b = 1, 2 %}{{ b }}{{ a }}"), "21");
  EXPECT_EQ(R("{% set ns = namespace(found=false, n=0) %}{% for m in ms %}"
              "{% if m == 'sys' %}{% set ns.found = true %}{% endif %}{% set ns.n = ns.n + 1 %}"
              "{% endfor %}{{ ns.found }} {{ ns.n }}",
              R"({"ms": ["u", "sys", "a"]})"),
            "True 3");
  EXPECT_EQ(R("{% set ns = namespace() %}{% set ns.x = 5 %}{{ ns.x }}"), "5");
  EXPECT_EQ(R("{% set d = {'a': 1} %}{% set d.a = 2 %}"),
            "ERROR: line 1: cannot assign attribute 'a' of 'd': it is not a namespace");
  EXPECT_EQ(R("{% set block %}a{{ 1 + 1 }}{% endset %}[{{ block }}]"), "[a2]");
  EXPECT_EQ(R("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}"
              "{{ greet('Bo') }} {{ greet('Al', punct='?') }} {{ greet(name='Cy') }}"),
            "Hi Bo! Hi Al? Hi Cy!");
}

TEST(ChatTemplateInterpreter, Expressions) {
  EXPECT_EQ(R("{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} "
              "{{ 7 / 2 }} {{ 2 ** 10 }} {{ 'ab' * 2 }}"),
            "7 9 3 -4 2 3.5 1024 abab");
  EXPECT_EQ(R("{{ 'a' ~ 1 ~ none ~ x }}"), "a1None");
  EXPECT_EQ(R("{{ [1] + [2] }} {{ 'x' + 'y' }} {{ (1, 'a') }} {{ (1,) }} {{ (1,) == [1] }}"),
            "[1, 2] xy (1, 'a') (1,) False");
  EXPECT_EQ(R("{{ 'a' + 1 }}"), "ERROR: line 1: unsupported operand types for +: 'str' and 'int'");
  EXPECT_EQ(R("{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in d }} {{ 'z' not in d }}",
              R"({"d": {"k": 1}})"),
            "True True True True");
  EXPECT_EQ(
      R("{{ 'y' if c else 'n' }}{{ 'y' if not c else 'n' }}{{ 'only' if c }}", R"({"c": true})"),
      "ynonly");
  EXPECT_EQ(R("{{ a and b }} {{ a or b }} {{ not a }}", R"({"a": 0, "b": "x"})"), "0 x True");
  EXPECT_EQ(
      R("{{ 1 < 2 <= 2 }} {{ 'a' < 'b' }} {{ 1 == 1.0 }} {{ [1, {'a': 2}] == [1, {'a': 2}] }}"),
      "True True True True");
  EXPECT_EQ(R("{{ m.role }} {{ m['content'] }} {{ m.missing }} {{ xs[0] }} {{ xs[-1] }} "
              "{{ xs[9] }} {{ xs.1 }}",
              R"({"m": {"role": "user", "content": "hi"}, "xs": [1, 2, 3]})"),
            "user hi  1 3  2");
  EXPECT_EQ(R("{{ xs[1:] }} {{ xs[:-1] }} {{ xs[::-1] }} {{ xs[::2] }} {{ s[::-1] }} {{ s[1:3] }}",
              R"({"xs": [1, 2, 3], "s": "héllo"})"),
            "[2, 3] [1, 2] [3, 2, 1] [1, 3] olléh él");
  EXPECT_EQ(R("{{ x.y }}"), "ERROR: line 1: 'x' is undefined (reading '.y')");
  EXPECT_EQ(R("{{ 1 / 0 }}"), "ERROR: line 1: division by zero");
}

TEST(ChatTemplateInterpreter, Tests) {
  EXPECT_EQ(R("{{ x is defined }}{{ y is defined }}{{ y is undefined }}{{ n is none }}"
              "{{ n is not none }}",
              R"({"x": 1, "n": null})"),
            "TrueFalseTrueTrueFalse");
  EXPECT_EQ(R("{{ s is string }}{{ d is mapping }}{{ l is iterable }}{{ s is iterable }}"
              "{{ 3 is number }}{{ 3 is integer }}{{ 3.0 is float }}{{ d is sequence }}",
              R"({"s": "a", "d": {}, "l": []})"),
            "TrueTrueTrueTrueTrueTrueTrueTrue");
  EXPECT_EQ(R("{{ 4 is even }}{{ 4 is odd }}{{ 9 is divisibleby 3 }}{{ 'a' is eq('a') }}"
              "{{ 'ab' is lower }}{{ true is true }}{{ none is sameas none }}"),
            "TrueFalseTrueTrueTrueTrueTrue");
  EXPECT_EQ(R("{{ not x is defined }}"), "True");
}

TEST(ChatTemplateInterpreter, Filters) {
  EXPECT_EQ(R("[{{ '  a b \\n' | trim }}] {{ 'abc'|upper }} {{ 'ABC'|lower }} "
              "{{ 'hello wORLD'|title }} {{ 'hELLO'|capitalize }}"),
            "[a b] ABC abc Hello World Hello");
  EXPECT_EQ(R("{{ xs|length }} {{ 'héllo'|length }} {{ d|length }} {{ xs|first }} {{ xs|last }} "
              "{{ xs|join(', ') }} {{ 'aXbX'|replace('X', '-') }} {{ 'ab'|list }}",
              R"({"xs": [1, 2, 3], "d": {"a": 1}})"),
            "3 5 1 1 3 1, 2, 3 a-b- ['a', 'b']");
  EXPECT_EQ(R("{{ x|default('d') }} {{ ''|default('d') }} {{ ''|default('d', true) }} "
              "{{ 42|string ~ '!' }} {{ '12'|int + 1 }} {{ 'x'|int }} {{ '2.5'|float }} "
              "{{ -3|abs }} {{ 'a'|safe }}"),
            "d  d 42! 13 0 2.5 3 a");
  EXPECT_EQ(R("{{ ms|selectattr('role', 'equalto', 'user')|map(attribute='c')|join }} "
              "{{ ms|rejectattr('role', 'equalto', 'user')|list|length }} "
              "{{ ms|selectattr('flag')|list|length }} {{ [1, 2, 3, 4]|select('odd')|list }} "
              "{{ ['b', 'A', 'c']|sort }} {{ [3, 1, 3]|unique|list }} {{ [1, 2]|sum }} "
              "{{ [' a ', 'b ']|map('trim')|join('|') }} {{ [4, 9]|max }}",
              R"({"ms": [{"role": "user", "c": "x"}, {"role": "bot", "c": "y", "flag": true},
                          {"role": "user", "c": "z"}]})"),
            "xz 1 1 [1, 3] ['A', 'b', 'c'] [3, 1] 3 a|b 9");
  EXPECT_EQ(R("{{ 'a\\nb\\n\\nc'|indent(2) }}"), "a\n  b\n\n  c");
}

TEST(ChatTemplateInterpreter, ToJsonLikeTransformers) {
  const std::string vars =
      R"({"t": {"name": "f", "d": "Zürich 🙂 \"q\"\n", "n": [1, 2.5, true, null],
                                      "e": {}, "l": []}})";
  // json.dumps(ensure_ascii=False): separators ", " and ": ", keys in insertion order.
  EXPECT_EQ(
      R("{{ t|tojson }}", vars),
      R"({"name": "f", "d": "Zürich 🙂 \"q\"\n", "n": [1, 2.5, true, null], "e": {}, "l": []})");
  // With indent the item separator is ",".
  EXPECT_EQ(R("{{ t.n|tojson(indent=2) }}", vars), "[\n  1,\n  2.5,\n  true,\n  null\n]");
  EXPECT_EQ(R("{{ {'b': 1, 'a': [{}]}|tojson(indent=4) }}"),
            "{\n    \"b\": 1,\n    \"a\": [\n        {}\n    ]\n}");
  EXPECT_EQ(R("{{ 'é🙂'|tojson(ensure_ascii=true) }}"), R"("\u00e9\ud83d\ude42")");
  EXPECT_EQ(R("{{ {'b': 1, 'a': 2}|tojson(sort_keys=true, separators=[',', ':']) }}"),
            R"({"a":2,"b":1})");
}

TEST(ChatTemplateInterpreter, StringAndDictMethods) {
  EXPECT_EQ(R("[{{ '  x  '.strip() }}|{{ '  x '.lstrip() }}|{{ ' x  '.rstrip() }}|"
              "{{ '\\n\\nx\\n'.strip('\\n') }}|{{ 'xxaxx'.strip('x') }}]"),
            "[x|x | x|x|a]");
  EXPECT_EQ(R("{{ 'a b  c'.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a,b,c'.split(',', 1) }} "
              "{{ 'x</think>y'.split('</think>')[-1] }}"),
            "['a', 'b', 'c'] ['a', 'b', '', 'c'] ['a', 'b,c'] y");
  EXPECT_EQ(R("{{ 'hello'.startswith('he') }} {{ 'hello'.endswith('lo') }} "
              "{{ 'hello'.startswith(('x', 'h')) }} {{ 'Ab'.upper() }}{{ 'Ab'.lower() }} "
              "{{ \"don't stop\".title() }} {{ 'aXa'.replace('a', 'b') }} {{ 'abc'.find('c') }}"),
            "True True True ABab Don'T Stop bXb 2");
  EXPECT_EQ(R("{{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 0) }} {{ d.keys()|list }} "
              "{{ d.values()|list }} {{ d.items()|list }}",
              R"({"d": {"a": 1, "b": 2}})"),
            "1 None 0 ['a', 'b'] [1, 2] [('a', 1), ('b', 2)]");
  EXPECT_EQ(R("{{ 5.strip() }}"), "ERROR: line 1: 'int' object has no method 'strip'");
}

TEST(ChatTemplateInterpreter, RaiseException) {
  const std::string t =
      "{% if messages|length == 0 %}{{ raise_exception('No messages: ' ~ 0) }}{% endif %}ok";
  EXPECT_EQ(R(t, R"({"messages": []})"), "ERROR: No messages: 0");  // exactly the message
  EXPECT_EQ(R(t, R"({"messages": [1]})"), "ok");
  auto tmpl = Template::Parse(t);
  ASSERT_TRUE(tmpl.ok());
  auto r = (*tmpl)->Render(Value::FromJson(OrderedJson::parse(R"({"messages": []})")));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(jinja::IsRaisedError(r.status()));
  // The message stays exact even when it looks like a located error.
  auto ct = ChatTemplate::FromString("{{ raise_exception('line 3: custom') }}", "", "");
  ASSERT_TRUE(ct.ok());
  EXPECT_EQ((*ct)->Render({}, false).status().message(), "line 3: custom");
  auto other = Template::Parse("{{ 1 // 0 }}");
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(jinja::IsRaisedError((*other)->Render(Value::NewObject()).status()));
}

TEST(ChatTemplateInterpreter, UnsupportedConstructsFailAtLoadNamingThem) {
  EXPECT_EQ(LoadError("a\n{{ x | frobnicate }}"), "line 2: unknown filter 'frobnicate'");
  EXPECT_EQ(LoadError("{% if x is weird %}{% endif %}"), "line 1: unknown test 'weird'");
  EXPECT_EQ(LoadError("\n\n{{ s.zfill(3) }}"), "line 3: unknown method 'zfill'");
  EXPECT_EQ(LoadError("{{ lipsum(2) }}"), "line 1: unknown function 'lipsum'");
  EXPECT_EQ(LoadError("{% include 'x.j2' %}"), "line 1: unsupported tag 'include'");
  EXPECT_EQ(LoadError("x\n{% extends 'base' %}"), "line 2: unsupported tag 'extends'");
  EXPECT_EQ(LoadError("{% for x in xs %}"),
            "line 1: unexpected end of template, expected else or endfor");
  EXPECT_EQ(LoadError("{% endif %}"), "line 1: unexpected 'endif' without a matching block");
  EXPECT_EQ(LoadError("{{ 'abc }}"), "line 1: unterminated string literal");
  EXPECT_EQ(LoadError("{{ x "), "line 1: unclosed '{{': missing '}}'");
  EXPECT_EQ(LoadError("{# never closed"), "line 1: unclosed comment: missing '#}'");
  EXPECT_EQ(LoadError("{% break %}"), "line 1: 'break' outside a for loop");
  EXPECT_EQ(LoadError("{{ 1 + }}"), "line 1: unexpected '}}' in expression");
  EXPECT_EQ(LoadError("{{ a ? b }}"), "line 1: unexpected character '?'");
  // Found by the fuzzer: literals beyond double or int64 are load errors, not exceptions.
  EXPECT_EQ(LoadError("{{ 6666660025832808491e6666 }}"),
            "line 1: number literal out of range: 6666660025832808491e6666");
  EXPECT_EQ(LoadError("{{ 99999999999999999999 }}"),
            "line 1: number literal out of range: 99999999999999999999");
  // A macro defined anywhere in the template may be called before its definition.
  EXPECT_EQ(LoadError("{{ m() }}{% macro m() %}x{% endmacro %}"), "(loaded)");
  // Nesting is bounded instead of overflowing the stack.
  EXPECT_EQ(LoadError("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}"),
            "line 1: expression nested too deeply");
}

TEST(ChatTemplateInterpreter, WorkIsBounded) {
  auto t = Template::Parse(
      "{% for a in range(1000) %}{% for b in range(1000) %}{% for c in range(1000) %}x"
      "{% endfor %}{% endfor %}{% endfor %}");
  ASSERT_TRUE(t.ok());
  jinja::RenderLimits limits;
  limits.max_steps = 100000;
  auto r = (*t)->Render(Value::NewObject(), limits);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("limit"), std::string::npos) << r.status();
  auto big = Template::Parse("{{ 'x' * 1000000000 }}");
  ASSERT_TRUE(big.ok());
  EXPECT_FALSE((*big)->Render(Value::NewObject()).ok());
  auto rec = Template::Parse("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  ASSERT_TRUE(rec.ok());
  auto rr = (*rec)->Render(Value::NewObject());
  ASSERT_FALSE(rr.ok());
  EXPECT_NE(rr.status().message().find("nested too deeply"), std::string::npos) << rr.status();
}

TEST(ChatTemplateInterpreter, NoCyclesAndBoundedNesting) {
  EXPECT_EQ(R("{% set ns = namespace(x=1) %}{% set ns.self = ns %}"),
            "ERROR: line 1: a namespace cannot be stored in a namespace attribute");
  EXPECT_EQ(R("{% set ns = namespace(x=1) %}{% set ns.l = [1, [ns]] %}"),
            "ERROR: line 1: a namespace cannot be stored in a namespace attribute");
  EXPECT_EQ(R("{% set ns = namespace(x=0) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}"
              "{% endfor %}{{ ns.x|length }}"),
            "ERROR: line 1: value nested too deeply");
  EXPECT_EQ(R("{% set ns = namespace(x=0) %}{% for i in range(100) %}{% set ns.x = [ns.x] %}"
              "{% endfor %}{{ ns.x|length }}"),
            "1");
}

TEST(ChatTemplate, RenderMessagesAndTokens) {
  auto t = ChatTemplate::FromString(
      "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}"
      "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
      "{% if tools is not none %}T{% endif %}",
      "<s>", "</s>");
  ASSERT_TRUE(t.ok()) << t.status();
  auto out = (*t)->Render({{"user", "héllo 🙂"}, {"assistant", "yo"}}, true);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "<s><user>héllo 🙂</s><assistant>yo</s><assistant>");
  auto no_gen = (*t)->Render({{"user", "x"}}, false);
  ASSERT_TRUE(no_gen.ok());
  EXPECT_EQ(*no_gen, "<s><user>x</s>");
  auto tools = (*t)->RenderJson(OrderedJson::parse(R"([{"role": "user", "content": "x"}])"), false,
                                OrderedJson::parse(R"([{"type": "function"}])"));
  ASSERT_TRUE(tools.ok());
  EXPECT_EQ(*tools, "<s><user>x</s>T");
  EXPECT_FALSE((*t)->RenderJson(OrderedJson::object(), false).ok());
  // Request JSON nested without end is refused before it is converted (no deep recursion).
  OrderedJson deep = OrderedJson::array();
  OrderedJson* at = &deep;
  for (int i = 0; i < 100000; ++i) {
    at->push_back(OrderedJson::array());
    at = &at->back();
  }
  OrderedJson deep_messages = OrderedJson::array();
  deep_messages.push_back({{"role", "user"}, {"content", std::move(deep)}});
  auto deep_r = (*t)->RenderJson(deep_messages, false);
  EXPECT_EQ(deep_r.status().code(), absl::StatusCode::kInvalidArgument) << deep_r.status();
  auto bad = ChatTemplate::FromString("{{ x|nope }}", "", "");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "chat template line 1: unknown filter 'nope'");
  auto err = ChatTemplate::FromString("\n{{ messages[0].x.y }}", "", "");
  ASSERT_TRUE(err.ok());
  auto e = (*err)->Render({{"user", "x"}}, false);
  EXPECT_EQ(e.status().message(),
            "chat template line 2: 'messages[0].x' is undefined (reading '.y')")
      << e.status();
}

class ChatTemplateLoad : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("tpserve_chat_template_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void WriteConfig(const std::string& text) {
    std::ofstream(dir_ / "tokenizer_config.json") << text;
  }
  std::filesystem::path dir_;
};

TEST_F(ChatTemplateLoad, StringTemplateWithAddedTokens) {
  WriteConfig(R"({"bos_token": {"__type": "AddedToken", "content": "<B>"}, "eos_token": "<E>",
                  "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"})");
  auto t = ChatTemplate::Load(dir_.string());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->bos_token(), "<B>");
  EXPECT_EQ(*(*t)->Render({{"user", "hi"}}, false), "<B>hi<E>");
}

TEST_F(ChatTemplateLoad, ListOfNamedTemplatesUsesDefault) {
  WriteConfig(R"({"chat_template": [{"name": "tool_use", "template": "T"},
                                    {"name": "default", "template": "D{{ eos_token }}"}]})");
  auto t = ChatTemplate::Load(dir_.string());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*(*t)->Render({}, false), "D");
  WriteConfig(R"({"chat_template": [{"name": "tool_use", "template": "T"}]})");
  auto none = ChatTemplate::Load(dir_.string());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound) << none.status();
}

TEST_F(ChatTemplateLoad, MissingTemplateIsNotFoundAndBadOneNamesTheConstruct) {
  WriteConfig(R"({"bos_token": "<s>"})");
  EXPECT_EQ(ChatTemplate::Load(dir_.string()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ChatTemplate::Load((dir_ / "nope").string()).status().code(),
            absl::StatusCode::kNotFound);
  WriteConfig(R"({"chat_template": "ok\n{% for m in messages %}{{ m|weird }}{% endfor %}"})");
  auto bad = ChatTemplate::Load(dir_.string());
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("line 2: unknown filter 'weird'"), std::string::npos)
      << bad.status();
  WriteConfig("{not json");
  EXPECT_EQ(ChatTemplate::Load(dir_.string()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplate, BundledTinyCoderHasATemplate) {
  const char* src = std::getenv("TPSERVE_SOURCE_DIR");
  auto t = ChatTemplate::Load(std::string(src ? src : ".") + "/models/tiny-coder");
  ASSERT_TRUE(t.ok()) << t.status();
  auto out = (*t)->Render({{"system", "Be brief."}, {"user", "def f(x):"}}, true);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out,
            "<｜begin▁of▁sentence｜>Be brief.\n\n### Instruction:\ndef f(x):\n### Response:\n");
  auto bad_role = (*t)->Render({{"tool", "{}"}}, false);
  EXPECT_EQ(bad_role.status().message(), "tiny-coder chat: unsupported role tool");
}

}  // namespace
}  // namespace tpserve
