"""Reading optimized HLO text in tests: which arrays a compiled program writes into buffers."""

import re


def materialized_shapes(hlo: str) -> set[str]:
    """Result shapes ("f32[16,64]") of the instructions an optimized HLO module computes into buffers: those of
    every computation except fusion bodies (whose values stay in registers), parameters and aliases excluded."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", hlo))
    shapes, skip = set(), True
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?(%[\w.\-]+) \(.*\{$", line)
        if header:
            skip = header.group(1) in fused
        elif not skip and " = " in line:
            m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+\[[\d,]*\])\S* (\S+?)\(", line)
            if m and m.group(2) not in ("parameter", "get-tuple-element", "bitcast", "tuple"):
                shapes.add(m.group(1))
    return shapes
