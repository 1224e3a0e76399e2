"""Tokenizer: HF `tokenizer.json` through `tokenizers`, the jinja2 chat template of `tokenizer_config.json`, and
an incremental detokenizer for streaming and stop strings.

Injection safety (docs/architecture.md "Platform facts"): text from users never becomes a special token. `encode`
sets `tokenizers`' `encode_special_tokens = True`, so "<｜end▁of▁sentence｜>" in a prompt is encoded as the plain text
it spells; special tokens come only from the post-processor (BOS) and from the chat template's own text (see
`Tokenizer.apply_chat_template`). Non-special added tokens (e.g. R1's `<think>`) are matched everywhere, as
`tokenizers` does with `encode_special_tokens`.

Reference behaviour: transformers' `PreTrainedTokenizerFast` (v5 `TokenizersBackend`) on the same directory:
`encode` equals its `encode` for text without special-token strings, `apply_chat_template` equals its
`apply_chat_template(..., tokenize=True)` for messages without special-token strings, and the jinja2 environment
is the one transformers builds
(`transformers/utils/chat_template_utils.py`: sandboxed, trim_blocks, lstrip_blocks, loopcontrols,
`raise_exception`, `strftime_now`, a non-escaping `tojson`). `clean_up_tokenization_spaces` is ignored: the text is
exactly what the tokens spell, so streamed text and full decodes agree.

BOS: tokenizer_config's `add_bos_token` / `add_eos_token`, when given, decide (a TemplateProcessing
post-processor built as transformers' `update_post_processor` builds it; transformers v4's LlamaTokenizerFast
honoured them, which is how DeepSeek's checkpoints, whose tokenizer.json adds no BOS, get their BOS). transformers
v5 drops these two keys when a tokenizer.json exists (`_from_pretrained`), so its `AutoTokenizer` matches only
with `add_bos_token=...` passed explicitly. Without the keys, tokenizer.json's own post-processor decides.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from collections.abc import Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import processors

from jaxinfer import host_memory
from jaxinfer.engine.chat_protocol import normalize_messages
from jaxinfer.engine.text_chunks import CHUNK_CHARS, can_cut, safe_cuts
from jaxinfer.engine.tokenizer_workers import Workers

# Characters of a job worth the worker processes where malloc is limited to one arena: ~35 ms of encoding, against
# the pipes' ~1 ms and, once, the workers' start (~0.1 s; docs/benchmarks.md "Tokenization (CPU)").
WORKER_MIN_CHARS = 100_000

# Escape scheme for user strings rendered by the chat template (see `Tokenizer.apply_chat_template`):
# escapable string k (k = 0 is the marker itself, k >= 1 the special tokens) becomes _MARK + chr(_CODE0 + k).
# _MARK is a BMP private-use character, the codes are in plane 15 (Supplementary Private Use Area-A).
_MARK = "\ue000"
_CODE0 = 0xF0000
_UNESCAPE_RE = re.compile(_MARK + "([\U000f0000-\U000ffffd])")


def _token_content(value) -> str | None:
    """A special token from tokenizer_config.json: a string, an AddedToken dict ({"content": ...}) or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token must be a string or a dict with a 'content' string, got {value!r}")


def _select_template(value) -> str | None:
    """`chat_template` of tokenizer_config.json: a string, or a list of {"name", "template"} (take "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"chat_template list has no template named 'default' (names: {sorted(named, key=str)})")
        return named["default"]
    raise ValueError(f"chat_template must be a string or a list of named templates, got {type(value).__name__}")


def _jinja_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (chat_template_utils._cached_compile_jinja_template)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson escapes HTML characters; transformers replaces it with plain json.dumps
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class Tokenizer:
    """A `tokenizers` tokenizer with the settings of tokenizer_config.json. Build with `Tokenizer.from_dir`."""

    def __init__(self, hf: _HFTokenizer, config: dict | None = None, chat_template: str | None = None):
        config = dict(config or {})
        self._tok = hf
        self._tok.encode_special_tokens = True  # user text never becomes a special token
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self._template_tokens = {  # the special-token variables transformers passes to the template
            k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        self._template_tokens = {k: v for k, v in self._template_tokens.items() if v is not None}
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token is not None else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token is not None else None
        if "add_bos_token" in config or "add_eos_token" in config:
            # Built as transformers' `update_post_processor` does (v4 LlamaTokenizerFast applied it from the config;
            # v5 only from explicit kwargs, see the module docstring); otherwise tokenizer.json's post-processor.
            add_bos = bool(config.get("add_bos_token")) and self.bos_token_id is not None
            add_eos = bool(config.get("add_eos_token")) and self.eos_token_id is not None
            single = " ".join(
                ([f"{self.bos_token}:0"] if add_bos else []) + ["$A:0"] + ([f"{self.eos_token}:0"] if add_eos else [])
            )
            pair = f"{single} " + " ".join(
                ([f"{self.bos_token}:1"] if add_bos else []) + ["$B:1"] + ([f"{self.eos_token}:1"] if add_eos else [])
            )
            specials = ([(self.bos_token, self.bos_token_id)] if add_bos else []) + (
                [(self.eos_token, self.eos_token_id)] if add_eos else []
            )
            self._tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

        added = self._tok.get_added_tokens_decoder()  # {id: AddedToken}
        self._special = {tok.content: (i, tok) for i, tok in added.items() if tok.special}
        # Long texts encode in parallel pieces where that changes nothing (engine/text_chunks.py); the added tokens
        # matched in text (not the special ones: encode_special_tokens) must not be cut.
        self.chunk_chars = CHUNK_CHARS  # texts over twice this are cut into pieces of about this many characters
        # Batches encode on tokenizers' thread pool, or where malloc is limited to one arena (host_memory.py: there
        # the threads queue on its lock and a batch is slower than a loop) in worker processes
        # (engine/tokenizer_workers.py) once a job has worker_min_chars; parallel False: in this process, in order.
        self.parallel = True
        cores = os.cpu_count() or 1
        self._workers = Workers(self._tok.to_str(), cores) if host_memory.ONE_ARENA and cores > 1 else None
        self.worker_min_chars = WORKER_MIN_CHARS
        self._cuttable = can_cut(json.loads(self._tok.to_str()))
        x, with_specials = self._tok.encode("x", add_special_tokens=False).ids, self._tok.encode("x").ids
        k = next((k for k in range(len(with_specials)) if with_specials[k:k + len(x)] == x), None)
        # what the post-processor puts around a text's ids (BOS, EOS), added to the pieces' ids
        self._affixes = (with_specials[:k], with_specials[k + len(x):]) if k is not None else ([], [])
        self._cuttable = self._cuttable and k is not None
        self._added_texts = [tok.content for tok in added.values() if not tok.special]
        self.special_token_ids = frozenset(i for i, _ in self._special.values())
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        # Chat template and its injection-safe encoding (apply_chat_template)
        self.chat_template = chat_template if chat_template is not None else _select_template(
            config.get("chat_template")
        )
        self._compiled = None
        self._escapable = [_MARK] + sorted(self._special, key=len, reverse=True)
        self._escape_code = {s: _MARK + chr(_CODE0 + k) for k, s in enumerate(self._escapable)}
        self._escape_re = re.compile("|".join(re.escape(s) for s in self._escapable))
        specials_by_length = sorted(self._special, key=len, reverse=True)
        self._special_re = (
            re.compile("(" + "|".join(re.escape(s) for s in specials_by_length) + ")") if specials_by_length else None
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer | None:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja` when present) from a checkpoint
        directory. None when there is no tokenizer.json: such a checkpoint takes token-id prompts only."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            return None
        config = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, dict):
                raise ValueError(f"{cfg_file}: expected a JSON object")
        template = None
        jinja_file = os.path.join(path, "chat_template.jinja")  # newer transformers save the template here
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        return cls(_HFTokenizer.from_file(tok_file), config, template)

    # ---- encode / decode ----

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it are plain text. BOS/EOS per the post-processor
        (tokenizer_config's add_bos_token / add_eos_token when given) if `add_special_tokens`. With ``parallel``, a
        long text is cut where its tokenization does not change (engine/text_chunks.py) and its pieces encoded in
        parallel."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        cuts = (safe_cuts(text, self._tok.pre_tokenizer.pre_tokenize_str, self._added_texts, self.chunk_chars)
                if self._parallel_for([text]) and self._cuttable and len(text) > 2 * self.chunk_chars else [])
        if not cuts:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        bounds = [0, *cuts, len(text)]
        ids = [i for piece in self._encode_all([text[a:b] for a, b in zip(bounds, bounds[1:])], False) for i in piece]
        if not add_special_tokens:
            return ids
        prefix, suffix = self._affixes
        return prefix + ids + suffix

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text, the batch encoded in parallel (``tokenizers``' encode_batch on all cores, or
        worker processes where malloc is limited to one arena: see ``parallel``)."""
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
        if not self._parallel_for(texts):
            return [self._tok.encode(t, add_special_tokens=add_special_tokens).ids for t in texts]
        long = {i for i, text in enumerate(texts) if self._cuttable and len(text) > 2 * self.chunk_chars}
        short = [t for i, t in enumerate(texts) if i not in long]
        encoded = iter(self._encode_all(short, add_special_tokens))
        return [self.encode(t, add_special_tokens) if i in long else next(encoded) for i, t in enumerate(texts)]

    def _parallel_for(self, texts: Sequence[str]) -> bool:
        """Whether a job of these texts encodes in parallel (see ``parallel``)."""
        if not self.parallel:
            return False
        if not host_memory.ONE_ARENA:
            return True
        return self._workers is not None and sum(map(len, texts)) >= self.worker_min_chars

    def _encode_all(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        """The texts' ids, encoded in parallel where ``_parallel_for`` says so. Workers that fail are not used again
        (the texts are encoded here instead)."""
        if self._parallel_for(texts):
            if self._workers is None:  # malloc as glibc sets it: tokenizers' thread pool
                return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
            try:
                return self._workers.encode(texts, add_special_tokens)
            except (OSError, EOFError):
                self._workers = None
        return [self._tok.encode(t, add_special_tokens=add_special_tokens).ids for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The ``tokenizers`` JSON of this tokenizer (what llguidance builds its tokenizer from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # ---- chat template ----

    def _escape(self, obj):
        """User strings (recursively through dicts and lists, keys too) with each special token and the marker
        escaped."""
        if isinstance(obj, str):
            return self._escape_re.sub(lambda m: self._escape_code[m.group(0)], obj)
        if isinstance(obj, dict):
            return {self._escape(k): (v if k == "role" else self._escape(v)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self._escape(v) for v in obj]
        return obj

    def _unescape(self, text: str) -> str:
        def sub(m):
            k = ord(m.group(1)) - _CODE0
            return self._escapable[k] if k < len(self._escapable) else m.group(0)

        return _UNESCAPE_RE.sub(sub, text)

    def render_chat(self, messages, add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> str:
        """The chat template's text for `messages` (what transformers' apply_chat_template(tokenize=False) gives;
        arguments as `apply_chat_template`'s)."""
        return self._unescape(self._render_escaped(messages, add_generation_prompt, tools, template_kwargs))

    def _render_escaped(self, messages, add_generation_prompt: bool, tools, template_kwargs) -> str:
        messages = normalize_messages(messages)
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {type(template_kwargs).__name__}")
        template_kwargs = dict(template_kwargs or {})
        reserved = {"messages", "tools", "documents", "add_generation_prompt"} & set(template_kwargs)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)} (arguments of their own)")
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (no 'chat_template' in tokenizer_config.json and no "
                "chat_template.jinja): pass plain prompts or token ids instead of messages"
            )
        if self._compiled is None:
            try:
                self._compiled = _jinja_environment().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"chat template does not compile: {e}") from e
        arguments = dict(messages=self._escape(messages), add_generation_prompt=add_generation_prompt,
                         tools=self._escape(tools), documents=None,
                         **{**self._template_tokens, **self._escape(template_kwargs)})
        try:
            return self._compiled.render(**arguments)
        except jinja2.TemplateError as e:  # raise_exception(...) in the template, or a render error
            raise ValueError(f"chat template rejected the messages: {e}") from e
        except TypeError as e:  # the template's own operations, e.g. '<｜Assistant｜>' + content with content None
            raise ValueError(f"chat template failed on the messages (TypeError: {e}); a template that concatenates "
                             "content cannot render content None (an assistant message with tool_calls only)") from e

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> list[int]:
        """Token ids of the chat template rendered for `messages` (one conversation in OpenAI's shapes:
        engine/chat_protocol.py ``normalize_messages``), `tools` (function definitions, given to the template as
        transformers gives them) and `template_kwargs` (more template variables, e.g. a thinking switch); the
        template's special tokens are special token ids, text inside the messages, tools and kwargs never is.

        Approach (escape, render, split, encode):
        1. Every string in the messages (except `role`) is escaped: each special-token string, and the escape
           marker U+E000 itself, becomes U+E000 + one plane-15 private-use code. The template therefore never
           sees a special-token string coming from a user, and string operations in templates (trim, split on
           "</think>", `in`) still work on the rest of the text.
        2. The template is rendered (sandboxed jinja2, transformers' settings) with the escaped messages; every
           special-token string left in the output was written by the template (or is its bos/eos variable).
        3. The output is split at those special-token strings (leftmost-longest, honouring their lstrip/rstrip);
           they become their ids. The text between them is unescaped back to the users' exact characters and
           encoded in one piece with `encode_special_tokens = True`, so users' special-token strings are plain
           text and the tokens around them merge as they would in `encode`.
        `tokenizers` itself splits its input at added tokens and encodes each piece separately, so for messages
        without special-token strings the ids equal transformers' `apply_chat_template(..., tokenize=True)` for
        tokenizers whose pre-tokenization does not depend on the position of a piece in the string (byte-level
        BPE, as DeepSeek's; not Metaspace with prepend_scheme "first"). The decode of the ids (special tokens
        kept) is always the rendered text.
        """
        rendered = self._render_escaped(messages, add_generation_prompt, tools, template_kwargs)
        pieces = self._special_re.split(rendered) if self._special_re is not None else [rendered]
        # pieces: [text, special, text, special, ..., text]
        texts = pieces[0::2]
        specials = pieces[1::2]
        for j, s in enumerate(specials):
            tok = self._special[s][1]
            if tok.lstrip:
                texts[j] = texts[j].rstrip()
            if tok.rstrip:
                texts[j + 1] = texts[j + 1].lstrip()
        ids: list[int] = []
        for j, text in enumerate(texts):
            if text:
                ids += self._tok.encode(self._unescape(text), add_special_tokens=False).ids
            if j < len(specials):
                ids.append(self._special[specials[j]][0])
        return ids


class IncrementalDecoder:
    """Streaming detokenizer: `add(token_id)` returns the text that became stable with that token.

    vLLM's `detokenize_incrementally` (vllm/transformers_utils/detokenizer_utils.py): decode a short window
    ids[prefix_offset:] and the part of it already emitted, ids[prefix_offset:read_offset]; the difference is new
    text, unless the window's text ends in U+FFFD (a multi-byte UTF-8 character split across byte-level tokens,
    which a later token may complete): then nothing is emitted yet. The window starts with the prompt's last
    tokens (vLLM: 5) so decoders whose output depends on the preceding token (leading spaces) decode in context.
    `finish()` emits what is still held at the end of a stream (replacement characters of bytes never
    completed), after which `text == tokenizer.decode(output_ids)`.
    """

    _CONTEXT = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = [int(i) for i in prompt_ids[-self._CONTEXT :]] if len(prompt_ids) else []
        if self._window(0).endswith("\ufffd"):
            # The prompt ends inside a UTF-8 character (token-id prompts can): its dangling bytes would merge
            # with the first generated bytes, which a decode of the output alone shows as U+FFFD. No context.
            self._ids = []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_ids: list[int] = []
        self.text = ""

    def _window(self, start: int, stop: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the newly stable text ("" while a character is incomplete)."""
        token_id = int(token_id)
        self._ids.append(token_id)
        self.output_ids.append(token_id)
        prefix_text = self._window(self._prefix_offset, self._read_offset)
        new_text = self._window(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """End of stream: emit the held text (incomplete characters as U+FFFD, as a full decode shows them)."""
        prefix_text = self._window(self._prefix_offset, self._read_offset)
        new_text = self._window(self._prefix_offset)
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
