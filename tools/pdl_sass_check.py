#!/usr/bin/env python3
"""Lists the non-coherent global loads that ptxas scheduled above griddepcontrol.wait.

A kernel launched with programmatic dependent launch (kernels/cuda/cuda_util.cuh, PdlWait) starts
while the previous kernel of the stream still runs, and must read what that kernel writes only
after griddepcontrol.wait (SASS: ACQBULK). ptxas takes an ld.global.nc (SASS: LDG...CONSTANT:
__ldg, LoadStreaming, or a load through a const __restrict__ pointer that nvcc turns into one) as
reading memory that nothing writes while the kernel runs, so it may move such a load above the
wait when its address is known earlier. 7972ea7's bf16 mma decode kernel had its q loads moved
so, and read q before the previous kernel had written it (kernels/cuda/NOTES.md, session 32).

For every wait of every kernel, this prints the LDG...CONSTANT instructions placed before the wait
in the SASS whose source line (the kernel-level line of the -lineinfo record: the call site of
an inlined helper) comes after the wait's own line in the same file: loads written after the wait
but scheduled before it. It is a listing check, not a proof: it does not follow branches, and a
kernel whose wait and loads sit in one inlined helper has them on one line, which it cannot order.

Inputs: cubins (ELF), .cu files (compiled here to a -lineinfo cubin with the project's CUDA flags),
or binaries (their cubins extracted with cuobjdump -xelf). Exit status 1 when a load is listed.

Usage: tools/pdl_sass_check.py [--nvdisasm PATH] [--cuobjdump PATH] [--nvcc PATH] FILE...
  Compile with -lineinfo (the CUDA build does) for source lines; without them nothing is listed.
  An nvdisasm older than the nvcc that made the cubin (e.g. Debian's CUDA 11.8 one against a
  CUDA 13 cubin: "does not contain Cuda architecture information") reads a copy whose ELF header
  is rewritten to the older layout (ABI version 7, e_flags SM | virtual SM << 16 | 64-bit | TEX);
  the instruction encoding of sm_90 is the same.
"""
import argparse
import glob
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tool(name, given):
    for p in [given, shutil.which(name), f"/usr/local/cuda/bin/{name}"]:
        if p and os.path.exists(p):
            return p
    sys.exit(f"pdl_sass_check: {name} not found (give --{name} PATH)")


def old_header_copy(cubin, tmp):
    """A copy of cubin with the pre-CUDA-12.8 ELF header (ABI version 7) for an older nvdisasm."""
    data = bytearray(open(cubin, "rb").read())
    flags = struct.unpack_from("<I", data, 0x30)[0]
    sm = (flags >> 8) & 0xFF if data[8] >= 8 else flags & 0xFF
    data[8] = 7
    struct.pack_into("<I", data, 0x30, sm | (sm << 16) | 0x400 | 0x100)
    out = os.path.join(tmp, os.path.basename(cubin) + ".abi7")
    open(out, "wb").write(data)
    return out


def disassemble(nvdisasm, cubin, tmp):
    r = subprocess.run([nvdisasm, "-c", "-gi", cubin], capture_output=True, text=True)
    if r.returncode != 0 and "architecture information" in r.stderr:
        r = subprocess.run([nvdisasm, "-c", "-gi", old_header_copy(cubin, tmp)],
                           capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"pdl_sass_check: {nvdisasm} failed on {cubin}: {r.stderr.strip()[:300]}")
    return r.stdout


def kernel_line(path, line, rest):
    """The location to order by: a CUDA header's line is taken at its call site."""
    m = re.search(r'inlined at "([^"]+)", line (\d+)', rest)
    if path.startswith("/usr/") and m:
        return os.path.basename(m.group(1)), int(m.group(2))
    return os.path.basename(path), int(line)


def parse(sass):
    """{kernel: [(address, instruction, (file, line))]} of a disassembly with line records."""
    kernels, name, loc = {}, None, ("", 0)
    for text in sass.splitlines():
        m = re.match(r"^\s*\.section\s+\.text\.([^,]+),", text)
        if m:
            name = m.group(1)
            kernels[name] = []
            continue
        # -gi writes one record per inlining level, innermost first: the last one before an
        # instruction is the kernel-level line.
        m = re.match(r'^\s*//## File "([^"]+)", line (\d+)(.*)', text)
        if m:
            loc = kernel_line(m.group(1), m.group(2), m.group(3))
            continue
        m = re.match(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", text)
        if m and name:
            kernels[name].append((m.group(1), m.group(2), loc))
    return kernels


def hoisted(instructions):
    """The nc loads placed before a wait but written after it: [(address, instruction, loc, wait)]."""
    found, seen = [], set()
    for i, (_, ins, wait_loc) in enumerate(instructions):
        if not ins.startswith("ACQBULK"):
            continue
        for addr, load, loc in instructions[:i]:
            if (re.search(r"\bLDG\.", load) and "CONSTANT" in load and loc[0] == wait_loc[0] and
                    loc[1] > wait_loc[1] and addr not in seen):
                seen.add(addr)
                found.append((addr, load, loc, wait_loc))
    return found


def demangle(names):
    r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return r.stdout.splitlines() if r.returncode == 0 else names


def cubins_of(path, args, tmp):
    if path.endswith(".cu"):
        out = os.path.join(tmp, os.path.basename(path) + ".cubin")
        cmd = [tool("nvcc", args.nvcc), f"-I{ROOT}", "-O3", "-DNDEBUG", "-std=c++17",
               "--expt-relaxed-constexpr", "-lineinfo", f"--generate-code=arch={args.arch}",
               "-cubin", "-x", "cu", path, "-o", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"pdl_sass_check: nvcc failed on {path}:\n{r.stderr[-2000:]}")
        return [out]
    with open(path, "rb") as f:
        head = f.read(20)
    if head[:4] == b"\x7fELF" and struct.unpack_from("<H", head, 18)[0] == 190:  # EM_CUDA
        return [path]
    d = os.path.join(tmp, os.path.basename(path) + ".elf")
    os.makedirs(d, exist_ok=True)
    r = subprocess.run([tool("cuobjdump", args.cuobjdump), "-xelf", "all", os.path.abspath(path)],
                       cwd=d, capture_output=True, text=True)
    if "does not contain device code" in r.stdout + r.stderr:  # a host-only binary (rc 255)
        print(f"pdl_sass_check: {path}: no device code, skipped")
        return []
    if r.returncode != 0:
        sys.exit(f"pdl_sass_check: cuobjdump -xelf failed on {path}: {r.stderr.strip()[:300]}")
    return sorted(glob.glob(os.path.join(d, "*.cubin")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--nvdisasm")
    ap.add_argument("--cuobjdump")
    ap.add_argument("--nvcc")
    ap.add_argument("--arch", default="compute_90a,code=[sm_90a]",
                    help="--generate-code for .cu inputs (default the CUDA build's)")
    args = ap.parse_args()
    nvdisasm = tool("nvdisasm", args.nvdisasm)
    bad = checked = 0
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.files:
            for cubin in cubins_of(path, args, tmp):
                kernels = parse(disassemble(nvdisasm, cubin, tmp))
                names = [n for n, ins in kernels.items() if any(i.startswith("ACQBULK")
                                                                for _, i, _ in ins)]
                for name, pretty in zip(names, demangle(names)):
                    checked += 1
                    loads = hoisted(kernels[name])
                    if not loads:
                        continue
                    bad += 1
                    print(f"{os.path.basename(path)}: {pretty}")
                    for addr, load, loc, wait in loads:
                        print(f"  /*{addr}*/ {load}   {loc[0]}:{loc[1]}, after the wait at line "
                              f"{wait[1]}")
    print(f"pdl_sass_check: {checked} kernels with griddepcontrol.wait, {bad} with nc loads "
          f"scheduled above it")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
