"""A tiny, deterministic Kimi-VL tokenizer for tests and for the demo's built-in tiny checkpoint.

Laid out like the real one, scaled down to the tiny reference checkpoint (vocabulary 320, `<|media_pad|>` = 300):
BPE ranks first (the 256 bytes, then TINY_MERGES learned merges, 279 in all), then the reserved special ids
279..319. Every named special token sits at the same offset from the first special id as in the released
tokenizer (`[BOS]` +0 ... `<|media_pad|>` +21; `[UNK]` and `[PAD]` are the last two), so 300 is `<|media_pad|>`.
"""

import base64
import json
import re
from collections import Counter
from pathlib import Path

TINY_MERGES = 23
TINY_RESERVED_SPECIAL_TOKENS = 41  # ids 279..319

# Offsets from the first special id, as in Kimi-VL's tokenizer_config.json (163584 + offset).
SPECIAL_TOKEN_OFFSETS = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|im_system|>": 10,
    "<|im_middle|>": 17,
    "<|media_start|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "[UNK]": TINY_RESERVED_SPECIAL_TOKENS - 2,
    "[PAD]": TINY_RESERVED_SPECIAL_TOKENS - 1,
}

# The merges are learned from the words the chat format and tests use most.
_TRAINING_TEXT = (
    "You are a helpful assistant. system user assistant image "
    "Describe the image. What is in the picture? The answer is in the image."
)


def learn_merges(text: str, count: int) -> list[bytes]:
    """Byte-pair merges in learning order: most frequent adjacent pair first, ties broken by the pair's bytes."""
    # Words keep their leading space, as the pre-tokeniser leaves it on them.
    words = [[bytes([byte]) for byte in word.encode()] for word in re.findall(r" ?\S+", text)]
    merges = []
    while len(merges) < count:
        pairs = Counter((a, b) for word in words for a, b in zip(word, word[1:]))
        if not pairs:
            raise ValueError(f"The training text supports only {len(merges)} merges, {count} were asked for.")
        first, second = max(pairs, key=lambda pair: (pairs[pair], pair))
        words = [_merge_pair(word, first, second) for word in words]
        if first + second not in merges:
            merges.append(first + second)
    return merges


def _merge_pair(word: list[bytes], first: bytes, second: bytes) -> list[bytes]:
    merged, index = [], 0
    while index < len(word):
        if index + 1 < len(word) and word[index] == first and word[index + 1] == second:
            merged.append(first + second)
            index += 2
        else:
            merged.append(word[index])
            index += 1
    return merged


def write_tiny_tokenizer(directory: str | Path) -> Path:
    """Write `tiktoken.model`, `tokenizer_config.json` and `chat_template.jinja` into `directory`; return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokens = [bytes([byte]) for byte in range(256)] + learn_merges(_TRAINING_TEXT, TINY_MERGES)
    lines = [f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens)]
    (directory / "tiktoken.model").write_text("".join(lines))

    first_special_id = len(tokens)
    config = {
        "tokenizer_class": "KimiVLTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi_vl.KimiVLTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "num_reserved_special_tokens": TINY_RESERVED_SPECIAL_TOKENS,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "added_tokens_decoder": {
            str(first_special_id + offset): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for content, offset in SPECIAL_TOKEN_OFFSETS.items()
        },
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    template = Path(__file__).with_name("chat_template.jinja").read_text()
    (directory / "chat_template.jinja").write_text(template)
    return directory


__all__ = ["write_tiny_tokenizer", "learn_merges", "SPECIAL_TOKEN_OFFSETS"]
