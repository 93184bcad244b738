"""Render a model's jinja chat template the way Hugging Face transformers does.

Invariants:
- templates run in jinja2's ``ImmutableSandboxedEnvironment`` (they come from model files: untrusted code),
  with transformers' settings (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a non-HTML-escaping
  ``tojson``, ``raise_exception``, ``strftime_now``), so output matches ``apply_chat_template`` byte for byte;
- the template only ever sees plain JSON data (str/int/float/bool/None/list/dict) rebuilt from the input;
- a template that calls ``raise_exception`` (e.g. bad role order) -> ``DeepinferError(INVALID_REQUEST)``;
  a template that does not compile -> ``DeepinferError(MODEL_CORRUPT)``.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.errors import DeepinferError, ErrorCode

# Used when a model ships no template. Same text as transformers' historical ChatML default.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile (and cache) a chat template. Raises ``DeepinferError(MODEL_CORRUPT)`` on a syntax error."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise DeepinferError(ErrorCode.MODEL_CORRUPT, f"chat template does not compile: {exc}") from exc


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from JSON types only, so the sandboxed template cannot reach any rich object."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def render_chat_template(template: str | None, messages: list[dict[str, Any]], *,
                         add_generation_prompt: bool = True, bos_token: str | None = None,
                         eos_token: str | None = None, **extra: Any) -> str:
    """Render ``messages`` with ``template`` (ChatML when ``None``); ``extra`` (e.g. ``tools``) is passed through."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise DeepinferError(ErrorCode.INVALID_REQUEST, "messages must be a list of objects")
    compiled = compile_template(template or CHATML_TEMPLATE)
    context = _plain(extra)
    context.update(messages=_plain(messages), add_generation_prompt=bool(add_generation_prompt),
                   bos_token=bos_token or "", eos_token=eos_token or "")
    try:
        return compiled.render(**context)
    except jinja2.exceptions.SecurityError as exc:
        raise DeepinferError(ErrorCode.INVALID_REQUEST, f"chat template refused the input: {exc}") from exc
    except jinja2.exceptions.TemplateError as exc:  # raise_exception() or an undefined-variable misuse
        raise DeepinferError(ErrorCode.INVALID_REQUEST, f"chat template rejected the messages: {exc}") from exc
    except (TypeError, KeyError, AttributeError, ValueError) as exc:  # e.g. content not a string
        raise DeepinferError(ErrorCode.INVALID_REQUEST, f"chat template failed on these messages: {exc}") from exc
