"""A SentencePiece BPE vocabulary from GGUF metadata (``tokenizer.ggml.model == "llama"``, e.g. Gemma 3) as a
``tokenizers.Tokenizer`` that keeps llama.cpp's ids.

How SentencePiece BPE tokenizes, and how it is reproduced here (checked token for token against transformers'
tokenizer for the same GGUF, tests/model/test_gemma3_*.py):

- spaces are written "▁" (U+2581); no prefix space is added (``tokenizer.ggml.add_space_prefix`` false: Gemma's
  files say so, and it is the only case supported);
- control tokens (``<bos>``, ``<start_of_turn>``, ...) and user-defined ones (runs of newlines or tabs, HTML tags)
  are matched whole in the input before any merge, longest first; control ones are special (dropped by
  ``skip_special_tokens``). llama.cpp writes the user-defined runs of spaces with real spaces: they are spelled
  with "▁" again and built by the merges instead, which reach them before any normal piece (lower ids);
- everything else is merged pairwise, always the adjacent pair whose joined piece ranks best. The rank is the
  piece's id: SentencePiece exports list normal pieces in score order (checked here; otherwise the scores rank
  them), and Gemma's user-defined pieces, whose scores are all -1000, come before every normal piece, which is
  how SentencePiece treats them. Among the splits of one piece the longer left part ranks first;
- characters that no piece covers fall back to their UTF-8 bytes (``<0xXX>`` pieces); decoding maps "▁" back to
  spaces and byte pieces back to bytes.
"""
from __future__ import annotations

import logging

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers

log = logging.getLogger(__name__)

SPACE = "\u2581"
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp token types (6 is a byte piece)


def _spelling(token: str) -> str:
    """A whitespace-only piece containing spaces (stored with real spaces) spelled as SentencePiece does."""
    return token.replace(" ", SPACE) if " " in token and not token.strip() else token


def _ranks(tokens: list[str], scores: list[float], types: list[int]) -> list[int]:
    """Merge priority of every id (lower merges first): the id itself when the normal pieces' scores fall with
    their ids, else the position by score (best first, ties by id)."""
    normal = [s for s, t in zip(scores, types) if t == _NORMAL]
    if all(a >= b for a, b in zip(normal, normal[1:])):
        return list(range(len(tokens)))
    log.warning("SentencePiece scores are not in id order: ranking merges by score")
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))
    ranks = [0] * len(tokens)
    for position, index in enumerate(order):
        ranks[index] = position
    return ranks


def sentencepiece_bpe(tokens: list[str], scores: list[float] | None, types: list[int] | None, *,
                      unk_token: str | None) -> tokenizers.Tokenizer:
    """The tokenizer of a SentencePiece BPE vocabulary (see the module docstring); id ``i`` is ``tokens[i]``."""
    types = list(types) if types else [_NORMAL] * len(tokens)
    scores = list(scores) if scores else [-float(i) for i in range(len(tokens))]
    pieces = [_spelling(t) for t in tokens]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    ranks = _ranks(tokens, scores, types)
    merges: list[tuple[int, int, tuple[str, str]]] = []  # (rank of the joined piece, -len(left), (left, right))
    for piece, index in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((ranks[index], -cut, (left, right)))
    merges.sort()
    model = models.BPE(vocab=vocab, merges=[pair for _, _, pair in merges], unk_token=unk_token, fuse_unk=True,
                       byte_fallback=True, dropout=None)
    backend = tokenizers.Tokenizer(model)
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL and t])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, p, k in zip(tokens, pieces, types) if k == _USER_DEFINED and t and t == p])
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        log.warning("tokenizer vocabulary has %d entries, GGUF lists %d tokens",
                    backend.get_vocab_size(with_added_tokens=True), len(tokens))
    return backend
