#!/usr/bin/env python3
"""Write a random-weight Qwen2-shaped model with a byte-level BPE tokenizer, for benchmarks and tests.

    python3 bench/slo/mkmodel.py OUTDIR SHAPE [OUTDIR SHAPE ...]   # SHAPE: tiny | 0.5b | 1.5b | 3b | 7b

The shapes are those of ../shared/gpu/mk.py (no weights can be downloaded here: the arithmetic
and memory traffic are the real model's, the text is noise). The tokenizer differs on purpose:
mk.py's (and tests/support's) WordLevel tokenizer is replaced by transformers 5 with its own
Qwen2Tokenizer, a BPE built from that vocabulary without merges, which encodes every prompt to
zero tokens ("The decoder prompt cannot be empty"). This one *is* a byte-level BPE like Qwen's:
the 256 byte symbols, then the words "a".."z", "aa".. with the merges that build each from its
prefix, then the three specials. So Qwen2Tokenizer loads it as written, every text round-trips
(text -> ids -> text), short lowercase words are one token each, and guided decoding has the
`{`, `"` and letters a JSON object needs. Builds on the GPU when there is one, else on the CPU.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab=512,
    ),
    "0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    ),
    "1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2
    ),
    "3b": dict(
        hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2
    ),
    "7b": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4
    ),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_symbols() -> list[str]:
    """GPT-2's byte -> printable-character table, in byte order (what ByteLevel uses)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = 0
    table = {}
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def word(i: int) -> str:
    """0 -> 'a', 25 -> 'z', 26 -> 'aa': letters only, so byte-level splitting keeps a word whole."""
    s, i = "", i + 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(97 + r) + s
    return s


def vocabulary(size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Bytes (ids 0..255), then space-prefixed words with their merges, then the specials last."""
    space = byte_symbols()[32]  # "\u0120"
    vocab = {sym: i for i, sym in enumerate(byte_symbols())}
    merges: list[tuple[str, str]] = []
    for i in range(size - 256 - len(SPECIALS)):
        w = space + word(i)
        # Every prefix of a word is an earlier word (all shorter words come first), so the merge
        # (prefix, last letter) always has both halves in the vocabulary.
        merges.append((w[:-1], w[-1]))
        vocab[w] = len(vocab)
    for s in SPECIALS:
        vocab[s] = len(vocab)
    return vocab, merges


def write_tokenizer(out: str, size: int) -> None:
    """The byte-level BPE tokenizer of a `size`-token vocabulary, with the chat template, into `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = vocabulary(size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # type: ignore[assignment,unused-ignore]
    tok.decoder = decoders.ByteLevel()  # type: ignore[assignment,unused-ignore]
    tok.add_special_tokens(SPECIALS)
    tokenizer_cls: Any = PreTrainedTokenizerFast  # untyped in transformers
    fast = tokenizer_cls(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out)
    # vocab.json + merges.txt too: a Qwen2Tokenizer that rebuilds itself from them gets the same BPE.
    with open(os.path.join(out, "vocab.json"), "w") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))


def vocab_size(shape: str) -> int:
    """Qwen2.5's 151936 tokens, except the tiny shape's own small vocabulary."""
    return SHAPES[shape].get("vocab", 151936)


def qwen2_config(shape: str) -> Any:
    """The transformers Qwen2Config of a shape (7b unties lm_head from the embeddings, as Qwen2.5-7B does)."""
    from transformers import Qwen2Config

    dims: dict[str, Any] = {k: v for k, v in SHAPES[shape].items() if k != "vocab"}
    size = vocab_size(shape)
    return Qwen2Config(
        vocab_size=size,
        max_position_embeddings=4096,
        tie_word_embeddings=shape != "7b",
        eos_token_id=size - 1,
        bos_token_id=size - 3,
        **dims,
    )


def make_readable(out: str) -> None:
    """save_pretrained leaves some files 0600; the engine may be another uid."""
    for name in os.listdir(out):
        os.chmod(os.path.join(out, name), 0o644)


def build(out: str, shape: str) -> str:
    import torch
    from transformers import Qwen2ForCausalLM

    model_cls: Any = Qwen2ForCausalLM  # untyped in transformers
    write_tokenizer(out, vocab_size(shape))
    cfg = qwen2_config(shape)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = model_cls(cfg).to(torch.float16)
    model.save_pretrained(out)
    make_readable(out)
    params = sum(p.numel() for p in model.parameters())
    return f"event=model_built shape={shape} params={params} path={out}"


if __name__ == "__main__":
    # Several models per call: importing torch and transformers takes 10-15 s of each build on the
    # GPU machine, and the device's time is the budget.
    args = sys.argv[1:]
    pairs = list(zip(args[::2], args[1::2], strict=True)) if args and len(args) % 2 == 0 else []
    if not pairs or any(shape not in SHAPES for _, shape in pairs):
        sys.exit(f"usage: mkmodel.py OUTDIR {{{'|'.join(SHAPES)}}} [OUTDIR SHAPE ...]")
    for out, shape in pairs:
        print(build(out, shape), flush=True)
