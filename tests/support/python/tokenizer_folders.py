"""Tokenizer folders as users bring them, trained here with `tokenizers` and saved by
transformers, and the ids AutoTokenizer gives for a set of texts: what Troupe's
tokenizer.json and tokenizer.model readers must reproduce id for id.

usage: python tokenizer_folders.py OUT [--vocab=N] KIND...
KIND: gpt2 (byte-level BPE, GPT-2's pre-tokenizer), llama3 (byte-level, Llama 3's split
regex, ignore_merges, a BOS template, many special tokens), qwen2 (NFC, Qwen2's regex, no
template), llama2 (SentencePiece-style BPE with byte fallback: Prepend/Replace normalizer,
BOS template), metaspace (the same with a Metaspace pre-tokenizer, LlamaTokenizer's
add_bos_token), spm (a SentencePiece tokenizer.model only, as Llama 2's slow files, with
a user-defined piece: transformers 5 converts it to a BPE; needs the sentencepiece module).
Writes OUT/KIND/ (the folder) and OUT/KIND.json: {"texts": [...], "ids": [[...]]} with
AutoTokenizer.from_pretrained(OUT/KIND)(text)["input_ids"] for each text. --vocab: the
byte-level and byte-fallback kinds' vocabulary size (default 700).
"""
import json
import os
import sys

import transformers

TEXTS = [
    "Hello, world! It's 2026; we've got 12345 items, they'll see. I'M SHOUTING'S",
    "  leading spaces and   runs     of spaces\n\n\nnewlines\ttabs\r\nwindows\r\n",
    "Unicode: naïve café, Straße, 東京タワー, Привет мир, مرحبا بالعالم, ελληνικά",
    "emoji 👩‍👩‍👧‍👦 family 🏳️‍🌈 flag 👍🏽 thumbs, ZWJ\u200dinside",
    "digits 3.14159 and 1,000,000 and ٣٤٥ and 0xDEADBEEF and 2026-12-02",
    "special tokens spelled inside: <|endoftext|> and <s> and </s> and <|begin_of_text|>x<|eot_id|> and <sep>x",
    "",
    "combining e\u0301 versus \u00e9 and A\u030a versus \u00c5 (NFC composes them)",
    " " * 40 + "x" + "\n" * 5 + " \n \n",
    "trailing whitespace   ",
    "tab\tand\u00a0no-break\u2003em space",
    "a" * 300,
]

SPECIALS = ["<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
         r"\s+(?!\S)|\s+")


def corpus():
    """The fortunes corpus's first 300 kB and the texts: what the tokenizers learn from."""
    folder = "/usr/share/games/fortunes"
    text = ""
    for n in sorted(os.listdir(folder)):
        p = os.path.join(folder, n)
        if "." not in n and os.path.isfile(p) and not os.path.islink(p):
            text += open(p, "rb").read().decode("utf-8", "replace")
        if len(text) > 300_000:
            break
    return text.split("\n") + TEXTS * 3


VOCAB = 700


def byte_level(kind):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(ignore_merges=(kind == "llama3")))
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        pattern = LLAMA3 if kind == "llama3" else QWEN2
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    specials = {"gpt2": ["<|endoftext|>"], "llama3": SPECIALS[1:4], "qwen2": ["<|endoftext|>", "<|im_start|>",
                                                                            "<|im_end|>"]}[kind]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    if kind == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B:1",
                                          special_tokens=[("<|begin_of_text|>", bos)])])
        eos, bos_name = "<|end_of_text|>", "<|begin_of_text|>"
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        eos, bos_name = "<|endoftext|>", None
    return tok, dict(eos_token=eos, bos_token=bos_name)


def byte_fallback(kind):
    """Llama 2's fast tokenizer: a BPE over characters, the rare ones as <0xNN> bytes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 256, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=90,
                                  show_progress=False)
    base.train_from_iterator(corpus(), trainer)
    data = json.loads(base.to_str())
    vocab = data["model"]["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in data["model"]["merges"]]
    for b in range(256):  # the byte pieces
        vocab.setdefault("<0x%02X>" % b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if kind == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ["<unk>", "<s>", "</s>"]])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", vocab["<s>"])])
    return tok, dict(eos_token="</s>", bos_token="<s>", unk_token="<unk>")


def sentencepiece_model(folder):
    import sentencepiece as spm
    os.makedirs(folder, exist_ok=True)
    lines = [s for s in corpus() if s]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=os.path.join(folder, "tokenizer"),
                                   model_type="bpe", vocab_size=600, byte_fallback=True, character_coverage=0.995,
                                   # Llama 2's: no normalization, the dummy prefix, digits split
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   add_dummy_prefix=True, split_digits=True, allow_whitespace_only_pieces=True,
                                   user_defined_symbols=["<sep>"], minloglevel=2)
    os.remove(os.path.join(folder, "tokenizer.vocab"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "legacy": False}, f)


def main():
    global VOCAB
    out, kinds = sys.argv[1], sys.argv[2:]
    if kinds and kinds[0].startswith("--vocab="):
        VOCAB = int(kinds.pop(0).split("=")[1])
    for kind in kinds:
        folder = os.path.join(out, kind)
        if kind == "spm":
            sentencepiece_model(folder)
        else:
            tok, names = byte_level(kind) if kind in ("gpt2", "llama3", "qwen2") else byte_fallback(kind)
            fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **{k: v for k, v in names.items() if v})
            fast.save_pretrained(folder)
            if kind == "metaspace":  # as Llama 2's newer folders: LlamaTokenizer's own BOS setting
                path = os.path.join(folder, "tokenizer_config.json")
                config = json.load(open(path))
                config.update(add_bos_token=True, add_eos_token=False)
                json.dump(config, open(path, "w"), indent=2)
        auto = transformers.AutoTokenizer.from_pretrained(folder)
        ids = [auto(t)["input_ids"] for t in TEXTS]
        result = {"texts": TEXTS, "ids": ids, "eos": auto.eos_token_id, "class": type(auto).__name__,
                  "transformers": transformers.__version__}
        with open(os.path.join(out, kind + ".json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    sys.exit(main())
