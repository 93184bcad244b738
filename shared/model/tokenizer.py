"""Text <-> token ids for a model, built from a GGUF's own metadata or from a Hugging Face ``tokenizer.json``.

Invariants:
- ``encode`` adds no special token except the model's BOS, and that only when the model asks for one (GGUF
  ``tokenizer.ggml.add_bos_token``, e.g. Gemma; ``add_bos_token`` in an HF ``tokenizer_config.json``) and the
  text does not already start with it (a chat template that writes ``<bos>`` itself); special-token text in
  the input (``"<|im_start|>"``) is always one token, as in Hugging Face and llama.cpp;
- a GGUF byte-level BPE vocabulary keeps llama.cpp's ids exactly (nothing is appended to the vocabulary),
  and its pre-tokenizer follows ``tokenizer.ggml.pre`` the way llama.cpp does (e.g. ``smollm`` splits every
  digit, matching SmolLM2's own ``tokenizer.json``); a SentencePiece one (``llama``, Gemma) is built by
  shared/model/tokenizer_spm.py, also with llama.cpp's ids;
- a Gemma 3 GGUF without ``tokenizer.chat_template`` gets Gemma's turn template (shared/model/gemma3.py) and
  ``<end_of_turn>`` as a stop token;
- ``IncrementalDecoder``: the concatenation of everything ``feed`` returned plus ``flush()`` equals
  ``decode(all ids)``; no piece ends in a partial UTF-8 character.
"""
from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import tokenizers
from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from shared.errors import DeepinferError, ErrorCode
from shared.model import gemma3
from shared.model.chat_template import render_chat_template
from shared.model.tokenizer_spm import sentencepiece_bpe

log = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_GPT2_THEN_DIGITS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"),
                           _LLAMA3_SPLIT),
           **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT)}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used to spell byte-level BPE tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the model-level facts around it (BOS/EOS ids, chat template)."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None = None,
                 eos_token_ids: Iterable[int] = (), chat_template: str | None = None, add_bos: bool = False) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos  # encode() puts BOS first (the model was trained that way)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, source: GGUFReader | str | Path) -> "Tokenizer":
        """Build the tokenizer described by a GGUF's ``tokenizer.*`` metadata: ``gpt2`` byte-level BPE, or ``llama``
        SentencePiece BPE without a prefix space (Gemma). ``source``: a parsed header, a ``.gguf`` path or a
        packaged model name (``gemma3-270m``, see shared/model/locate.py)."""
        from shared.model.gguf_loader import corrupt, metadata, open_gguf  # lazy: keeps torch out of tokenizer-only use
        from shared.model.locate import resolve_model
        reader = source if isinstance(source, GGUFReader) else open_gguf(resolve_model(source))
        where = source if not isinstance(source, GGUFReader) else getattr(reader.data.base, "filename", "GGUF file")
        kind = metadata(reader, "tokenizer.ggml.model")
        tokens = metadata(reader, "tokenizer.ggml.tokens")
        if kind not in ("gpt2", "llama"):
            raise corrupt(where, f"tokenizer model {kind!r} is not supported ('gpt2' byte-level BPE, 'llama' "
                                 f"SentencePiece BPE)")
        if not tokens:
            raise corrupt(where, "has no tokenizer.ggml.tokens")
        types = metadata(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        bos, unk = metadata(reader, "tokenizer.ggml.bos_token_id"), metadata(reader, "tokenizer.ggml.unknown_token_id")
        if kind == "llama":
            if metadata(reader, "tokenizer.ggml.add_space_prefix", True):  # llama.cpp's default is true
                raise corrupt(where, "SentencePiece vocabularies with add_space_prefix are not supported")
            backend = sentencepiece_bpe(tokens, metadata(reader, "tokenizer.ggml.scores"), types,
                                        unk_token=None if unk is None else tokens[int(unk)])
        else:
            merges = metadata(reader, "tokenizer.ggml.merges") or []
            backend = _byte_level_bpe(tokens, types, merges, metadata(reader, "tokenizer.ggml.pre") or "default")
        add_bos = bool(metadata(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
        if add_bos:
            bos_text = tokens[int(bos)]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_text} $A", pair=f"{bos_text} $A $B", special_tokens=[(bos_text, int(bos))])
        eos = [metadata(reader, f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
        template = metadata(reader, "tokenizer.chat_template")
        if metadata(reader, "general.architecture") == "gemma3":  # llama.cpp stops at <end_of_turn> too
            eos.append(backend.token_to_id(gemma3.END_OF_TURN))
            template = template or gemma3.CHAT_TEMPLATE
        return cls(backend, bos_token_id=None if bos is None else int(bos),
                   eos_token_ids=[int(i) for i in eos if i is not None], chat_template=template, add_bos=add_bos)

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """Load a Hugging Face ``tokenizer.json``; BOS/EOS and the chat template come from the sibling
        ``tokenizer_config.json`` and ``chat_template.jinja`` when present."""
        path = Path(path)
        if not path.is_file():
            raise DeepinferError(ErrorCode.MODEL_NOT_FOUND, f"tokenizer file {path} does not exist")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:
            raise DeepinferError(ErrorCode.MODEL_CORRUPT, f"{path}: unreadable tokenizer ({exc})") from exc
        config = _read_json(path.parent / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = path.parent / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        def token_id(key: str) -> int | None:
            value = config.get(key)
            text = value.get("content") if isinstance(value, dict) else value
            return backend.token_to_id(text) if isinstance(text, str) else None

        eos = token_id("eos_token")
        return cls(backend, bos_token_id=token_id("bos_token"), eos_token_ids=[] if eos is None else [eos],
                   chat_template=template, add_bos=config.get("add_bos_token") is True)

    def add_eos_token_ids(self, ids: Iterable[int]) -> None:
        """Also stop on ``ids`` (e.g. the model config's / generation config's EOS list)."""
        self.eos_token_ids = tuple(dict.fromkeys((*self.eos_token_ids, *(int(i) for i in ids))))

    # ---- queries ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    # ---- text <-> ids -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """``text`` → ids. ``None``: the model's own rule (BOS first when ``add_bos`` and the text does not already
        start with it; nothing else); ``True``/``False``: the backend's post-processor, or nothing at all."""
        if add_special_tokens is not None:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and ids and ids[0] != self.bos_token_id:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """The prompt text for ``messages`` (ChatML when the model has no template)."""
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token, **extra)


class IncrementalDecoder:
    """Streaming detokenizer: ``feed(id)`` returns the text that id completed (possibly ``""``).

    Text is produced by decoding a short window of ids (from the last emitted boundary) and diffing it against
    the window without the newest ids, so decoders that depend on context (leading-space stripping, byte
    fallback, multi-token UTF-8 characters) give the same text as decoding everything at once. Text that ends
    in U+FFFD (an incomplete UTF-8 sequence so far) is held back until it completes or ``flush()`` is called.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids before this are already emitted

    def _text(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self.ids[start:end], skip_special_tokens=self._skip)

    def feed(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._text(self._prefix, self._read)
        new_text = self._text(self._prefix, len(self.ids))
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes to U+FFFD, as in ``decode``)."""
        prefix_text = self._text(self._prefix, self._read)
        new_text = self._text(self._prefix, len(self.ids))
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text):]


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    """A GPT-2-style tokenizer with llama.cpp's ids: control/user-defined tokens become added tokens matched
    whole in the input (control ones are special, i.e. dropped by ``skip_special_tokens``)."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=False,
                                              continuing_subword_prefix="", end_of_word_suffix="",
                                              ignore_merges=pre in _SPLITS and _SPLITS[pre] is _LLAMA3_SPLIT))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_THEN_DIGITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if _SPLITS[pre] is _QWEN2_SPLIT:
            backend.normalizer = normalizers.NFC()
    else:
        if pre not in ("gpt2", "default", "gpt-2", "mpt", "olmo", "jais"):
            log.warning("unknown GGUF pre-tokenizer %r: using GPT-2's split rules", pre)
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL and t]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED and t]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        log.warning("tokenizer vocabulary has %d entries, GGUF lists %d tokens",
                    backend.get_vocab_size(with_added_tokens=True), len(tokens))
    return backend


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DeepinferError(ErrorCode.MODEL_CORRUPT, f"{path}: unreadable JSON ({exc})") from exc
