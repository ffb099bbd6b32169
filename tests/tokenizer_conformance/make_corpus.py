#!/usr/bin/env python3
"""Writes corpus.json, the tokenizer conformance corpus (run once; the output is checked in).

Each case: {"name", "text"} with optional "repeat" (the text is repeated that many times) or
{"name", "hex"}: raw bytes that are not valid UTF-8. tpserve encodes those bytes as they are; the
references encode the lossy decoding (each maximal ill-formed subsequence -> U+FFFD), which is
tpserve's documented behaviour.
"""
import json
import os

cases = []


def add(name, text, repeat=None):
    c = {"name": name, "text": text}
    if repeat:
        c["repeat"] = repeat
    cases.append(c)


add("empty", "")
add("single_space", " ")
add("hello", "Hello, world!")
add("english", "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see.")
add("contractions_case", "I'M sure you'RE right, she'S THERE. They'VE, We'LL, I'D, don't DON'T can't.")
add("mixed_case", "camelCaseIdentifier snake_case_name SCREAMING_CASE MiXeD cAsE iPhone McDonald")
add("python", '''import os\n\ndef fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\nif __name__ == "__main__":\n    print(fib(30), os.getcwd())\n''')
add("cpp", '''#include <vector>\n#include <cstdint>\n\ntemplate <typename T>\nstd::vector<T> Scale(const std::vector<T>& v, T k) {\n  std::vector<T> out(v.size());\n  for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] * k;  // x*=k\n  return out;\n}\n\nint main() { auto r = Scale<int32_t>({1, 2, 3}, 0x7F); return r[2] >> 1; }\n''')
add("rust", '''fn main() {\n    let v: Vec<u64> = (1..=10).map(|x| x * x).collect();\n    println!("{:?} {}", v, v.iter().sum::<u64>());\n    if let Some(&m) = v.iter().max() { eprintln!("max={m}"); }\n}\n''')
add("javascript", '''const f = async (url) => {\n  const r = await fetch(`${url}?q=${encodeURIComponent("a b")}`);\n  return r.ok ? r.json() : null; // ok?\n};\nexport default f;\n''')
add("go", '''package main\n\nimport "fmt"\n\nfunc main() {\n\tch := make(chan int, 3)\n\tgo func() { for i := 0; i < 3; i++ { ch <- i } ; close(ch) }()\n\tfor v := range ch {\n\t\tfmt.Printf("%d\\n", v)\n\t}\n}\n''')
add("java", '''public final class Main {\n    public static void main(String[] args) {\n        var map = new java.util.HashMap<String, Integer>();\n        map.merge("key", 1, Integer::sum);\n        System.out.println(map);\n    }\n}\n''')
add("html_css", '''<!DOCTYPE html>\n<html lang="en"><head><style>body { margin: 0 auto; color: #333; }</style></head>\n<body><p class="x">&lt;tag&gt; &amp; text</p><br/></body></html>\n''')
add("sql_shell", '''SELECT u.id, COUNT(*) AS n FROM users u JOIN orders o ON o.user_id = u.id WHERE o.total > 100.50 GROUP BY u.id;\n$ for f in *.txt; do wc -l "$f" | awk '{print $1}'; done 2>&1 | sort -n\n''')
add("json", '{"a": [1, 2.5e-3, -7], "b": {"c": null, "d": true}, "e": "x\\ny\\u00e9"}')
add("chinese", "我们今天去公园散步，天气非常好。人工智能（AI）正在改变世界！中文分词测试：北京大学生前来应聘。")
add("japanese", "今日は良い天気ですね。カタカナとひらがな、そして漢字を混ぜます。東京スカイツリーは634メートルです。")
add("korean", "안녕하세요. 오늘 날씨가 정말 좋네요! 한국어 토크나이저 테스트입니다. 서울특별시 강남구")
add("cjk_mixed", "GPU显存80GB，吞吐量1234 tokens/s；日本語とEnglishのmix、한국어도 OK。")
add("emoji", "I love 🦀 and 🐍! 👨‍👩‍👧‍👦 family, flags 🇯🇵🇺🇸, skin 👍🏽, 🤖💬 done. 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 𠜎𠜱𠝹")
add("four_byte", "𐍈𐌰𐌹 ancient 𝄞 music 🀄 mahjong 🂡 cards 😀😃😄😁")
add("accents", "Café naïve résumé façade Ñandú Ångström Zürich ŽŠČ œuvre ß ǅ ﬁ ① Ⅻ ½")
add("nfc_nfd", "e\u0301 vs \u00e9, A\u030a vs \u00c5, Hangul \u1100\u1161\u11a8 vs \uac01, ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３")
add("arabic_hebrew_thai", "مرحبا بالعالم שלום עולם สวัสดีชาวโลก Привет, мир! Γειά σου κόσμε")
add("whitespace_mix", "a  b   c\t\td \t e\u00a0f\u3000g\u2003h    \n\n\n   i  \n")
add("tabs", "\tindented\n\t\tdouble\n\t \t mixed\t\n")
add("crlf", "line one\r\nline two\r\n\r\nline four\rold mac\n\r\n")
add("leading_trailing_spaces", "   leading and trailing   ")
add("only_newlines", "\n\n\n\n")
add("only_spaces", "                                ")
add("digits", "0 12 345 6789 1234567890 3.14159265358979 1,000,000 2024-01-31 0x1F 1e10 ٠١٢٣ ٤٥")
add("long_digits", "12345678901234567890123456789012345678901234567890123456789012345678901234567890")
add("punctuation", "!!! ??? ... --- ''' \"\"\" ((( ))) [[[ ]]] {{{ }}} ;;; ::: ,,, ~~~ @@@ ### $$$ %%% ^^^ &&& ***")
add("unicode_punct", "«Bonjour» „Hallo“ “quotes” ‘single’ — en–dash … ¿Qué? ¡Sí! 、。「」『』【】")
add("special_llama3", "<|begin_of_text|>Hello<|end_of_text|> and <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>")
add("special_qwen", "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n<think>x</think> <tool_call>{}</tool_call><|endoftext|>")
add("special_llama2", "<s>[INST] Hello </s> <s>again</s><unk>")
add("special_deepseek", "<｜begin▁of▁sentence｜>You<｜User｜>hi<｜Assistant｜>ok<｜end▁of▁sentence｜> <|EOT|> <｜fim▁begin｜>a<｜fim▁hole｜>b<｜fim▁end｜>")
add("special_adjacent", "<|im_start|><|im_start|> <s><s> </s></s><|eot_id|><|eot_id|>")
add("special_partial", "<|im_start <|im_end| <| |> <s <unk <|begin_of_text| <｜User")
add("control_chars", "a\u0000b\u0001c\u001fd\u007fe\u200bf\u200dg\ufeffh")
add("byte_fallback_rare", "\u0f3a\u0f3b \u2ff0 \U0001F9FF \U000E0041 \uE000 \U0010FFFD")
add("url_email", "https://example.com/path?q=1&r=a%20b#frag mailto:someone@example.org www.test.co.uk/~user")
add("markdown", "# Title\n\n* item **bold** _it_ `code`\n\n```python\nprint('x')\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
add("repeated_chars", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" + "=" * 80 + "-" * 64)
add("long_word", "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism " * 3)
add("long_text", "The tokenizer must handle long inputs without trouble. 長い入力も問題ありません。 1234567 " , repeat=400)
add("long_code", "for (int i = 0; i < n; ++i) {\n    sum += data[i] * weights[i % 16];\n}\n", repeat=300)
add("long_spaces", " " * 5000 + "x" + "\n" * 300 + "\t" * 200)
add("long_no_space", "abcdefghij" * 1000)
cases.append({"name": "invalid_utf8_mixed", "hex": (b"valid \xff\xfe bytes \xc3\x28 and \xe2\x82 cut \xf0\x9f\x98 end \xed\xa0\x80 surrogate \xc0\xaf overlong").hex()})
cases.append({"name": "invalid_utf8_only", "hex": b"\x80\x81\x82\xbf\xc2".hex()})

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "corpus.json"), "w", encoding="utf-8") as f:
    json.dump({"cases": cases}, f, ensure_ascii=False, indent=1)
    f.write("\n")
print(len(cases), "cases")
