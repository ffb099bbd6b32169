// Tokenizer of chat templates (see lexer.h). Line numbers are those of the original source.
#include "coordinator/chat_template/lexer.h"

#include <algorithm>
#include <charconv>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tpserve::jinja {
namespace {

bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}
bool IsNameStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

void AppendUtf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

class Lexer {
 public:
  explicit Lexer(const std::string& source) : src_(source) {
    // keep_trailing_newline=False: one final newline is not part of the output.
    end_ = src_.size();
    if (end_ > 0 && src_[end_ - 1] == '\n') --end_;
    for (size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
    }
  }

  absl::StatusOr<std::vector<Token>> Run() {
    while (pos_ < end_) {
      size_t start = FindTagStart(pos_);
      std::string text = src_.substr(pos_, start - pos_);
      if (start == end_) {
        EmitText(std::move(text), pos_);
        break;
      }
      const char kind = src_[start + 1];
      size_t inner = start + 2;
      bool plus = inner < end_ && src_[inner] == '+';
      bool minus = inner < end_ && src_[inner] == '-';
      if ((kind == '%' || kind == '#') && !plus) LstripBlock(text, pos_);
      if (minus) {
        while (!text.empty() && IsSpace(text.back())) text.pop_back();
      }
      if (plus || minus) ++inner;
      EmitText(std::move(text), pos_);
      if (kind == '#') {
        size_t close = src_.find("#}", inner);
        if (close == std::string::npos || close + 2 > end_) {
          return Error(start, "unclosed comment: missing '#}'");
        }
        bool strip_after = close > inner && src_[close - 1] == '-';
        pos_ = close + 2;
        AfterBlockClose(strip_after);
        continue;
      }
      const bool is_expr = kind == '{';
      tokens_.push_back(Make(is_expr ? Token::Kind::kExprOpen : Token::Kind::kStmtOpen,
                             is_expr ? "{{" : "{%", start));
      pos_ = inner;
      absl::Status s = LexInside(is_expr, start);
      if (!s.ok()) return s;
    }
    tokens_.push_back(Make(Token::Kind::kEnd, "", end_));
    return std::move(tokens_);
  }

 private:
  int LineAt(size_t pos) const {
    return static_cast<int>(std::upper_bound(line_starts_.begin(), line_starts_.end(), pos) -
                            line_starts_.begin()) +
           1;
  }
  Token Make(Token::Kind kind, std::string text, size_t pos) const {
    Token t;
    t.kind = kind;
    t.text = std::move(text);
    t.line = LineAt(pos);
    return t;
  }
  absl::Status Error(size_t pos, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat("line ", LineAt(pos), ": ", what));
  }

  size_t FindTagStart(size_t from) const {
    for (size_t i = from; i + 1 < end_; ++i) {
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return end_;
  }

  void EmitText(std::string text, size_t pos) {
    if (!text.empty()) tokens_.push_back(Make(Token::Kind::kText, std::move(text), pos));
  }

  // lstrip_blocks: drops spaces and tabs between the start of the line and a block tag.
  void LstripBlock(std::string& text, size_t text_pos) const {
    size_t nl = text.rfind('\n');
    size_t tail = 0;
    if (nl != std::string::npos) {
      tail = nl + 1;
    } else if (!(text_pos == 0 || src_[text_pos - 1] == '\n')) {
      return;  // the tag does not start its line
    }
    for (size_t i = tail; i < text.size(); ++i) {
      if (text[i] != ' ' && text[i] != '\t') return;
    }
    text.erase(tail);
  }

  // After %} or #}: '-' strips all following whitespace, otherwise trim_blocks drops one '\n'.
  void AfterBlockClose(bool strip_after) {
    if (strip_after) {
      while (pos_ < end_ && IsSpace(src_[pos_])) ++pos_;
    } else if (pos_ < end_ && src_[pos_] == '\n') {
      ++pos_;
    }
  }

  absl::Status LexInside(bool is_expr, size_t open_pos) {
    int brace_depth = 0;
    while (true) {
      while (pos_ < end_ && IsSpace(src_[pos_])) ++pos_;
      if (pos_ >= end_) {
        return Error(open_pos,
                     is_expr ? "unclosed '{{': missing '}}'" : "unclosed '{%': missing '%}'");
      }
      const char c = src_[pos_];
      // Closing delimiters, with optional whitespace control.
      size_t p = pos_ + (c == '-' ? 1 : 0);
      if (p + 2 <= end_) {
        const bool close_stmt = !is_expr && src_.compare(p, 2, "%}") == 0;
        const bool close_expr = is_expr && brace_depth == 0 && src_.compare(p, 2, "}}") == 0;
        if (close_stmt || close_expr) {
          tokens_.push_back(Make(is_expr ? Token::Kind::kExprClose : Token::Kind::kStmtClose,
                                 is_expr ? "}}" : "%}", pos_));
          pos_ = p + 2;
          if (is_expr) {
            if (c == '-') {
              while (pos_ < end_ && IsSpace(src_[pos_])) ++pos_;
            }
          } else {
            AfterBlockClose(c == '-');
          }
          return absl::OkStatus();
        }
      }
      if (c == '\'' || c == '"') {
        absl::StatusOr<std::string> s = LexString(c);
        if (!s.ok()) return s.status();
        Token t = Make(Token::Kind::kString, std::move(*s), pos_);
        tokens_.push_back(std::move(t));
        continue;
      }
      if (IsDigit(c)) {
        size_t start = pos_;
        while (pos_ < end_ && (IsDigit(src_[pos_]) || src_[pos_] == '_')) ++pos_;
        bool is_float = false;
        if (pos_ + 1 < end_ && src_[pos_] == '.' && IsDigit(src_[pos_ + 1])) {
          is_float = true;
          ++pos_;
          while (pos_ < end_ && IsDigit(src_[pos_])) ++pos_;
        }
        // An exponent: 1e-5, 2.5E+3.
        if (pos_ < end_ && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
          size_t q = pos_ + 1;
          if (q < end_ && (src_[q] == '+' || src_[q] == '-')) ++q;
          if (q < end_ && IsDigit(src_[q])) {
            is_float = true;
            pos_ = q;
            while (pos_ < end_ && IsDigit(src_[pos_])) ++pos_;
          }
        }
        std::string text;
        for (size_t i = start; i < pos_; ++i) {
          if (src_[i] != '_') text.push_back(src_[i]);
        }
        Token t = Make(is_float ? Token::Kind::kFloat : Token::Kind::kInt, text, start);
        const char* first = text.data();
        const char* last = text.data() + text.size();
        std::from_chars_result r = is_float ? std::from_chars(first, last, t.float_value)
                                            : std::from_chars(first, last, t.int_value);
        if (r.ec != std::errc() || r.ptr != last) {
          return Error(start, "number literal out of range: " + text.substr(0, 40));
        }
        tokens_.push_back(std::move(t));
        continue;
      }
      if (IsNameStart(c)) {
        size_t start = pos_;
        while (pos_ < end_ && (IsNameStart(src_[pos_]) || IsDigit(src_[pos_]))) ++pos_;
        tokens_.push_back(Make(Token::Kind::kName, src_.substr(start, pos_ - start), start));
        continue;
      }
      static const char* kTwoChar[] = {"//", "**", "==", "!=", "<=", ">="};
      bool matched = false;
      for (const char* op : kTwoChar) {
        if (src_.compare(pos_, 2, op) == 0 && pos_ + 2 <= end_) {
          tokens_.push_back(Make(Token::Kind::kOp, op, pos_));
          pos_ += 2;
          matched = true;
          break;
        }
      }
      if (matched) continue;
      static const std::string kOneChar = "+-*/%~<>=()[]{},.:|";
      if (kOneChar.find(c) != std::string::npos) {
        if (c == '{') ++brace_depth;
        if (c == '}') --brace_depth;
        tokens_.push_back(Make(Token::Kind::kOp, std::string(1, c), pos_));
        ++pos_;
        continue;
      }
      return Error(pos_, absl::StrCat("unexpected character '", std::string(1, c), "'"));
    }
  }

  absl::StatusOr<std::string> LexString(char quote) {
    const size_t start = pos_;
    ++pos_;
    std::string out;
    while (true) {
      if (pos_ >= end_) return Error(start, "unterminated string literal");
      char c = src_[pos_++];
      if (c == quote) return out;
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (pos_ >= end_) return Error(start, "unterminated string literal");
      char e = src_[pos_++];
      switch (e) {
        case 'n':
          out.push_back('\n');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'v':
          out.push_back('\v');
          break;
        case '0':
          out.push_back('\0');
          break;
        case '\\':
        case '\'':
        case '"':
          out.push_back(e);
          break;
        case '\n':
          break;  // line continuation
        case 'x':
        case 'u':
        case 'U': {
          const int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (int k = 0; k < digits; ++k) {
            int h = pos_ < end_ ? HexValue(src_[pos_]) : -1;
            if (h < 0) {
              return Error(start, absl::StrCat("invalid \\", std::string(1, e), " escape"));
            }
            cp = cp * 16 + static_cast<uint32_t>(h);
            ++pos_;
          }
          if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
            return Error(start, "escape is not a valid code point");
          }
          AppendUtf8(cp, out);
          break;
        }
        default:  // Python keeps unknown escapes as written
          out.push_back('\\');
          out.push_back(e);
      }
    }
  }

  const std::string& src_;
  size_t end_ = 0;
  size_t pos_ = 0;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

}  // namespace

absl::StatusOr<std::vector<Token>> Tokenize(const std::string& source) {
  return Lexer(source).Run();
}

}  // namespace tpserve::jinja
