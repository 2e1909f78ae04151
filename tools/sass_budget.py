"""The instruction budget of the experts engine's main loops (and, with ``--gemm``, of one
``fast.gemm`` kernel's), read from the machine code (CPU only, no GPU): each loop copy's
warp instructions per 512 bytes of weights (one warp's m-tile chunk: 16 rows x 64 k of
MXFP4; for ``fast.gemm`` 16 rows x 16 k of BF16), by kind, with the kernel's registers and
stack frame.

    python tools/sass_budget.py                       # DEP16 FC1/FC2, 4 windows, mma.sync
    python tools/sass_budget.py --geometry tp8 --windows 2 --tactic walk=4
    python tools/sass_budget.py --tactic wgmma=1 --kernels fc1
    python tools/sass_budget.py --gemm warps=2,mtiles=2,windows=1,ring=8,stage_k=64   # one fast.gemm kernel

The kernels are compiled for ``--arch`` by ``sass_digest``'s compile (the DSL's cubin dump)
and disassembled by ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel of the dev extra, or
one on ``PATH``). A loop is a block that branches back to its own start; the engine's main
loops are the loops that hold MMA instructions, one copy per count of live windows
(``ExpertsGemmKernel._main_loop``). A copy streams ``mtiles x stage_chunks`` chunks of
512 B per warp and iteration (``stages`` of them in a walked FC2 tile, whose stages are
unrolled), so per 512 B it issues its instruction count over that; its live windows are
read from its MMAs (``mma.m16n8k16``: 4 per chunk and window; ``wgmma m64nNk16``: N / 8).

Static counts: every instruction of the loop body once, as every iteration issues it
(a predicated instruction still takes its issue slot); the Nsight Compute source counters
give the dynamic ones on a GPU.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python tools/sass_budget.py): the repository first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.ptx_dump import elf_sections, run_compile  # noqa: E402
from tools.sass_digest import compile_set  # noqa: E402

#: instruction kinds, by opcode (the first word, modifiers dropped)
KINDS = {
    "mma": {"HMMA", "HGMMA"},
    "decode": {"LOP3", "SHF", "PRMT", "HMUL2", "HFMA2", "IMAD"},
    "shared": {"LDS", "STS", "LDSM"},
    "copy": {"LDGSTS", "LDG", "LDGDEPBAR", "STG"},
    "sync": {"BAR", "DEPBAR", "WARPGROUP", "WARPSYNC", "SHFL", "MEMBAR", "FENCE"},
}
KIND_ORDER = ("decode", "mma", "shared", "copy", "sync", "other")

def nvdisasm() -> str:
    """The ``nvdisasm`` executable: the dev extra's ``nvidia-cuda-nvdisasm`` wheel, else
    ``PATH``'s; a clear error when neither exists."""
    try:
        import nvidia.cu13  # the wheel's namespace package (nvidia/cu13/bin/nvdisasm)

        for root in nvidia.cu13.__path__:
            candidate = Path(root) / "bin" / "nvdisasm"
            if candidate.is_file():
                return str(candidate)
    except ImportError:
        pass
    found = shutil.which("nvdisasm")
    if found is None:
        raise RuntimeError("sass_budget: nvdisasm not found: install the dev extra "
                           "(nvidia-cuda-nvdisasm) or put a CUDA toolkit's bin on PATH")
    return found


def kernel_attributes(cubin: bytes) -> dict[str, int]:
    """``registers`` (EIATTR_REGCOUNT) and ``frame`` bytes (EIATTR_FRAME_SIZE: the local
    stack, where spills go) of the cubin's one kernel, from its ``.nv.info`` records
    (format byte, attribute byte, then per format: none, a 16-bit value, or a 16-bit size
    and that many bytes; REGCOUNT and FRAME_SIZE hold (symbol, value) words)."""
    found = {}
    info = elf_sections(cubin).get(b".nv.info", b"")
    at = 0
    while at + 2 <= len(info):
        fmt, attr = info[at], info[at + 1]
        if fmt == 0x04:  # EIFMT_SVAL
            size = struct.unpack_from("<H", info, at + 2)[0]
            payload = info[at + 4:at + 4 + size]
            at += 4 + size
            if attr in (0x2F, 0x11) and size == 8:
                found["registers" if attr == 0x2F else "frame"] = struct.unpack_from("<II", payload)[1]
        elif fmt == 0x03:  # EIFMT_HVAL
            at += 4
        else:  # EIFMT_NVAL and others without a payload
            at += 2
    return found


@dataclass
class Instruction:
    index: int
    opcode: str  # the first word without modifiers, e.g. "HGMMA"
    text: str
    predicated: bool


_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"BRA\s+(?:\S+\s+)?`\((\.L_x_\d+)\)")
_ENDS = {"EXIT", "RET", "BRA", "JMP", "BRX", "JMX"}


def parse(sass: str) -> tuple[list[Instruction], dict[str, int]]:
    """The instructions of an ``nvdisasm -c`` listing in order, and each label's index (the
    instruction it precedes)."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        m = _LINE.match(line)
        if m:
            instructions.append(Instruction(len(instructions), m.group(3), m.group(0).strip(),
                                            m.group(2) is not None))
    return instructions, labels


def loops(instructions: list[Instruction], labels: dict[str, int]) -> list[list[int]]:
    """The innermost loops, each as the sorted indices of its instructions. Basic blocks
    end at a branch or exit and start at a label; a back edge is a branch to a block that
    dominates it (every path from the entry to the branch passes that block), and its loop
    the blocks that reach the branch without passing the block, so a block the compiler
    placed out of line (a loop's conditional copies, before or after it) is counted with
    the loop. Loops that hold another loop's first block are left out."""
    starts = sorted({0, *labels.values()} | {i.index + 1 for i in instructions
                                             if i.opcode in _ENDS})
    starts = [s for s in starts if s < len(instructions)]
    block_of, blocks = {}, []
    for n, first in enumerate(starts):
        last = (starts[n + 1] if n + 1 < len(starts) else len(instructions)) - 1
        blocks.append((first, last))
        for i in range(first, last + 1):
            block_of[i] = n
    count = len(blocks)
    preds: dict[int, set[int]] = {n: set() for n in range(count)}
    edges = []
    for n, (first, last) in enumerate(blocks):
        end = instructions[last]
        target = _TARGET.search(end.text) if end.opcode == "BRA" else None
        if target and labels.get(target.group(1), len(instructions)) < len(instructions):
            edges.append((n, block_of[labels[target.group(1)]]))
        if (end.opcode not in _ENDS or end.predicated) and n + 1 < count:
            edges.append((n, n + 1))
    for a, b in edges:
        preds[b].add(a)
    everything = (1 << count) - 1
    dom = [everything] * count  # bitsets: dom[n] has bit d when block d dominates n
    dom[0] = 1
    changed = True
    while changed:
        changed = False
        for n in range(1, count):
            meet = everything
            for p in preds[n]:
                meet &= dom[p]
            new = meet | (1 << n) if preds[n] else 1 << n
            if new != dom[n]:
                dom[n], changed = new, True
    found = []
    for tail, head in edges:
        if dom[tail] >> head & 1:  # a loop of one block (tail == head) has nothing to walk
            body, todo = {head, tail}, [tail] if tail != head else []
            while todo:
                for p in preds[todo.pop()]:
                    if p not in body:
                        body.add(p)
                        todo.append(p)
            found.append((head, body))
    inner = [(head, body) for head, body in found
             if not any(other != head and other in body for other, _ in found)]
    return [sorted(i for b in sorted(body) for i in range(blocks[b][0], blocks[b][1] + 1))
            for _, body in inner]


def kind(opcode: str) -> str:
    for name, opcodes in KINDS.items():
        if opcode in opcodes:
            return name
    return "other"


@dataclass
class LoopBudget:
    live: int
    instructions: int
    units: int  # 512-byte weight chunks per warp and iteration
    kinds: dict[str, int] = field(default_factory=dict)
    mma_waits: int = 0  # WARPGROUP.DEPBAR: waits for warpgroup MMA groups, per iteration

    def per_unit(self, name: str | None = None) -> float:
        return (self.instructions if name is None else self.kinds.get(name, 0)) / self.units


def main_loops(instructions: list[Instruction], labels: dict[str, int],
               units: int, mma_per_chunk: int = 4) -> list[tuple[list[int], int]]:
    """(instruction indices, live windows) of every main loop: the innermost loops with
    MMA instructions, whose iteration streams ``units`` 512-byte chunks per warp; the live
    windows are ``N / 8`` of a ``wgmma m64nNk16``, or an ``mma.sync`` loop's MMAs over
    ``mma_per_chunk`` per chunk and window (4 for 16 x 64 MXFP4 codes, 1 for 16 x 16 BF16)."""
    found = []
    for indices in loops(instructions, labels):
        mma = [instructions[i] for i in indices if instructions[i].opcode in KINDS["mma"]]
        if mma:
            wide = re.search(r"HGMMA\.64x(\d+)x16", mma[0].text)
            found.append((indices, int(wide.group(1)) // 8 if wide else len(mma) // (mma_per_chunk * units)))
    return found


def loop_budgets(sass: str, units: int, mma_per_chunk: int = 4) -> list[LoopBudget]:
    """The main loops of a listing whose loop iteration streams ``units`` 512-byte chunks
    per warp (:func:`main_loops`), by live windows."""
    instructions, labels = parse(sass)
    budgets = []
    for indices, live in main_loops(instructions, labels, units, mma_per_chunk):
        body = [instructions[i] for i in indices]
        counts: dict[str, int] = {}
        for i in body:
            counts[kind(i.opcode)] = counts.get(kind(i.opcode), 0) + 1
        waits = sum(1 for i in body if i.opcode == "WARPGROUP" and "WARPGROUP.DEPBAR" in i.text)
        budgets.append(LoopBudget(live, len(body), units, counts, waits))
    return sorted(budgets, key=lambda b: b.live)


def _spec(geometry: str, windows: int, tactic: dict) -> dict:
    """``sass_digest``'s experts engine spec of one budget (not strict, empty rows)."""
    return {"budget": (geometry, windows, False, True, tactic)}


def one_cubin(directory: Path, what: str) -> Path:
    """The one cubin a compile dumped into ``directory`` (``what`` names it in the error)."""
    cubins = sorted(directory.rglob("*.cubin"))
    if len(cubins) != 1:
        raise RuntimeError(f"{what}: expected one cubin, the compile dumped {len(cubins)}")
    return cubins[0]


def disassembled(cubin: Path) -> tuple[dict, str]:
    """(kernel attributes, ``nvdisasm`` listing) of a cubin."""
    sass = subprocess.run([nvdisasm(), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    return kernel_attributes(cubin.read_bytes()), sass


def compile_cubin(arch: str, geometry: str, windows: int, tactic: dict, kernel: str,
                  directory: Path) -> Path:
    """Compile one engine kernel into ``directory`` (``sass_digest``'s compile); its cubin."""
    compile_set([arch, "experts", "budget", kernel], directory, _spec(geometry, windows, tactic))
    return one_cubin(directory, kernel)


def kernel_units(arch: str, geometry: str, windows: int, tactic: dict) -> dict[str, int]:
    """512-byte chunks per warp and main-loop iteration of the FC1 and FC2 kernels."""
    from fast.experts.kernels import ExpertsGemmKernel

    params = ast.literal_eval(compile_set([arch, "experts", "budget", "?params"],
                                       engines=_spec(geometry, windows, tactic)))
    units = {}
    for name in ("fc1", "fc2"):
        k = ExpertsGemmKernel(**dict(params[name]))
        units[name] = k.mtiles * k.stage_chunks * (k.stages if k.walk > 1 else 1)
    return units


def budget(arch: str, geometry: str, windows: int, tactic: str,
           kernels=("fc1", "fc2")) -> list[tuple[str, dict, list[LoopBudget]]]:
    """(kernel, attributes, loop budgets) of each of ``kernels`` at ``tactic``
    (``'wgmma=1,warps=8'``; the two-kernel path: the fused grid holds both GEMMs' loops,
    so ``fused=0`` is added)."""
    from benchmarks.experts_table import parse_tactic

    tactic = {**parse_tactic(tactic), "fused": 0}
    units = kernel_units(arch, geometry, windows, tactic)
    out = []
    for name in kernels:
        with tempfile.TemporaryDirectory() as tmp:
            attrs, sass = disassembled(compile_cubin(arch, geometry, windows, tactic, name, Path(tmp)))
            out.append((name, attrs, loop_budgets(sass, units[name])))
    return out


_GEMM_COMPILE = """
import ast, sys
from fast.gemm.host import compile_kernel
compile_kernel(sys.argv[1], **ast.literal_eval(sys.argv[2]))
"""


def gemm_budget(arch: str, params: dict) -> tuple[dict, list[LoopBudget]]:
    """The main loop of one ``fast.gemm`` kernel (``SplitKGemmKernel(**params)``, e.g. a
    ``Tactic.kernel_params``; flags such as ``wgmma`` may be given as 0/1): (kernel attributes, loop budgets) per 512 B of BF16 weights,
    one warp's m-tile over 16 k (16 rows x 16 k), of which a loop iteration (one stage)
    streams ``mtiles x stage_k / 16`` per warp, with one ``mma.m16n8k16`` (or one warp's
    share of a ``wgmma m64nNk16``) per chunk and window."""
    from fast.gemm.kernel import SplitKGemmKernel

    k = SplitKGemmKernel(**params)
    units = k.mtiles * k.stage_k // 16
    with tempfile.TemporaryDirectory() as tmp:
        run_compile(_GEMM_COMPILE, [arch, repr(params)], keep="cubin", dump_dir=Path(tmp))
        attrs, sass = disassembled(one_cubin(Path(tmp), f"gemm {params}"))
    return attrs, loop_budgets(sass, units, mma_per_chunk=1)


def ncu_listing(path: Path) -> tuple[str, list[dict[str, str]]]:
    """An ``nvdisasm``-style listing (labels at branch targets) and the per-instruction
    rows of Nsight Compute's SASS source page of one kernel
    (``ncu -i REPORT --page source --csv --print-source sass``)."""
    import csv
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        table = list(csv.reader(f))
    at = next(i for i, row in enumerate(table) if row[:2] == ["Address", "Source"])
    header, rows = table[at], [r for r in table[at + 1:] if len(r) == len(table[at])]
    records = [dict(zip(header, r)) for r in rows]
    targets = {m.group(1) for r in records if (m := re.search(r"BRA (0x[0-9a-f]+)", r["Source"]))}
    lines = []
    for n, r in enumerate(records):
        if r["Address"] in targets:
            lines.append(f".L_x_{int(r['Address'], 16)}:")
        text = re.sub(r"BRA (0x[0-9a-f]+)", lambda m: f"BRA `(.L_x_{int(m.group(1), 16)})",
                      r["Source"].strip())
        lines.append(f"        /*{n:04x}*/ {text} ;")
    return "\n".join(lines), records


def ncu_regions(path: Path, units: float,
                loop_units: int = 4) -> list[tuple[str, float, float, dict[str, float]]]:
    """Per main loop (by live windows) and for the rest of the kernel: the instructions
    executed per 512 B of weights (``units``: the kernel's 512-byte chunks, e.g. touched
    experts x rows x K x 17/32 / 512), the share of the warp-state samples, and the
    samples' largest stall reasons (shares of the region's samples), from Nsight Compute's
    source page (:func:`ncu_listing`). ``loop_units``: 512-byte chunks per warp and loop
    iteration (m-tiles x chunks per stage), to read an ``mma.sync`` loop's live windows."""
    listing, records = ncu_listing(path)
    instructions, labels = parse(listing)
    reasons = [k for k in records[0] if k.startswith("stall_") and "Not Issued" not in k]

    def region(indices):
        executed = sum(int(records[i]["Instructions Executed"]) for i in indices)
        samples = sum(int(records[i]["Warp Stall Sampling (All Samples)"]) for i in indices)
        stalls = {k[6:]: sum(int(records[i][k]) for i in indices) / max(samples, 1)
                  for k in reasons}
        return executed / units, samples, dict(sorted(stalls.items(), key=lambda kv: -kv[1]))

    everything = region(range(len(records)))[1]
    out, inside = [], set()
    for indices, live in main_loops(instructions, labels, loop_units):
        per_unit, samples, stalls = region(indices)
        if samples == 0 and per_unit == 0:
            continue
        out.append((f"main loop, {live} live window{'s' * (live > 1)}",
                    per_unit, samples / everything, stalls))
        inside.update(indices)
    per_unit, samples, stalls = region([i for i in range(len(records)) if i not in inside])
    out.append(("rest of the kernel", per_unit, samples / everything, stalls))
    return out


def render(title: str, rows) -> str:
    lines = [f"{title}", "",
             "| kernel | registers | frame B | live windows | per 512 B | "
             + " | ".join(KIND_ORDER) + " |",
             "|---|---|---|---|---|" + "---|" * len(KIND_ORDER)]
    for name, attrs, budgets in rows:
        for b in budgets:
            lines.append(f"| {name} | {attrs.get('registers', '?')} | {attrs.get('frame', '?')} | "
                         f"{b.live} | {b.per_unit():.1f} | "
                         + " | ".join(f"{b.per_unit(k):.1f}" for k in KIND_ORDER) + " |")
    return "\n".join(lines) + "\n"


def render_regions(title: str, regions) -> str:
    lines = [title, "", "| region | executed per 512 B | share of samples | largest stalls |",
             "|---|---|---|---|"]
    for name, per_unit, share, stalls in regions:
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(stalls.items())[:4])
        lines.append(f"| {name} | {per_unit:.1f} | {share:.2f} | {top} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--geometry", choices=("dep16", "tp8"), default="dep16")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--tactic", default="", help="e.g. 'wgmma=1' or 'warps=8,mtiles=2'")
    ap.add_argument("--kernels", default="fc1,fc2")
    ap.add_argument("--gemm", metavar="PARAMS",
                    help="instead: one fast.gemm kernel's main loop, e.g. "
                         "'warps=2,mtiles=2,windows=1,ring=8,stage_k=64,occupancy=2' (per 512 B of "
                         "BF16 weights)")
    ap.add_argument("--ncu-csv", type=Path,
                    help="instead: the dynamic budget from Nsight Compute's SASS source page")
    ap.add_argument("--units", type=float,
                    help="with --ncu-csv: the kernel's 512-byte weight chunks")
    ap.add_argument("--loop-units", type=int, default=4,
                    help="with --ncu-csv: 512-byte chunks per warp and main-loop iteration")
    args = ap.parse_args(argv)
    if args.gemm:
        from benchmarks.experts_table import parse_tactic  # 'key=int,...', as --tactic

        attrs, budgets = gemm_budget(args.arch, parse_tactic(args.gemm))
        print(render(f"{args.arch} fast.gemm {args.gemm} (per 512 B of BF16 weights)",
                     [("gemm", attrs, budgets)]), end="")
        return 0
    if args.ncu_csv:
        if not args.units:
            ap.error("--ncu-csv needs --units (the kernel's 512-byte weight chunks)")
        print(render_regions(f"{args.ncu_csv.name}: {args.units:.0f} chunks of 512 B",
                             ncu_regions(args.ncu_csv, args.units, args.loop_units)), end="")
        return 0
    rows = budget(args.arch, args.geometry, args.windows, args.tactic,
                  tuple(args.kernels.split(",")))
    print(render(f"{args.arch} {args.geometry}, {args.windows} windows, tactic "
                 f"'{args.tactic or 'none: mma.sync, 4 warps of 2 m-tiles'}' (two kernels)",
                 rows), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
