"""Collectives read off compiled HLO text, with the bytes each device moves, and a
compiled program's peak memory per device (``peak_memory``).

Handles explicit replica groups ``{{0,1,2,3},{4,5,6,7}}``, iota groups
``[2,4]<=[8]`` / ``[2,4]<=[4,2]T(1,0)``, tuple-shaped results, and async pairs
(``all-gather-start`` ... ``all-gather-done`` counts once). Bytes per device use
ring algorithms on the per-device buffers: all-reduce 2(n-1)/n*S, all-gather
(n-1)*S_in, reduce-scatter (n-1)/n*S_in, all-to-all (n-1)/n*S, collective-permute S.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "s32": 4, "s64": 8, "u32": 4, "u64": 8, "s8": 1, "u8": 1,
             "pred": 1, "s16": 2, "u16": 2}
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>\(.*?\)|[a-z0-9]+\[[^\]]*\](?:\{[^}]*\})?)\s+"
                   r"(?P<op>[a-z\-]+)\(")
_ARRAY = re.compile(r"([a-z0-9]+)\[([^\]]*)\]")


def peak_memory(compiled) -> int:
    """Peak bytes per device of a compiled program, from its ``memory_analysis()``:
    arguments + outputs + temporaries - the outputs that alias (donated) arguments."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape, summed over a tuple's elements."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in dims.split(","):
            if d.strip():
                n *= int(d)
        total += n * _ITEMSIZE.get(dtype, 4)
    return total


def group_size(line: str, default: int) -> int:
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
    if m:
        dims = [int(x) for x in m.group(1).split(",")]
        n = 1
        for d in dims[1:]:
            n *= d
        return n
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m and m.group(1):
        return len(m.group(1).split(","))
    m = re.search(r"source_target_pairs=\{(.*?)\}\s*[,}]", line)
    return default


def wire_bytes(kind: str, out_bytes: int, n: int) -> float:
    if kind == "collective-permute":
        return float(out_bytes)
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * out_bytes
    if kind == "all-gather":
        return (n - 1) * out_bytes / n          # input is out/n
    if kind == "reduce-scatter":
        return float((n - 1) * out_bytes)       # input is out*n
    if kind == "all-to-all":
        return (n - 1) / n * out_bytes
    raise ValueError(kind)


@dataclass
class Collectives:
    counts: Counter = field(default_factory=Counter)
    bytes: float = 0.0
    ops: list = field(default_factory=list)   # (kind, per-device bytes of the result, group size)

    def add(self, kind, out_bytes, n):
        self.counts[kind] += 1
        self.bytes += wire_bytes(kind, out_bytes, n)
        self.ops.append((kind, out_bytes, n))

    def summary(self) -> str:
        return " ".join(f"{k.replace('collective-', '')}:{v}" for k, v in sorted(self.counts.items())) or "-"


def collectives(hlo_text: str, num_devices: int) -> Collectives:
    out = Collectives()
    for line in hlo_text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        op = m.group("op")
        if op.endswith("-done"):
            continue
        kind = op[:-len("-start")] if op.endswith("-start") else op
        if kind not in KINDS:
            continue
        shape = m.group("shape")
        if op.endswith("-start") and shape.startswith("("):
            # async start returns (operands..., results..., [context]): the result is the last array
            arrays = _ARRAY.findall(shape)
            res_dtype, res_dims = arrays[len(arrays) // 2] if kind != "collective-permute" else arrays[-1]
            shape = f"{res_dtype}[{res_dims}]"
        out.add(kind, shape_bytes(shape), group_size(line, num_devices))
    return out


# -- where a step's time goes: a jax.profiler trace summed by HLO instruction -------------
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+(?P<op>[a-z\-]+)\(")


def opcodes(hlo_text: str) -> dict:
    """Instruction name -> what it is: its opcode, a fusion by its name's stem (XLA:CPU names
    a fusion after what it fuses: ``ynn_fusion.34`` -> ``fusion:ynn_fusion``), the async
    collectives by their kind."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        op = m.group("op")
        if op == "fusion":
            op = "fusion:" + re.sub(r"[._]?\d+$", "", m.group("name"))
        out[m.group("name")] = op[:-len("-start")] if op.endswith("-start") else op
    return out


def time_by_opcode(trace_events, hlo_text: str) -> Counter:
    """Microseconds per opcode (``opcodes``) summed over the complete events of a
    ``jax.profiler`` trace (its ``traceEvents``) that name an instruction of ``hlo_text``;
    runtime events (executor waits, rendezvous) are left out. On devices that share
    cores an event's duration is wall time: a collective's holds its wait for the group,
    and a compute op's time while its thread was descheduled."""
    names = opcodes(hlo_text)
    out: Counter = Counter()
    for e in trace_events:
        if e.get("ph") == "X" and e.get("name") in names:
            out[names[e["name"]]] += e.get("dur", 0)
    return out


def read_trace(trace_dir) -> list:
    """The events of the newest ``jax.profiler.trace(trace_dir)`` run."""
    import glob
    import gzip
    import json
    files = sorted(glob.glob(f"{trace_dir}/plugins/profile/*/*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no jax.profiler trace under {trace_dir}")
    with gzip.open(files[-1]) as f:
        return json.load(f)["traceEvents"]
