#!/usr/bin/python3
"""Writes tests/fixtures/bpe/{vocab.json, merges.txt, expected.json}: a small GPT-2-format byte-level BPE
and the ids GPT-2's encoder gives for a set of test strings, for tests/test_bpe.cpp.

    apt-get install -y python3-regex            # the `regex` module, as GPT-2's encoder.py uses
    /usr/bin/python3 tools/make_bpe_fixture.py  # rewrites the three files; the output is deterministic

There is no real GPT-2 vocabulary on the build machines, so this script trains one of NUM_MERGES merges
on tests/fixtures/bpe/sample.txt (English with contractions, digits, punctuation, runs of spaces, tabs and
newlines, accented Latin, Greek, Cyrillic, CJK, Hangul, emoji) and writes it exactly as the Hugging Face
GPT-2 files are laid out:

    vocab.json   {"token": id, ...}: the 256 byte symbols of bytes_to_unicode() as ids 0..255 in GPT-2's
                 order ("!" = 0, ..., "Ā" = byte 0 = 188, "Ġ" = the space = 220), then one id per merge
                 result in merge order, then "<|endoftext|>" last.
    merges.txt   "#version: 0.2", then one "a b" line per merge, rank = line order.

Training (the usual byte-level BPE trainer): split the sample with GPT-2's pattern, count the words, and
repeatedly merge the most frequent adjacent pair of symbols (ties: the smallest pair as strings).

expected.json holds, for every test string (the list below, the whole sample, and a few random strings
over an alphabet of every character class), the pre-tokens and ids of an independent reference encoder
written here after OpenAI's encoder.py (the regex pattern, bytes_to_unicode, the lowest-rank-first merge
loop), so the C++ test needs no Python. Every code point of a test string is checked to be classified
the same by the regex module and by unicodedata (which tools/gen_unicode_tables.py used): their Unicode
versions differ for a few thousand recently added characters, which the test strings must avoid.
"""
import json
import os
import random
import sys
import unicodedata

import regex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "bpe")
NUM_MERGES = 300
PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
EOD = "<|endoftext|>"

TEST_STRINGS = [
    "",
    " ",
    "   ",
    "\n",
    "  hello",
    "hello   ",
    "hello \n",
    "Hello world's  2024!!",
    "don't",
    "I'm",
    "'S",
    "He'll've done it, they'd say; we're sure you'RE 'VE",
    " 's and 'sa and !!'s",
    "2024",
    "In 2024, 3.14159 and 1,000,000 people paid $19.99 each.",
    "12345678901234567890",
    "The quick brown fox jumps over the lazy dog.",
    "A sentence that never appeared in the training text: zebras quizzically vex jovial kings.",
    "tab\tseparated\t\tvalues\n\nnew  \n lines \r\n",
    "x  \ty",
    "   \n  x",
    "\u00a0nbsp\u3000ideographic\u2028line\u2029para",
    "\x1cfile\x1dsep\x0bvt\x0cff\x85nel",
    "Français : le café est très bon. Ça coûte cher, n'est-ce pas ?",
    "Ünïcödé façade naïve — café, Straße, größer",
    "e\u0301 vs \u00e9 (combining acute)",
    "Γειά σου Κόσμε",
    "Привет, мир!",
    "日本語のテキスト、漢字。東京は日本の首都です。",
    "你好，世界！",
    "안녕하세요 세계",
    "नमस्ते दुनिया",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 heart ❤️",
    "٣٤٥ ½ Ⅻ ²³ numbers",
    "mixed123abc!?ok_snake-case café2024日本",
    "https://example.org/path?query=1&other=two#frag",
    "<|endoftext|>",
]

# Characters for the random strings: every class of the pattern, the contraction letters, and the
# whitespace the two whitespace alternatives treat differently.
RANDOM_ALPHABET = list(" \t\n\r'srtvelmdSA12!.,-") + ["\u00a0", "\u3000", "\u0085", "\x1c", "\x0b", "é", "ß", "Ω",
                                                   "日", "한", "😀", "\u0301", "٣", "½", "\u2028"]
NUM_RANDOM_STRINGS, RANDOM_LENGTH = 4, 300


def bytes_to_unicode():
    """OpenAI's table: every byte to a printable code point; returns (byte -> char, the bytes in id order)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs])), bs


BYTE_ENCODER, BYTE_ORDER = bytes_to_unicode()


def to_symbols(text):
    return "".join(BYTE_ENCODER[b] for b in text.encode("utf-8"))


def merge_pair(word, first, second):
    out, i = [], 0
    while i < len(word):
        if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
            out.append(first + second)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def train(text):
    counts = {}
    for piece in PATTERN.findall(text):
        word = tuple(to_symbols(piece))
        counts[word] = counts.get(word, 0) + 1
    merges = []
    while len(merges) < NUM_MERGES:
        pairs = {}
        for word, count in counts.items():
            for pair in zip(word, word[1:]):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        new_counts = {}
        for word, count in counts.items():
            merged = merge_pair(word, *best)
            new_counts[merged] = new_counts.get(merged, 0) + count
        counts = new_counts
    return merges


class ReferenceEncoder:
    """OpenAI's encoder.py (gpt-2/src/encoder.py), restated."""

    def __init__(self, vocab, merges):
        self.encoder = vocab
        self.ranks = dict(zip(merges, range(len(merges))))

    def bpe(self, token):
        word = tuple(token)
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            bigram = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if bigram not in self.ranks:
                break
            word = merge_pair(word, *bigram)
        return word

    def pretokenize(self, text):
        return PATTERN.findall(text)

    def encode(self, text):
        ids = []
        for piece in self.pretokenize(text):
            ids.extend(self.encoder[s] for s in self.bpe(to_symbols(piece)))
        return ids


def char_class_unicodedata(c):
    category = unicodedata.category(c)
    if category[0] in "LN":
        return category[0]
    if category in ("Zs", "Zl", "Zp") or ord(c) in (0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x85):
        return "S"
    return "O"


def char_class_regex(c):
    for name, pattern in (("L", r"\p{L}"), ("N", r"\p{N}"), ("S", r"\s")):
        if regex.match(pattern, c):
            return name
    return "O"


def main():
    with open(os.path.join(FIXTURES, "sample.txt"), encoding="utf-8", newline="") as f:
        sample = f.read()
    merges = train(sample)

    vocab = {}
    for b in BYTE_ORDER:
        vocab[BYTE_ENCODER[b]] = len(vocab)
    for first, second in merges:
        vocab.setdefault(first + second, len(vocab))
    vocab[EOD] = len(vocab)

    with open(os.path.join(FIXTURES, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False, separators=(",", ":"))
    with open(os.path.join(FIXTURES, "merges.txt"), "w", encoding="utf-8", newline="\n") as f:
        f.write("#version: 0.2\n")
        for first, second in merges:
            f.write(f"{first} {second}\n")

    reference = ReferenceEncoder(vocab, merges)
    rng = random.Random(1234)
    strings = TEST_STRINGS + [sample] + ["".join(rng.choice(RANDOM_ALPHABET) for _ in range(RANDOM_LENGTH))
                                         for _ in range(NUM_RANDOM_STRINGS)]
    cases = []
    for text in strings:
        for c in text:
            if char_class_regex(c) != char_class_unicodedata(c):
                sys.exit(f"test string {text!r}: {c!r} is classified differently by regex and unicodedata")
        pieces = reference.pretokenize(text)
        assert "".join(pieces) == text
        cases.append({"text": text, "pretokens": pieces, "ids": reference.encode(text)})
    header = {"generated_by": "tools/make_bpe_fixture.py", "vocab_size": len(vocab), "num_merges": len(merges),
              "eod": vocab[EOD]}
    with open(os.path.join(FIXTURES, "expected.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(header)[:-1] + ', "cases": [\n')
        f.write(",\n".join(json.dumps(case, ensure_ascii=True) for case in cases))
        f.write("\n]}\n")
    print(f"{len(merges)} merges, vocabulary {len(vocab)}, {len(cases)} test strings", file=sys.stderr)


if __name__ == "__main__":
    main()
