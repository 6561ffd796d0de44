"""Tokenizer of Kimi-VL: tiktoken BPE with Moonshot's pre-tokenisation and a block of reserved special ids.

Files (as on the Hub): `tiktoken.model` (one "base64-token rank" line per BPE token, ranks 0..n-1) and
`tokenizer_config.json`. The ids after the BPE ranks are `num_reserved_special_tokens` (256) special tokens;
`added_tokens_decoder` names some of them (`[BOS]`, `<|im_end|>`, `<|media_pad|>`, ...), the rest are
`<|reserved_token_N|>`. Every reserved id, named or not, is an added special token of the transformers tokenizer,
so that transformers' special-token handling covers all of them: by default a special-token string in text encodes
to its single id, as in the original; with `split_special_tokens=True` (call argument, or `from_pretrained` / init
setting) it is encoded as plain text, and `apply_chat_template(..., sanitize_control_tokens=True)` encodes the ones
in message text as plain text while the template's own stay special.
"""

import base64
import os
import shutil

import tiktoken
from transformers import AddedToken, PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.utils import logging

from .transformers_compat_processing import refuse_unsupported_sanitizing

logger = logging.get_logger(__name__)

# Moonshot's pre-tokenisation pattern (`pat_str` of the released tokenization_moonshot.py): Han runs on their own,
# cased words with English contractions, numbers in groups of up to three, punctuation runs, whitespace.
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# The original encodes text in windows of this many characters, and cuts runs of only-whitespace or
# only-non-whitespace characters longer than MAX_RUN_CHARS, both to bound tiktoken's work. The cuts change the
# ids of such texts, so they are reproduced.
ENCODE_WINDOW_CHARS = 400_000
MAX_RUN_CHARS = 25_000


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Parse a tiktoken BPE file. (tiktoken's own loader caches files by path name, which goes stale.)"""
    ranks = {}
    with open(path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as error:
                raise ValueError(f"{path}, line {line_number}: expected 'base64-token rank', got {line!r}") from error
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be the distinct integers 0..{len(ranks) - 1}")
    return ranks


# GPT-2's reversible map from bytes to printable characters, used for the token strings of BPE tokens.
BYTE_TO_CHAR = bytes_to_unicode()


def _content(token) -> str:
    """The text of an `added_tokens_decoder` entry, given as AddedToken, str, or its saved dict."""
    return token["content"] if isinstance(token, dict) else str(token)


def _split_long_runs(text: str) -> list[str]:
    """Cut `text` where a run of whitespace or of non-whitespace exceeds MAX_RUN_CHARS, as the original does."""
    if len(text) <= MAX_RUN_CHARS:
        return [text]
    pieces, piece_start, run_start = [], 0, 0
    for position in range(1, len(text) + 1):
        if position < len(text) and text[position].isspace() == text[run_start].isspace():
            if position - run_start == MAX_RUN_CHARS:
                pieces.append(text[piece_start:position])
                piece_start = run_start = position
            continue
        run_start = position
    pieces.append(text[piece_start:])
    return pieces


class KimiVLTokenizer(PreTrainedTokenizer):
    """tiktoken-based tokenizer of Kimi-VL; ids equal the released `TikTokenTokenizer`'s. No BOS is added."""

    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        bos_token: str = "[BOS]",
        eos_token: str = "[EOS]",
        unk_token: str = "[UNK]",
        pad_token: str = "[PAD]",
        num_reserved_special_tokens: int = 256,
        added_tokens_decoder: dict | None = None,
        **kwargs,
    ):
        ranks = read_tiktoken_ranks(vocab_file)
        self.vocab_file = vocab_file
        self.num_base_tokens = len(ranks)
        self.num_reserved_special_tokens = num_reserved_special_tokens
        special_tokens = self._special_token_strings(added_tokens_decoder or {})
        special_ids = {token: self.num_base_tokens + offset for offset, token in enumerate(special_tokens)}
        for role, token in {"bos": bos_token, "eos": eos_token, "unk": unk_token, "pad": pad_token}.items():
            if token is not None and str(token) not in special_ids:
                raise ValueError(f"{role}_token {str(token)!r} is not one of the special tokens of {vocab_file}.")
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(vocab_file), pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=special_ids
        )
        self._token_strings = ["".join(BYTE_TO_CHAR[byte] for byte in token) for token in ranks]
        self._token_strings.extend(special_tokens)
        self._token_ids = {token: token_id for token_id, token in enumerate(self._token_strings)}
        # Every reserved id is an added special token, not only the named ones: the original encodes each of them
        # from text, and transformers' `split_special_tokens` and `sanitize_control_tokens` act on added special
        # tokens. (An AddedToken given for an id keeps its settings.)
        given = {int(i): token for i, token in (added_tokens_decoder or {}).items() if isinstance(token, AddedToken)}
        added_tokens = {
            token_id: given.get(token_id, AddedToken(token, special=True))
            for token_id, token in enumerate(special_tokens, start=self.num_base_tokens)
        }
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            num_reserved_special_tokens=num_reserved_special_tokens,
            added_tokens_decoder=added_tokens,
            **kwargs,
        )

    def _special_token_strings(self, added_tokens_decoder: dict) -> list[str]:
        """The string of every reserved special id, in id order: its `added_tokens_decoder` name or the default."""
        first, end = self.num_base_tokens, self.num_base_tokens + self.num_reserved_special_tokens
        named = {int(token_id): _content(token) for token_id, token in added_tokens_decoder.items()}
        outside = sorted(token_id for token_id in named if not first <= token_id < end)
        if outside:
            raise ValueError(
                f"added_tokens_decoder ids {outside} are outside the reserved special range [{first}, {end})."
            )
        tokens = [named.get(token_id, f"<|reserved_token_{token_id}|>") for token_id in range(first, end)]
        # Each string must name one id: text containing it encodes to that id, and ids map back to it.
        ids_of = {}
        for token_id, token in enumerate(tokens, start=first):
            ids_of.setdefault(token, []).append(token_id)
        duplicates = {token: ids for token, ids in ids_of.items() if len(ids) > 1}
        if duplicates:
            listed = "; ".join(f"{token!r} at ids {ids}" for token, ids in duplicates.items())
            raise ValueError(f"Special token names must be unique, but these name several ids: {listed}.")
        return tokens

    def apply_chat_template(self, conversation, *args, **kwargs):
        refuse_unsupported_sanitizing(kwargs)
        return super().apply_chat_template(conversation, *args, **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._token_strings)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._token_ids)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        # transformers' `tokenize` has already cut the special-token strings out of `text` (they are all added
        # tokens), or was asked to `split_special_tokens`: either way, what reaches here is plain text.
        return [self._token_strings[token_id] for token_id in self._encode_plain_text(text)]

    def _encode_plain_text(self, text: str) -> list[int]:
        """BPE ids of `text` with special-token strings as ordinary text, in the original's windows and runs."""
        ids = []
        for window_start in range(0, len(text), ENCODE_WINDOW_CHARS):
            for piece in _split_long_runs(text[window_start : window_start + ENCODE_WINDOW_CHARS]):
                ids.extend(self._encoding.encode_ordinary(piece))
        return ids

    def _convert_token_to_id(self, token: str) -> int:
        return self._token_ids.get(token, self.unk_token_id)

    def _convert_id_to_token(self, index: int) -> str:
        if not 0 <= index < len(self._token_strings):
            raise ValueError(f"Token id {index} is outside the vocabulary [0, {len(self._token_strings)}).")
        return self._token_strings[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self._decode(self.convert_tokens_to_ids(tokens))

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs):
        """Decode with tiktoken; `skip_special_tokens` drops every reserved special id, named or not."""
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(token_id) for token_id in token_ids]
        invalid = [token_id for token_id in ids if not 0 <= token_id < len(self._token_strings)]
        if invalid:
            raise ValueError(f"Token ids {invalid[:5]} are outside the vocabulary [0, {len(self._token_strings)}).")
        if skip_special_tokens:
            ids = [token_id for token_id in ids if token_id < self.num_base_tokens]
        text = self._encoding.decode(ids, errors="replace")
        if (
            clean_up_tokenization_spaces
            if clean_up_tokenization_spaces is not None
            else self.clean_up_tokenization_spaces
        ):
            text = self.clean_up_tokenization(text)
        return text

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        if not os.path.isdir(save_directory):
            raise ValueError(f"save_vocabulary needs an existing directory, got {save_directory!r}.")
        prefix = f"{filename_prefix}-" if filename_prefix else ""
        target = os.path.join(save_directory, prefix + self.vocab_files_names["vocab_file"])
        if os.path.abspath(target) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, target)
        return (target,)


__all__ = ["KimiVLTokenizer", "PAT_STR"]
