#!/usr/bin/env python3
"""Unit tests of tools/pdl_sass_check.py without CUDA tools: its reading of nvdisasm -c -gi
output (an excerpt of 7972ea7's bf16 mma decode kernel, whose q loads ptxas scheduled above
griddepcontrol.wait) and the ELF header rewrite for an older nvdisasm."""

import os
import struct
import sys
import tempfile
import unittest

ROOT = os.environ.get("TPSERVE_SOURCE_DIR") or os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import pdl_sass_check as check  # noqa: E402

KERNEL = ("_ZN7tpserve4cuda43_GLOBAL__N__68fe93cb_10_ad_7972_cu_70ba521019DecodeMmaBf16KernelINS0_6KvBf16"
          "ELi128ELi1ELi1ELb0EEEvPK13__nv_bfloat16PKhS8_PKfSA_PKiSC_SC_SC_PK4int2iiiiifPjPfPS4_iii")

# nvdisasm -c -gi of `nvcc -cubin -lineinfo` of 7972ea7's attention_decode.cu, this kernel's
# lines at 0x0220 (query_start, before the wait in the source too), 0x0aa0 (q, line 1169, written
# after PdlWait() at line 1158) and the wait at 0x0e70.
HOISTED = f"""
\t.section\t.text.{KERNEL},"ax",@progbits
\t//## File "/tmp/ad_7972.cu", line 401 inlined at "/tmp/ad_7972.cu", line 1134
\t//## File "/tmp/ad_7972.cu", line 1134
        /*0220*/                   LDG.E.CONSTANT R21, [R4.64] ;
        /*0a90*/                   CS2R R6, SRZ ;
\t//## File "/usr/local/cuda/include/sm_32_intrinsics.hpp", line 131 inlined at "/tmp/ad_7972.cu", line 1169
\t//## File "/tmp/ad_7972.cu", line 1169
        /*0aa0*/               @P1 LDG.E.128.CONSTANT R16, [R22.64] ;
\t//## File "/work/main/kernels/cuda/cuda_util.cuh", line 122 inlined at "/tmp/ad_7972.cu", line 1158
\t//## File "/tmp/ad_7972.cu", line 1158
        /*0e70*/                   ACQBULK ;
"""


class ParseTest(unittest.TestCase):
    def test_lists_the_q_load_above_the_wait_and_not_the_earlier_one(self):
        kernels = check.parse(HOISTED)
        self.assertEqual(list(kernels), [KERNEL])
        found = check.hoisted(kernels[KERNEL])
        self.assertEqual([(a, loc) for a, _, loc, _ in found], [("0aa0", ("ad_7972.cu", 1169))])
        self.assertEqual(found[0][3], ("ad_7972.cu", 1158))

    def test_a_coherent_load_in_the_same_place_is_not_listed(self):
        # What LoadProduced makes of it: ld.global.cg is LDG.E.128.STRONG.GPU.
        coherent = HOISTED.replace("LDG.E.128.CONSTANT", "LDG.E.128.STRONG.GPU")
        self.assertEqual(check.hoisted(check.parse(coherent)[KERNEL]), [])

    def test_the_same_load_after_the_wait_is_not_listed(self):
        lines = HOISTED.strip("\n").split("\n")
        load, wait = lines[4:7], lines[7:10]  # records + instruction of the load, of the wait
        reordered = "\n".join(lines[:4] + wait + load) + "\n"
        self.assertEqual(check.hoisted(check.parse(reordered)[KERNEL]), [])

    def test_a_kernel_without_a_wait_has_nothing_listed(self):
        no_wait = HOISTED.replace("ACQBULK", "EXIT")
        self.assertEqual(check.hoisted(check.parse(no_wait)[KERNEL]), [])


class HeaderTest(unittest.TestCase):
    def test_abi8_header_becomes_the_abi7_layout(self):
        # The first 64 bytes of a CUDA 13 sm_90a cubin: ABI version 8, e_flags 0x06005a04.
        head = bytearray(64)
        head[:9] = b"\x7fELF\x02\x01\x01\x41\x08"
        struct.pack_into("<H", head, 18, 190)
        struct.pack_into("<I", head, 0x30, 0x06005A04)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.cubin")
            open(path, "wb").write(bytes(head))
            out = open(check.old_header_copy(path, tmp), "rb").read()
        self.assertEqual(out[8], 7)
        # SM 90 | virtual SM 90 << 16 | 64-bit addresses | unified texture mode: what CUDA 11.8
        # writes for sm_90.
        self.assertEqual(struct.unpack_from("<I", out, 0x30)[0], 0x005A055A)


if __name__ == "__main__":
    unittest.main()
