"""Writes tests/golden/tokenizers/: small tokenizers in the real families' formats and the ids the reference
libraries give for a set of hard texts, so tessera's tokenizers (src/train/data/bpe_tokenizer.cpp,
tiktoken_tokenizer.cpp) are checked against implementations they share no code with.

Each <name>/ directory is what a Hugging Face checkpoint directory holds for its tokenizer:

  qwen2/        tokenizer.json: byte-level BPE trained here with the `tokenizers` library on data/corpus (+ the
                multilingual lines below), with Qwen2/Qwen3's normalizer (NFC) and pre_tokenizer (Split with Qwen's
                regex, Isolated + ByteLevel without its regex), Qwen's special tokens; merges in the [a, b] form.
  deepseek_v3/  DeepSeek-V3's normalizer (an empty Sequence) and pre_tokenizer (three Isolated Splits: digit runs,
                a CJK range, the main pattern; then ByteLevel), its special tokens, add_bos_token; merges written in
                the older "a b" string form (as DeepSeek-V3's own file has them).
  gpt2/         ByteLevel(use_regex=True) alone: GPT-2's built-in regex.
  digits/       Digits(individual_digits=True), then Qwen's Split, then ByteLevel.
  kimi/         tiktoken.model (lines "base64(bytes) rank") whose ranks come from the qwen2 BPE's vocabulary, and a
                tokenizer_config.json with added_tokens_decoder; encoded by the `tiktoken` library with the pattern of
                Kimi's tokenization_kimi.py (pat_str) and special tokens built as that file builds them (every id from
                len(ranks) to len(ranks) + 257, named from added_tokens_decoder or <|reserved_token_{id}|>).

and expected.json: {"texts": [...], "ids": [[...], ...], "decoded": [...]} from the library (HF: encode with
add_special_tokens=False; tiktoken: encode(allowed_special="all")).

Run: pip install tokenizers tiktoken; python3 tools/ref/make_tokenizer_golden.py
Sources: https://huggingface.co/docs/tokenizers (pre-tokenizers, models, added tokens), https://github.com/openai/tiktoken,
Kimi-K2's tokenization_kimi.py (moonshotai on the Hugging Face hub), DeepSeek-V3's and Qwen2's tokenizer.json.
"""
import base64
import json
import os
import sys

import tiktoken
import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(ROOT, "tests", "golden", "tokenizers")
VOCAB = 1500  # 256 bytes + ~1240 merges + specials: files of ~40-60 KB

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK_SPLITS = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Training text beyond the English corpus, so some merges span multi-byte characters.
MULTILINGUAL = [
    "中文English混合，这是一个测试。我们的模型在训练数据上学习。北京市 上海市 中华人民共和国",
    "日本語のテキストです。カタカナとひらがな。東京 大阪",
    "한국어 텍스트입니다. 안녕하세요",
    "Ça va? Où est la café? Voilà, déjà vu. naïve résumé Ångström Müller straße",
    "Привет, мир! Это тест. Ελληνικά κείμενα. مرحبا بالعالم नमस्ते दुनिया",
    "👍 😀 🎉 ❤️ 👨‍👩‍👧‍👦",
    "1234567890 3.14159 2024-06-01 100% $42.50",
    "mvs \u180e \u180e\u180e  end\u180e \u180e x\u180e y \u180ez",  # merges over U+180E, which is no White_Space
]

TEXTS = [
    "",
    "Hello world! It's a test; they're here, we've done it, I'm sure, you'll see, he'd go, don't.",
    "IT'S LOUD, WE'RE HERE, THEY'VE GONE; It'S mixed, it'ſ a long s, O'Neil's",
    "中文English混合 日本語のテキスト カタカナ ひらがな 한국어 北京市 Pascal 汉字abc 北京、上海。〆々",
    "café naïve résumé Ångström — Müller's straße; cafe\u0301 n\u0303o e\u0301\u0301 a\u0308",
    "नमस्ते दुनिया; مرحبا بالعالم; Привет, мир! Ελληνικά",
    "a  b   c\t\td\n\n\ne  \n  f   ",
    "   leading spaces and trailing   ",
    "\r\nwindows\r\nlines\r\n\r\n",
    "\t\ttabs\tand \t mixed \t\n",
    "          ",
    "\n",
    "1 12 123 1234 12345 123456 1234567890 3.14159 2024-06-01 0.5% $1,000,000",
    "Arabic-Indic ١٢٣٤ superscript x² fractions ½ ⅓ roman Ⅻ circled ① ②",
    # (no character new in Unicode 15, such as 🫨: Debian 12's PCRE2 10.42 has Unicode 14 tables, so DeepSeek's
    # [\p{P}\p{S}] does not take it; docs/train.md lists the difference)
    "👍 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇺🇸🇯🇵 🥹 ☕️",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>",
    "one<|endoftext|>two<|endoftext|><|endoftext|>three <|endoftext|> <|endoftext four",
    "<｜begin▁of▁sentence｜>DeepSeek<｜end▁of▁sentence｜>[BOS]Kimi[EOS]<|im_user|>x<|im_assistant|>",
    "def f(x):\n    return x**2  # square\n\nif __name__ == \"__main__\":\n\tprint(f(3))\n",
    "nbsp\u00a0here ideographic\u3000space mongolian\u180evowel line\u2028sep nel\u0085next zwsp\u200bx",
    "mvs \u180e \u180e\u180e  end\u180e \u180e x\u180e y \u180ez a \u180e  b",  # PCRE2's own \s takes U+180E
    "quotes “curly” ‘single’ «guillemets» … ellipsis –dash— ©®™ €£¥ §¶",
    "ALLCAPS CamelCaseWord snake_case_word kebab-case-word ÉCOLE ÀÉÎÕÜ",
    "<think>\nreasoning</think> answer <think",
]


def corpus_text():
    path = os.path.join(ROOT, "data", "corpus", "devils_dictionary.txt")
    with open(path, encoding="utf-8") as f:
        return f.read()


def train_bpe(pre_tokenizer, normalizer, specials):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = corpus_text()
    lines = [text[i:i + 2000] for i in range(0, 200_000, 2000)] + MULTILINGUAL * 20
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def qwen_pre(extra=()):
    return pre_tokenizers.Sequence(list(extra) + [
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])


def save_hf(name, tok, config, string_merges=False):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "tokenizer.json")
    tok.save(path, pretty=False)
    if string_merges:  # the older "a b" form of the merges
        with open(path, encoding="utf-8") as f:
            j = json.load(f)
        j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]
        with open(path, "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False, separators=(",", ":"))
        tok = Tokenizer.from_file(path)  # the file as written is what the ids come from
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
    ids = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
    decoded = [tok.decode(i, skip_special_tokens=False) for i in ids]
    write_expected(d, ids, decoded, library=f"tokenizers {tokenizers.__version__}")
    return tok


def write_expected(d, ids, decoded, library):
    with open(os.path.join(d, "expected.json"), "w", encoding="utf-8") as f:
        json.dump({"script": "tools/ref/make_tokenizer_golden.py", "library": library, "texts": TEXTS, "ids": ids,
                   "decoded": decoded}, f, ensure_ascii=False, indent=0)
    print(f"wrote {os.path.relpath(d, ROOT)}: {len(TEXTS)} texts, {sum(map(len, ids))} ids")


def kimi(bpe):
    """A tiktoken rank file from a trained byte-level BPE: byte b has rank b, then each merge in order."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    vocab = bpe.get_vocab()
    ranks = {bytes([b]): b for b in range(256)}
    merges = json.loads(bpe.to_str())["model"]["merges"]
    for m in merges:
        a, b = m if isinstance(m, list) else m.split(" ")
        tb = bytes(byte_of[c] for c in a + b)
        if tb not in ranks:
            ranks[tb] = len(ranks)
    assert len(vocab) > len(ranks) - 256
    d = os.path.join(OUT, "kimi")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "tiktoken.model"), "w") as f:
        for tb, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tb).decode()} {r}\n")
    n = len(ranks)
    named = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|im_end|>", n + 3: "<|im_user|>", n + 4: "<|im_assistant|>",
             n + 6: "<|start_header_id|>", n + 7: "<|end_header_id|>", n + 10: "[EOT]", n + 11: "<|im_system|>",
             n + 12: "<|im_middle|>"}
    config = {"bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "TikTokenTokenizer",
              "added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                                "single_word": False, "special": True} for i, c in named.items()}}
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
    # as tokenization_kimi.py builds them: 256 reserved + 2 ids after the base vocabulary
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256 + 2)}
    enc = tiktoken.Encoding(name="kimi_tiny", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=specials)
    ids = [enc.encode(t, allowed_special="all") for t in TEXTS]
    decoded = [enc.decode(i) for i in ids]
    write_expected(d, ids, decoded, library=f"tiktoken {tiktoken.__version__}")


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def main():
    sys.stdout.reconfigure(encoding="utf-8")
    jargon = open(os.path.join(ROOT, "data", "corpus", "jargon_file_4.4.7.txt"), encoding="utf-8").read()
    TEXTS.append(jargon[100_000:104_000])  # a long stretch of ordinary text
    qwen_specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # as in Qwen's own file, the special tokens come after the vocabulary and are not in it; <think> is an added
    # token that is not special (Qwen3)
    qwen = train_bpe(qwen_pre(), normalizers.NFC(), [])
    qwen.add_special_tokens(qwen_specials)
    qwen.add_tokens([AddedToken("<think>", special=False, normalized=False),
                     AddedToken("</think>", special=False, normalized=False)])
    save_hf("qwen2", qwen, {"eos_token": "<|endoftext|>", "bos_token": None, "pad_token": "<|endoftext|>",
                            "add_bos_token": False, "tokenizer_class": "Qwen2Tokenizer"})

    ds_pre = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in DEEPSEEK_SPLITS] +
        [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    ds_specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
    ds = train_bpe(ds_pre, normalizers.Sequence([]), ds_specials)
    save_hf("deepseek_v3", ds, {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                                "add_bos_token": True, "add_eos_token": False, "tokenizer_class": "LlamaTokenizerFast"},
            string_merges=True)

    gpt2 = train_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), None, ["<|endoftext|>"])
    save_hf("gpt2", gpt2, {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "add_bos_token": False})

    digits = train_bpe(qwen_pre([pre_tokenizers.Digits(individual_digits=True)]), None, qwen_specials)
    save_hf("digits", digits, {"eos_token": "<|im_end|>", "bos_token": None})

    kimi(qwen)


if __name__ == "__main__":
    main()
