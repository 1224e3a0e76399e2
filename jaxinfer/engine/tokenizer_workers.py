"""Tokenization in worker processes: Tokenizer's parallel path where malloc is limited to one arena
(jaxinfer/host_memory.py).

On one arena, ``tokenizers``' thread pool queues on the arena's lock (a batch ran at 0.56-0.66x of a loop); worker
processes each have their own malloc and encode their share of the texts single-threaded (docs/benchmarks.md
"Tokenization (CPU)"). The workers are ``python -m jaxinfer.engine.tokenizer_workers`` over pipes rather than a
multiprocessing pool: spawn and forkserver import the caller's ``__main__`` again, which breaks a script without an
``if __name__ == "__main__"`` guard, and fork would copy a process running XLA's threads. No library runs work in
processes without one of those, hence this module.

Protocol (a process and its own children, so pickle): a message is a 4-byte big-endian length and a pickle. The
first message is the tokenizer's JSON; each later one, (texts, add_special_tokens), is answered with the texts'
id lists. A worker exits at the end of its input.
"""

from __future__ import annotations

import atexit
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence

import jaxinfer


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _receive(stream):
    head = stream.read(4)
    if len(head) < 4:
        raise EOFError("a tokenizer worker closed its pipe")
    (size,) = struct.unpack(">I", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("a tokenizer worker closed its pipe mid-message")
    return pickle.loads(data)


def main() -> None:
    """A worker: loads the tokenizer sent first, then encodes each request until its input ends."""
    from tokenizers import Tokenizer

    # The protocol keeps file descriptor 1 to itself: anything else printed, by Python or native code, goes to stderr.
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        tok = Tokenizer.from_str(_receive(stdin))
    except EOFError:
        return
    tok.encode_special_tokens = True  # as jaxinfer's Tokenizer: user text never becomes a special token
    while True:
        try:
            texts, add_special_tokens = _receive(stdin)
        except EOFError:
            return
        _send(stdout, [tok.encode(t, add_special_tokens=add_special_tokens).ids for t in texts])


def _split(texts: Sequence[str], n: int) -> list[list[str]]:
    """``texts`` in ``n`` contiguous runs of about equal characters (some may be empty)."""
    total = sum(map(len, texts))
    groups, seen = [[] for _ in range(n)], 0
    for text in texts:
        k = min(n - 1, seen * n // total) if total else 0
        groups[k].append(text)
        seen += len(text)
    return groups


class Workers:
    """``n`` worker processes of one tokenizer (its ``tokenizers`` JSON), started at the first ``encode``."""

    def __init__(self, tokenizer_json: str, n: int):
        self.n = n
        self._json = tokenizer_json
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        """Each text's ids, the texts shared out between the workers in order. Raises OSError or EOFError when a
        worker cannot be started or dies (the workers are then stopped; the caller encodes in its own process)."""
        with self._lock:
            try:
                procs = self._start()
                groups = _split(texts, len(procs))
                for proc, group in zip(procs, groups):
                    _send(proc.stdin, (group, add_special_tokens))
                return [ids for proc in procs for ids in _receive(proc.stdout)]
            except (OSError, EOFError):
                self._stop()
                raise

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> list[subprocess.Popen]:
        if not self._procs:
            # The children import this package from where this process found it.
            root = os.path.dirname(os.path.dirname(os.path.abspath(jaxinfer.__file__)))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            for _ in range(self.n):
                proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env)
                self._procs.append(proc)
                _send(proc.stdin, self._json)
            atexit.register(self.close)
        return self._procs

    def _stop(self) -> None:
        for proc in self._procs:
            try:
                proc.stdin.close()
                proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            proc.stdout.close()
        self._procs = []


if __name__ == "__main__":
    main()
