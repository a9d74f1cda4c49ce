"""Builds (once, cached) a 2-layer, 128-wide random-weight Qwen2 model whose tokenizer round-trips."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Bump when the recipe changes so every cache rebuilds instead of serving a stale model.
RECIPE = "qwen2-tiny-v2"
VOCAB = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2's own pre-tokenizer split: transformers 5 rebuilds a Qwen2 tokenizer from vocab + merges
# with exactly this, so a tokenizer of any other kind (a WordLevel one, say) silently encodes
# every prompt to nothing. A byte-level BPE trained here survives that rebuild and round-trips.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CORPUS = [
    "the valve on line three was inspected and found within limits. ",
    "Inspection ticket: the pump vibrates above its limit. Summarise the ticket and thank the customer.",
    "Write one short sentence that approves a purchase request for two spare valves, within budget.",
    "user assistant system hello world ready ping test model request response token",
]


def cache_dir() -> Path:
    """`${FLASHMODEL_CACHE:-~/.cache/flashmodel}`: shared by tests, e2e and benchmarks."""
    return Path(os.environ.get("FLASHMODEL_CACHE", Path.home() / ".cache" / "flashmodel"))


def _write(out: Path) -> None:
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # All 256 byte symbols are in the alphabet, so every text encodes and decodes back.
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(str(out))
    # head size 128/4 = 32: the smallest vLLM's CPU attention accepts (and a multiple of 16 for t4).
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=SPECIALS.index("<|endoftext|>"),
        eos_token_id=SPECIALS.index("<|im_end|>"),
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.float16)  # type: ignore[no-untyped-call,arg-type]
    model.save_pretrained(str(out))


def build_tiny_model(root: Path | None = None) -> Path:
    """Return the directory of the tiny model, building it the first time (atomically)."""
    base = (root or cache_dir()) / "models"
    out = base / RECIPE
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{RECIPE}-", dir=base))
    try:
        _write(tmp)
        # save_pretrained leaves some files 0600; the engine may run as another uid.
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        try:
            tmp.rename(out)
        except OSError:
            # Another process built it first; theirs is as good as ours.
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(build_tiny_model())
