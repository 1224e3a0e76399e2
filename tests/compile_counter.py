"""Counting XLA compilations with jax.monitoring (the bounded-compilation tests)."""

from __future__ import annotations

import jax


class CompileCounter:
    """Counts backend-compile events while active. JAX records the event around ``compile_or_get_cached``, so
    an executable read back from the persistent compilation cache counts too: a warm cache hides nothing."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self.active = False

    def on_duration(self, event, duration, **kwargs):
        if self.active and event == self.EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self.on_duration)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self.on_duration)

    def measure(self, fn):
        self.count, self.active = 0, True
        try:
            fn()
        finally:
            self.active = False
        return self.count
