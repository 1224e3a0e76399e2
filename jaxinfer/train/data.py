"""The training corpus: text that ships with Python itself, split by document, tokenized, and cut into batches.

Documents (in this order, each sorted by name, so the corpus is a function of the Python version only):
- ``pydoc:<topic>``: the topics of ``pydoc_data.topics`` (the language reference pages ``help()`` shows);
- ``module:<name>``: the docstrings of one standard-library source file (module, classes, functions, methods in
  source order, each under a header with its qualified name and signature), read with ``ast`` from the files of
  the modules in ``sys.stdlib_module_names`` -- nothing is imported, so no module's import side effects run.
  Tests, ``encodings`` (hundreds of generated codec docstrings) and ``pydoc_data`` (the topics above) are left out.

Split: a document is held out when crc32(name) % HELDOUT_MOD == 0 (about 1 in 20), whatever the other documents.
Token stream: per document [BOS] + ids + [EOS], concatenated in corpus order.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys
import sysconfig
import zlib

import numpy as np

HELDOUT_MOD = 20
SKIP_MODULES = frozenset({"encodings", "pydoc_data", "test", "idlelib.idle_test", "lib2to3.tests", "this"})
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages"})


@dataclasses.dataclass(frozen=True)
class Document:
    name: str  # "pydoc:<topic>" or "module:<dotted name>"
    text: str


def pydoc_documents() -> list[Document]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return [Document(f"pydoc:{k}", topics[k].strip() + "\n") for k in sorted(topics)]


def _header(node: ast.AST, qual: str) -> str:
    """``class json.JSONDecoder(object)`` / ``def json.JSONDecoder.decode(self, s, _w=WHITESPACE.match)``."""
    if isinstance(node, ast.ClassDef):
        bases = [ast.unparse(b) for b in node.bases] + [ast.unparse(k) for k in node.keywords]
        return f"class {qual}" + (f"({', '.join(bases)})" if bases else "")
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return f"{prefix} {qual}({ast.unparse(node.args)})"


def _docstrings(body: list[ast.stmt], qual: str) -> list[str]:
    """Sections "<header>\\n\\n<docstring>" of the classes and functions in ``body``, recursively, source order."""
    out = []
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{qual}.{node.name}"
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append(f"{_header(node, name)}\n\n{doc}\n")
            out += _docstrings(node.body, name)
    return out


def module_document(name: str, source: str) -> Document | None:
    """The docstrings of one module's source as a document (None when it has none)."""
    tree = ast.parse(source)
    sections = []
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        sections.append(doc + "\n")
    sections += _docstrings(tree.body, name)
    if not sections:
        return None
    title = f"{name}\n{'=' * len(name)}\n\n"
    return Document(f"module:{name}", title + "\n".join(sections))


def stdlib_files(stdlib: pathlib.Path | None = None) -> list[tuple[str, pathlib.Path]]:
    """(dotted module name, source file) of the pure-Python standard library, sorted by name."""
    stdlib = pathlib.Path(stdlib or sysconfig.get_paths()["stdlib"])
    out = []
    for top in sorted(sys.stdlib_module_names):
        if top in SKIP_MODULES or top.startswith("_"):
            continue
        single, package = stdlib / f"{top}.py", stdlib / top
        if single.is_file():
            out.append((top, single))
        elif package.is_dir():
            for f in sorted(package.rglob("*.py")):
                rel = f.relative_to(stdlib).with_suffix("")
                if SKIP_DIRS & set(rel.parts):
                    continue
                parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
                name = ".".join(parts)
                if not any(name == s or name.startswith(s + ".") for s in SKIP_MODULES):
                    out.append((name, f))
    return sorted(out)


def stdlib_documents() -> list[Document]:
    docs = []
    for name, path in stdlib_files():
        try:
            doc = module_document(name, path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # e.g. lib2to3 grammar fixtures
            continue
        if doc is not None:
            docs.append(doc)
    return docs


def corpus() -> list[Document]:
    """All documents, pydoc topics first, each group sorted by name."""
    return pydoc_documents() + stdlib_documents()


def is_heldout(doc: Document) -> bool:
    return zlib.crc32(doc.name.encode("utf-8")) % HELDOUT_MOD == 0


def split(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """(train, held-out) by document name (``is_heldout``), corpus order kept."""
    return [d for d in docs if not is_heldout(d)], [d for d in docs if is_heldout(d)]


def token_stream(docs: list[Document], encode, bos_id: int, eos_id: int) -> np.ndarray:
    """int32 [N]: [BOS] + encode(text) + [EOS] per document, concatenated. encode: str -> list[int] (no BOS)."""
    parts = [np.asarray([bos_id] + list(encode(d.text)) + [eos_id], np.int32) for d in docs]
    return np.concatenate(parts)


def random_windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """int32 [B, length]: windows at uniformly drawn offsets of the stream."""
    starts = rng.integers(0, len(stream) - length + 1, size=batch)
    return stream[starts[:, None] + np.arange(length)[None, :]]


def tiled_windows(stream: np.ndarray, length: int, step: int) -> np.ndarray:
    """int32 [W, length]: windows starting at 0, step, 2*step, ... that fit in the stream."""
    starts = np.arange(0, len(stream) - length + 1, step)
    return stream[starts[:, None] + np.arange(length)[None, :]]
