#!/usr/bin/env python3
"""Builds the small tokenizer files in this folder and records Hugging Face reference ids for them.

Run from the repository root:

    python3 tests/golden/tokenizers/make_tokenizer_reference.py

Needs the `tokenizers`, `transformers` and `sentencepiece` Python packages (the versions used are written
into every reference file). The output is deterministic; rerunning it rewrites the same files.

What it writes (each file is small and committed):

  bytelevel_gpt2/      GPT-2 layout: ByteLevel pre-tokenizer with its built-in regex, no BOS; added
                       tokens with normalized / lstrip / rstrip / single_word set.
  bytelevel_llama3/    Llama-3 layout: Split(Llama-3 regex, Isolated) + ByteLevel(use_regex=false),
                       ignore_merges, post-processor Sequence[ByteLevel, Template(<|begin_of_text|> $A)].
  bytelevel_qwen2/     Qwen2 layout: NFC normalizer, Split(Qwen2 regex) + ByteLevel, no BOS, chat template.
  spm_llama2/          A SentencePiece BPE tokenizer.model trained like Llama-2's (byte fallback, identity
                       normalization, extra whitespace kept, split digits, two user-defined symbols).
  spm_charsmap/        A SentencePiece BPE tokenizer.model with a small custom normalization rule set
                       (precompiled_charsmap) and SentencePiece's default whitespace handling.
  metaspace_bytefallback/
                       The same vocabulary as spm_llama2 as a tokenizer.json in the layout of Mistral v0.3
                       / non-legacy Llama-2 (Metaspace pre-tokenizer with prepend_scheme "first", BPE with
                       byte_fallback, decoder Replace/ByteFallback/Fuse/Strip, post-processor <s> $A).
  <dir>/reference.json for each folder above, plus
  stories260K_hf_reference.json and stories260K_spm_reference.json for ../shared/models/stories260K
  (its tokenizer.json and its tokenizer.model; the model files themselves are never copied here).

Each reference.json holds "cases" (one per test string: ids with and without special tokens, and the
decodes of those ids) and "decode_cases" (40 random id sequences, stray byte tokens and special tokens
included, with their decodes).

Reference semantics:
  * tokenizer.json folders: transformers.AutoTokenizer (all folders here use tokenizer_class
    PreTrainedTokenizerFast, which runs tokenizer.json as written); the script checks that the
    `tokenizers` library gives the same ids. `ids` = tokenizer(text)["input_ids"] (add_special_tokens
    default), `ids_no_special` = add_special_tokens=False, `decoded` / `decoded_skip_special` =
    tokenizer.decode(ids, skip_special_tokens=False / True).
  * stories260K tokenizer.json: its tokenizer_config says LlamaTokenizer, which transformers 5 rebuilds
    with its own pre-tokenizer (Metaspace "always") instead of the file's legacy Prepend normalizer, so
    transformers 4, TGI and the `tokenizers` library disagree with transformers 5 on leading spaces. The
    reference is the `tokenizers` library running the file; where transformers 5 differs, its ids are
    recorded as `transformers_ids`. (With a tokenizer.json, transformers 5 ignores tokenizer_config's
    add_bos_token/add_eos_token and uses the file's post-processor, as the library does.)
  * tokenizer.model files: sentencepiece.SentencePieceProcessor. `ids` = [bos] + encode(text) when
    tokenizer_config's add_bos_token is true (the default for Llama), `ids_no_special` = encode(text),
    both decodes = decode(ids) (SentencePiece never prints control pieces).
"""

import io
import json
import os
import random
import sys

import sentencepiece as spm
import tokenizers
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
STORIES = os.path.join(os.path.dirname(REPO), "shared", "models", "stories260K")

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Training text: a few paragraphs with the scripts the test strings use, so the vocabularies have
# multi-byte merges as well as byte fallbacks.
TRAIN_TEXT = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
    "One day, she saw a big red ball under a tree. She wanted to play with it, but it was too high.",
    "Lily asked her mom for help. Her mom smiled and said, \"Let's get it together!\" They were happy.",
    "The quick brown fox jumps over the lazy dog. The dog didn't mind; it was sleeping in the sun.",
    "I'm sure you'll see that they've gone home. We'd like it if you're there, and he'll be too.",
    "It's 2024 and the year has 365 days, 12 months and 52 weeks. Call 555-0123 before 10:30 am.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 12345 3.14159 2,718 1e10 42% $19.99.",
    "def square(x):\n    return x * x  # the square\n\nfor i in range(10):\n    print(i, square(i))\n",
    "if (a && b) { c[i] = d->e; } else { return -1; } // comment /* block */",
    "Le café est très bon. Nous sommes allés à la plage, et c'était génial ! Où est la gare ?",
    "Die Größe der Straße überrascht mich. Schöne Grüße aus München, sagt Jürgen.",
    "El niño comió piña en la montaña. ¿Dónde está la estación? ¡Qué día más bonito!",
    "São Paulo é uma cidade enorme. Ærøskøbing ligger på Ærø. naïve façade coöperate.",
    "你好，世界。今天天气很好，我们去公园散步吧。中文文本测试。",
    "日本語のテキストです。東京は大きな都市です。ありがとうございます。",
    "한국어 텍스트입니다. 감사합니다. 서울은 큰 도시입니다.",
    "Emoji: 😀 😃 😄 😁 ❤️ 🦀 🚀 👍 🎉 and the family 👨‍👩‍👧‍👦 is here.",
    "Привет, мир! Как дела? Это тестовый текст на русском языке.",
    "Γειά σου κόσμε! Αυτό είναι ένα κείμενο δοκιμής.",
    "مرحبا بالعالم. هذا نص تجريبي باللغة العربية.",
    "Tabs\tand\tnewlines\nare\nwhitespace.   Multiple   spaces   too.\n\n\nParagraph.",
    "Visit https://example.com/path?q=1&r=2 or email someone@example.org for more information.",
    "She said: \"Wow!!!\" and he replied... \"Really???\" -- yes --- really *** really.",
    "Tom and Ben went to the shop to buy some milk and bread. They had fun on the way home.",
    "The sun was shining and the birds were singing. Everyone was happy and they all played.",
]

# The strings whose ids are recorded. Every tokenizer gets all of them; special-token spellings that a
# tokenizer does not have are ordinary text for it.
TEST_STRINGS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    "Once upon a time, there was a little girl named Lily.",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "a  b   c    d     e",
    "     ",
    " ",
    "\n",
    "\tTabbed\tline\t",
    "line1\nline2\r\nline3\n\n\nend\n",
    "mixed \t \n whitespace \n\t ",
    "12345678901234567890",
    "3.14159 and 2,718 and 1e10 and 007",
    "Year 2024: 365 days, 12 months.",
    "café naïve façade Ærøskøbing São Paulo",
    "Größenwahn über die Straße",
    "cafe\u0301 vs caf\u00e9 (decomposed vs composed)",
    "你好，世界",
    "日本語のテキストです。",
    "한국어 텍스트",
    "I \u2764\ufe0f \U0001F980 and \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466!",
    "\U0001F600\U0001F603\U0001F604",
    "rare: \U0001F9FF \U00010348 \u0950 \U0010FFFD",
    "I'm sure you'll see they've gone, isn't it? IT'S HE'LL WE'D",
    "def f(x):\n    return x**2  # square\n",
    "!!! ??? ... --- *** ###",
    "https://example.com/path?q=1&r=2",
    "a\u00a0b\u3000c\u2028d\u0085e\u180ef\u200bg",
    "x \u180e y\u180e\u180e  z \u180e\n\u180e a  \u180eb",
    "a\u2581b \u2581\u2581 \u2581",
    "control \x01\x02\x7f chars",
    "\ufeffBOM at start",
    "Привет, мир! Γειά σου κόσμε! مرحبا",
    "<s>",
    "<s>Hello</s>",
    "Hello <s> world </s> again",
    "<unk> is unknown",
    "<|begin_of_text|>Hi there<|eot_id|>",
    "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "a <mask> b  <mask>c",
    "x<sep>   y <sep>z",
    "zzz azzzb zzz! (zzz) \u00b2zzz e\u0301zzz zzz_ zzz\u200d",
    "[INST] Hello [/INST] Hi",
    "<|begin_of_text|><|begin_of_text|>",
    "\uff21\uff22 \ufb01ne \u216b\tAB\u3000end  AB\uff21",
    "  irregular   spacing,\ttabs\tand\nnewlines  in a   longer line of text that goes on " * 3,
    ("Tom and Ben went to the shop. They bought milk, bread and 3 apples; it cost $4.50! "
     "\"Let's go home,\" said Tom. On the way, they saw a dog named Max who wagged his tail. "
     "Ben laughed: \"Max wants an apple!\" Le café était fermé, so they walked on. 你好! \U0001F600 "
     "The end.\n\nThe next day, Lily found a shiny key under the big old tree near the river. "
     "She wondered what it opened. Maybe a treasure box? Maybe a secret door? She ran home to show "
     "her mom, who smiled and said, \"Let's find out together.\" They searched the whole house "
     "until they found a small wooden box in the attic. Inside was a letter from grandma."),
]


def versions():
    return {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__,
            "sentencepiece": spm.__version__}


def write_json(path, obj, indent=1):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=indent)
        f.write("\n")


def save_tokenizer_dir(name, tok_json, config):
    out = os.path.join(HERE, name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(tok_json, ensure_ascii=False, separators=(",", ":")))
        f.write("\n")
    write_json(os.path.join(out, "tokenizer_config.json"), config, indent=2)
    return out


def train_bytelevel(pre_tokenizer, normalizer, vocab_size):
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAIN_TEXT * 3, trainer)
    return tok


def template_processor(bos, bos_id):
    return processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                         special_tokens=[(bos, bos_id)])


def build_gpt2():
    tok = train_bytelevel(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), None, 700)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken("<|endoftext|>", normalized=True, special=True)])
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, normalized=False, special=True)])
    tok.add_special_tokens([AddedToken("<sep>", rstrip=True, normalized=False, special=True)])
    tok.add_tokens([AddedToken("zzz", single_word=True, normalized=False, special=False)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
              "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "model_max_length": 1024,
              "clean_up_tokenization_spaces": False}
    return save_tokenizer_dir("bytelevel_gpt2", json.loads(tok.to_str()), config)


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>"]
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def build_llama3():
    split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False)
    tok = train_bytelevel(pre_tokenizers.Sequence([
        split, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]), None, 1000)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in LLAMA3_SPECIALS])
    bos_id = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                              template_processor("<|begin_of_text|>", bos_id)])
    doc = json.loads(tok.to_str())
    doc["model"]["ignore_merges"] = True
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True, "model_max_length": 8192,
              "chat_template": LLAMA3_CHAT_TEMPLATE}
    return save_tokenizer_dir("bytelevel_llama3", doc, config)


QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def build_qwen2():
    split = pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False)
    tok = train_bytelevel(pre_tokenizers.Sequence([
        split, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]),
        normalizers.NFC(), 900)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False, "model_max_length": 32768,
              "chat_template": [{"name": "default", "template": QWEN2_CHAT_TEMPLATE},
                                {"name": "tool_use", "template": "{{ 'tools' }}"}]}
    return save_tokenizer_dir("bytelevel_qwen2", json.loads(tok.to_str()), config)


def build_spm_llama2():
    out = os.path.join(HERE, "spm_llama2")
    os.makedirs(out, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN_TEXT * 3), model_writer=model, model_type="bpe", vocab_size=800,
        character_coverage=0.98, byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        user_defined_symbols=["[INST]", "[/INST]"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, minloglevel=2, max_sentence_length=100000)
    with open(os.path.join(out, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False,
              "chat_template": "{% for m in messages %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
                               "{% endfor %}"}
    write_json(os.path.join(out, "tokenizer_config.json"), config, indent=2)
    return out


# A custom normalization rule set (source code points, tab, target code points), compiled by the
# trainer into a small precompiled_charsmap: exercises the double-array trie that real models with
# nmt_nfkc normalization use (whose charsmap alone is ~240 KB).
CHARSMAP_RULES = """FF21\t41
FF22\t42
FB01\t66 69
216B\t58 49 49
3000\t20
9\t20
41 42\t43
"""


def build_spm_charsmap():
    out = os.path.join(HERE, "spm_charsmap")
    os.makedirs(out, exist_ok=True)
    rules = os.path.join(out, "rules.tsv")
    with open(rules, "w", encoding="utf-8") as f:
        f.write(CHARSMAP_RULES)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(TRAIN_TEXT * 3), model_writer=model, model_type="bpe", vocab_size=500,
            character_coverage=0.98, byte_fallback=True, normalization_rule_tsv=rules,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    finally:
        os.remove(rules)
    with open(os.path.join(out, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())
    write_json(os.path.join(out, "tokenizer_config.json"), {"add_bos_token": True, "bos_token": "<s>",
                                                            "eos_token": "</s>"}, indent=2)
    return out


def build_metaspace(spm_dir):
    """tokenizer.json for the spm_llama2 vocabulary, the way transformers converts a Llama/Mistral
    tokenizer.model (LlamaConverter) with legacy=False."""
    from transformers.tokenization_utils_base import generate_merges
    sp = spm.SentencePieceProcessor(model_file=os.path.join(spm_dir, "tokenizer.model"))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())}
    merges = generate_merges(vocab, scores)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ["<unk>", "<s>", "</s>"]])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ["[INST]", "[/INST]"]])
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    tok.post_processor = template_processor("<s>", 1)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "clean_up_tokenization_spaces": False}
    return save_tokenizer_dir("metaspace_bytefallback", json.loads(tok.to_str()), config)


def random_id_sequences(vocab_size, count=40, seed=1234):
    """Id sequences a model might emit (any id, stray byte tokens, special tokens anywhere): their
    decodes pin the decoder's rules beyond what encoded text exercises."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(count)]


def hf_decode_cases(decode, vocab_size):
    return [{"ids": ids, "decoded": decode(ids, False), "decoded_skip_special": decode(ids, True)}
            for ids in random_id_sequences(vocab_size)]


def hf_cases(tok_dir):
    auto = transformers.AutoTokenizer.from_pretrained(tok_dir)
    raw = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    cases = []
    for text in TEST_STRINGS:
        ids = auto(text)["input_ids"]
        ids_plain = auto(text, add_special_tokens=False)["input_ids"]
        if raw.encode(text, add_special_tokens=True).ids != ids or raw.encode(text, add_special_tokens=False).ids != ids_plain:
            sys.exit(f"{tok_dir}: transformers and tokenizers disagree on {text!r}")
        cases.append({"text": text, "ids": ids, "ids_no_special": ids_plain,
                      "decoded": auto.decode(ids, skip_special_tokens=False),
                      "decoded_skip_special": auto.decode(ids, skip_special_tokens=True)})
    decode = lambda ids, skip: auto.decode(ids, skip_special_tokens=skip)
    return {"kind": "tokenizer.json", "library": versions(), "cases": cases,
            "decode_cases": hf_decode_cases(decode, raw.get_vocab_size(with_added_tokens=True))}


def stories_hf_cases():
    path = os.path.join(STORIES, "tokenizer.json")
    raw = Tokenizer.from_file(path)
    auto = transformers.AutoTokenizer.from_pretrained(STORIES)
    cases = []
    for text in TEST_STRINGS:
        ids = raw.encode(text, add_special_tokens=True).ids
        case = {"text": text, "ids": ids, "ids_no_special": raw.encode(text, add_special_tokens=False).ids,
                "decoded": raw.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": raw.decode(ids, skip_special_tokens=True)}
        t5 = auto(text)["input_ids"]
        if t5 != ids:
            case["transformers_ids"] = t5
        cases.append(case)
    decode = lambda ids, skip: raw.decode(ids, skip_special_tokens=skip)
    return {"kind": "tokenizer.json", "source": "../shared/models/stories260K/tokenizer.json",
            "library": versions(), "cases": cases,
            "decode_cases": hf_decode_cases(decode, raw.get_vocab_size(with_added_tokens=True))}


def spm_cases(model_path, add_bos):
    sp = spm.SentencePieceProcessor(model_file=model_path)
    cases = []
    for text in TEST_STRINGS:
        plain = sp.encode(text)
        ids = ([sp.bos_id()] if add_bos else []) + plain
        cases.append({"text": text, "ids": ids, "ids_no_special": plain, "decoded": sp.decode(ids),
                      "decoded_skip_special": sp.decode(ids)})
    decode_cases = [{"ids": ids, "decoded": sp.decode(ids), "decoded_skip_special": sp.decode(ids)}
                    for ids in random_id_sequences(sp.get_piece_size())]
    return {"kind": "tokenizer.model", "library": versions(), "cases": cases, "decode_cases": decode_cases}


def main():
    for build in (build_gpt2, build_llama3, build_qwen2):
        d = build()
        write_json(os.path.join(d, "reference.json"), hf_cases(d))
    spm_dir = build_spm_llama2()
    write_json(os.path.join(spm_dir, "reference.json"), spm_cases(os.path.join(spm_dir, "tokenizer.model"), True))
    charsmap_dir = build_spm_charsmap()
    write_json(os.path.join(charsmap_dir, "reference.json"),
               spm_cases(os.path.join(charsmap_dir, "tokenizer.model"), True))
    d = build_metaspace(spm_dir)
    write_json(os.path.join(d, "reference.json"), hf_cases(d))
    if os.path.isdir(STORIES):
        write_json(os.path.join(HERE, "stories260K_hf_reference.json"), stories_hf_cases())
        ref = spm_cases(os.path.join(STORIES, "tokenizer.model"), True)
        ref["source"] = "../shared/models/stories260K/tokenizer.model"
        write_json(os.path.join(HERE, "stories260K_spm_reference.json"), ref)
    else:
        print(f"{STORIES} not found; stories260K references not written", file=sys.stderr)


if __name__ == "__main__":
    main()
