"""Prints the held-out (test) files of models/tiny-coder's corpus, one path per line, for
`tpserve perplexity --files-from`: the split rule and exclusions of tools/train_tiny_coder.py
applied to a Python standard library tree (default /usr/lib/python3.11, Debian 12's, the tree
the model was trained on). Standard library only.

  /usr/bin/python3 tools/tiny_coder_heldout.py [SRC] > heldout.txt

--copy-to DIR writes the files as the corpus held them (CRLF made LF) under DIR and lists the
copies: the set to carry to another machine (e.g. the GPU machine, whose Python is another).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_tiny_coder import collect, split_of  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src", nargs="?", default="/usr/lib/python3.11")
    # The training machine had no python3-tk: tkinter/ was not in the corpus (README-tiny-coder.md
    # lists the 26 test files). Pass --exclude '' to keep it.
    ap.add_argument("--exclude", default="tkinter/",
                    help="leave out test files whose relative path starts with this")
    ap.add_argument("--copy-to", help="write the test files (LF line ends) under this folder and "
                    "list those copies instead")
    args = ap.parse_args()
    docs, _ = collect(args.src)
    for d in docs:
        if split_of(d["path"]) != "test":
            continue
        if args.exclude and d["path"].startswith(args.exclude):
            continue
        path = os.path.join(args.src, d["path"])
        if args.copy_to:
            path = os.path.join(args.copy_to, d["path"])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8", newline="\n") as f:
                f.write(d["text"])
        print(path)


if __name__ == "__main__":
    main()
