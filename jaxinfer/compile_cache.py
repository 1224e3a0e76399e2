"""JAX's persistent compilation cache for jaxinfer's programs (the CLI's --compilation-cache, LLM's
compilation_cache). vLLM and SGLang keep their compiled graphs between runs by default too (~/.cache/vllm); JAX's
own cache (jax_compilation_cache_dir) does it for XLA programs. It is process-wide: with it on, the caller's own
jitted programs are cached as well."""

from __future__ import annotations

import os
import pathlib


def compilation_cache_dir(flag: str | None) -> str | None:
    """The cache directory for a --compilation-cache / compilation_cache value: the value itself, None for "off",
    and for None $JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/jaxinfer/jax (~/.cache/jaxinfer/jax)."""
    if flag == "off":
        return None
    if flag:
        return flag
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(pathlib.Path(base) / "jaxinfer" / "jax")


def enable_compilation_cache(option: str | None) -> str | None:
    """Applies LLM(compilation_cache=option): "off" leaves JAX's configuration alone; None keeps a cache directory
    JAX already has (set by the caller, the CLI or $JAX_COMPILATION_CACHE_DIR) and otherwise sets the default one;
    a path sets that one. Returns JAX's cache directory afterwards (None: no cache)."""
    import jax

    if isinstance(option, os.PathLike):
        option = os.fspath(option)
    if option is not None and (not isinstance(option, str) or not option):
        raise ValueError(f"compilation_cache must be None, 'off' or a directory, got {option!r}")
    current = jax.config.jax_compilation_cache_dir
    if option == "off" or (option is None and current):
        return current
    path = compilation_cache_dir(option)
    jax.config.update("jax_compilation_cache_dir", path)
    return path
